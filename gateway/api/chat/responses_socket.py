"""``/v1/responses`` over a WebSocket: OpenAI's Responses API WebSocket mode.

A client sends ``{"type": "response.create", ...}`` with the fields of ``POST /v1/responses``
(``stream`` is implicit; ``background`` is refused) and gets the events the streamed POST
sends, the same JSON, one text message each. A response runs as the POST's does
(``responses.py``: the same request model, translation, session, checks and events); this
module only carries them and keeps what OpenAI's connection keeps:

- Responses run one after another, in the order they were asked: a ``response.create``
  while one runs waits for it (OpenAI's default lane is first in, first out, without
  overlap). Named lanes (``stream_id``) are not run here: one is refused.
- The connection's last response is kept in memory, as OpenAI's connection-local cache
  keeps the latest response of a lane: ``previous_response_id`` naming it puts its input
  and output items before the new input, with ``store: false`` too; any other id is OpenAI's
  ``previous_response_not_found``. A continuation that fails (an ``error`` event, or
  ``response.failed``) drops the response it named, as OpenAI evicts it. Nothing outlives
  the connection; over HTTP ``previous_response_id`` stays refused.
- ``generate: false`` (a warmup) answers at once with a response that has no output and
  keeps its input, for the next response to continue from (``previous_response_id``).
- An event that cannot be taken (not JSON, an unknown type, a refused field) is an
  ``error`` event with OpenAI's shape (``status`` and ``error``: type, code, message,
  param) and the connection goes on.

Limits: the handshake authenticates as the HTTP route does (an API key in
``Authorization``; OpenAI documents no browser way for this socket) and is charged one
request of the identity's rate; each response is one more. Events share
Realtime's per-connection budget and size cap (``web/websocket.py``); a connection with
nothing to do for the session timeout is closed; after OpenAI's 60 minutes a
``response.create`` is ``websocket_connection_limit_reached``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import TypeAdapter, ValidationError

from gateway import errors
from gateway.api.chat.responses import start_response
from gateway.api.chat.responses_models import InputItem, ResponsesRequest
from gateway.api.chat.responses_out import ResponseShape, response_events, warmup_events
from gateway.api.chat.router import chat_service
from gateway.web.resources import Resources, authenticate
from gateway.web.validation import validation_error
from gateway.web.websocket import NORMAL, EventBudget, handshake, read_event, receive_frame, refuse

logger = logging.getLogger(__name__)
router = APIRouter(tags=["openai"])

#: OpenAI's connection lifetime: a ``response.create`` after it is refused (open another).
LIFETIME_SEC = 60 * 60
#: ``response.create`` events waiting behind the running one (OpenAI runs 16 at once, then queues).
MAX_WAITING = 16
#: A response's last event; its ``response`` is the whole answer.
TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])


@router.websocket("/v1/responses")
async def responses_socket(websocket: WebSocket, model: str | None = None) -> None:
    """``model``: what a ``response.create`` that names none gets (gateways route on it: LiveKit
    puts it in the URL); a ``response.create`` names its own."""
    resources: Resources = websocket.state.resources
    _, headers = handshake(websocket)
    try:
        caller = await authenticate(resources, headers, websocket.client.host if websocket.client else None)
        resources.service.check_enabled()
    except errors.GatewayError as exc:
        await refuse(websocket, exc)
        return
    await websocket.accept()
    connection = ResponsesConnection(websocket, resources, caller.identity,
                                     model or resources.engine.capabilities.model_names[0])
    logger.info("responses socket: opened for %s", caller.identity)
    try:
        await connection.serve()
    finally:
        logger.info("responses socket: closed for %s", caller.identity)


def error_event(exc: errors.GatewayError) -> dict[str, Any]:
    """OpenAI's WebSocket ``error`` event: the envelope's fields and the HTTP status (a request
    OpenAI's doors cannot take is a 400, as the HTTP route answers it)."""
    body = exc.envelope()["error"]
    status = 400 if exc.status_code == 422 else int(exc.status_code)
    return {"type": "error", "status": status, "error": {
        "type": body["type"], "code": body["code"], "message": body["message"], "param": body.get("param")}}


@dataclass(frozen=True)
class Kept:
    """The connection's last response: its id, and what a continuation of it starts from."""

    response_id: str
    #: Its input (with what it continued) and its output, as input items.
    items: list[InputItem]


class ResponsesConnection:
    """One socket: a reader of client events, and a runner of their responses, in order."""

    def __init__(self, websocket: WebSocket, resources: Resources, identity: str, model: str) -> None:
        self._websocket = websocket
        self._resources = resources
        self._identity = identity
        self._model = model
        self._chat = chat_service(resources)
        self._waiting: asyncio.Queue[dict[str, Any]] = asyncio.Queue(MAX_WAITING)
        self._running = False
        self._sending = asyncio.Lock()
        self._opened = time.monotonic()
        self.kept: Kept | None = None

    async def serve(self) -> None:
        """Until the client leaves (its response, if one runs, is cancelled) or stays idle."""
        tasks = [asyncio.create_task(self._read(), name="responses socket: client events"),
                 asyncio.create_task(self._run(), name="responses socket: responses")]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            failure = None if task.cancelled() else task.exception()
            if failure is not None and not isinstance(failure, WebSocketDisconnect):
                raise failure  # a bug or the store: the server's error, as on any socket

    async def _read(self) -> None:
        settings = self._resources.settings
        budget = EventBudget.of(settings)
        while True:
            try:
                async with asyncio.timeout(settings.session_timeout_sec):
                    raw = await receive_frame(self._websocket)
            except TimeoutError:
                if self._running or not self._waiting.empty():
                    continue  # the client waits for its answer
                await self._websocket.close(NORMAL, "idle for longer than the session timeout")
                return
            try:
                event = await read_event(raw, settings, budget)
                self._waiting.put_nowait(event)
            except errors.GatewayError as exc:
                await self._send(error_event(exc))
            except asyncio.QueueFull:
                await self._send(error_event(errors.TooManyRequests(
                    f"{MAX_WAITING} response.create events already wait on this connection; this one is dropped",
                    retry_after=1)))

    async def _run(self) -> None:
        while True:
            event = await self._waiting.get()
            self._running = True
            try:
                await self.handle(event)
            finally:
                self._running = False

    async def handle(self, event: dict[str, Any]) -> None:
        """One client event, to its end: a response's events, or an ``error`` event."""
        continued = event.get("previous_response_id")
        try:
            if event.get("type") != "response.create":
                raise errors.InvalidRequest(f"unknown event type {str(event.get('type'))[:64]!r}: this connection "
                                            "takes response.create", param="type")
            if time.monotonic() - self._opened > LIFETIME_SEC:
                raise errors.ConnectionLimitReached(
                    f"Responses websocket connection limit reached ({LIFETIME_SEC // 60} minutes). Create a new "
                    "websocket connection to continue.")
            await self._respond(event)
        except errors.GatewayError as exc:
            self._forget(continued)
            await self._send(error_event(exc))

    async def _respond(self, event: dict[str, Any]) -> None:
        fields = {k: v for k, v in event.items() if k not in ("type", "stream")}  # (stream: implicit; Codex sends it)
        generate = fields.pop("generate", True)
        if not isinstance(generate, bool):
            raise errors.ValidationFailed("generate: a boolean (false: a warmup that generates nothing)",
                                          param="generate")
        if "stream_id" in fields:
            raise errors.InvalidRequest("named streams (stream_id) are not run here: a connection runs its responses "
                                        "one after another; open another connection to run them side by side",
                                        param="stream_id")
        try:
            body = ResponsesRequest.model_validate({**fields, "stream": True})
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None
        continued = body.previous_response_id
        history: list[InputItem] = []
        if continued is not None:
            if self.kept is None or self.kept.response_id != continued:
                raise errors.PreviousResponseNotFound(f"Previous response with id '{continued}' not found.",
                                                      param="previous_response_id")
            history = self.kept.items
        body = body.model_copy(update={"input": [*history, *body.input], "previous_response_id": None,
                                       "model": body.model or self._model})
        if not generate:  # a warmup: nothing to run, its input kept for the next response to continue
            response_id = f"resp_{uuid.uuid4().hex}"
            for frame in warmup_events(ResponseShape.of(body, body.model or self._model, continued), response_id):
                await self._send_text(str(frame.data))
            self.kept = Kept(response_id, body.input)
            return
        settings = self._resources.settings
        if settings.rate_limit_rps > 0:  # each response is a request of the identity's rate, as over HTTP
            await self._resources.store.take_token(self._identity, settings.rate_limit_rps, settings.token_burst)
        session_id, shape = await start_response(self._chat, self._identity, body, self._model,
                                                 previous_response_id=continued)
        end: dict[str, Any] | None = None
        # Closed with this task (a client that left): its end cancels the session at once.
        async with contextlib.aclosing(response_events(self._chat.stream(self._identity, session_id), shape,
                                                       session_id)) as events:
            async for frame in events:
                await self._send_text(str(frame.data))
                if frame.event in TERMINAL:
                    end = orjson.loads(str(frame.data))["response"]
        if end is None or end["status"] == "failed":  # not a whole answer: nothing to continue from
            self._forget(continued)
            return
        self.kept = Kept(session_id, [*body.input, *_ITEMS.validate_python(end["output"])])

    def _forget(self, response_id: Any) -> None:
        """A continuation that failed drops the response it named (OpenAI evicts it)."""
        if response_id is not None and self.kept is not None and self.kept.response_id == response_id:
            self.kept = None

    async def _send(self, event: dict[str, Any]) -> None:
        await self._send_text(orjson.dumps(event).decode())

    async def _send_text(self, text: str) -> None:
        async with self._sending:
            try:
                await self._websocket.send_text(text)
            except (RuntimeError, OSError) as exc:  # closed meanwhile: the client left
                raise WebSocketDisconnect(1006) from exc
