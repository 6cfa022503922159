"""The hot routes as plain ASGI: append, finish and the SSE events.

A streaming client appends every 100-250 ms, so the append route is most of
a replica's work. FastAPI runs each request through its general machinery
(a Request and a Response, dependency resolution, query parsing, body
handling, response-model validation and encoding): py-spy put that at about
half of the append path's CPU (bench/README.md, section 2). These handlers do
only what the routes need, once each: the same identity and rate check, the
same service call, the answer encoded once with orjson.

``router.py`` still declares the routes, so their parameters, bodies and
answers stay in the OpenAPI document; each declaration names its handler here
with ``@served_by(handler)``, and ``install`` swaps the declared route's ASGI
app for that handler, so routing, the middlewares (request id, bounded
bodies, admission) and the error handlers stay the app's. Errors are raised,
as from any route, and the app's one handler renders the envelope.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from gateway import errors
from gateway.api.chunks import read_chunk
from gateway.output.sse import parse_last_event_id
from gateway.service.models import FinishRequest
from gateway.web.event_stream import EventStream
from gateway.web.resources import get_identity, get_resources
from gateway.web.validation import validation_error

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]
#: A route's declared function (FastAPI's endpoint).
Endpoint = Callable[..., Awaitable[Any]]

_JSON = (b"content-type", b"application/json")


async def send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    data = orjson.dumps(body)
    await send({"type": "http.response.start", "status": status,
                "headers": [_JSON, (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


async def append_chunk(scope: Scope, receive: Receive, send: Send) -> None:
    request = Request(scope, receive)
    # The declared route's order: identity (401/429), then enabled, then the body.
    identity = await get_identity(request)
    resources = get_resources(request)
    resources.service.check_enabled()
    chunk = await read_chunk(request, resources.settings)
    session_id = scope["path_params"]["session_id"]
    outcome = await resources.service.append(identity, session_id, chunk)
    await send_json(send, 200 if outcome.duplicate else 202, {
        "session_id": session_id, "sequence_id": chunk.sequence_id, "state": outcome.state.value,
        "duplicate": outcome.duplicate, "started": outcome.started,
        "next_sequence_id": outcome.next_sequence_id})


async def finish_session(scope: Scope, receive: Receive, send: Send) -> None:
    request = Request(scope, receive)
    # As FastAPI does for an optional JSON body: read and decode it first
    # (400 invalid_json before anything else), then the identity, then the model.
    raw = await request.body()
    decoded: Any = None
    if raw:
        content_type = request.headers.get("content-type", "")
        if content_type and not _is_json(content_type):
            decoded = raw  # not JSON: the model refuses it below, as FastAPI's would
        else:
            try:
                decoded = json.loads(raw)
            except ValueError as exc:
                raise errors.InvalidJson("request body is not valid JSON") from exc
    identity = await get_identity(request)
    try:
        body = None if decoded is None else FinishRequest.model_validate(decoded)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from exc
    session_id = scope["path_params"]["session_id"]
    outcome = await get_resources(request).service.finish(
        identity, session_id, body.final_sequence_id if body else None)
    await send_json(send, 202, {"session_id": session_id, "state": outcome.state.value,
                                "next_sequence_id": outcome.next_sequence_id,
                                "missing_sequence_ids": outcome.missing_sequence_ids})


async def stream_events(scope: Scope, receive: Receive, send: Send) -> None:
    request = Request(scope, receive)
    identity = await get_identity(request)
    resources = get_resources(request)
    after = parse_last_event_id(request.headers.get("last-event-id"))
    events = await resources.service.events(identity, scope["path_params"]["session_id"], after)
    if events is None:
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    response = EventStream(events, ping_sec=resources.settings.sse_ping_sec, draining=resources.draining)
    await response(scope, receive, send)


def _is_json(content_type: str) -> bool:
    kind = content_type.split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


#: The attribute ``served_by`` sets on a declaration.
_HANDLER = "__served_by__"


def served_by(handler: Handler) -> Callable[[Endpoint], Endpoint]:
    """Mark a route declaration as served by ``handler`` (a plain ASGI app), once ``install`` ran."""
    def mark(declaration: Endpoint) -> Endpoint:
        setattr(declaration, _HANDLER, handler)
        return declaration
    return mark


def handler_of(route: APIRoute) -> Handler | None:
    """The hot handler a declared route names, if any."""
    handler: Handler | None = getattr(route.endpoint, _HANDLER, None)
    return handler


def declared_only(declaration: Endpoint) -> RuntimeError:
    """The error a hot route's declaration raises if it is ever called: ``install`` was not."""
    return RuntimeError(f"{declaration.__name__} is served by {getattr(declaration, _HANDLER).__name__} "
                        "in gateway.api.sessions.hot_routes; hot_routes.install(app) was not called")


def install(app: FastAPI) -> None:
    """Serve every route declared ``@served_by(handler)`` with its handler."""
    for route in app.router.routes:
        if isinstance(route, APIRoute) and (handler := handler_of(route)) is not None:
            route.app = handler
