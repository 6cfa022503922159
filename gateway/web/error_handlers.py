"""The one place that turns errors into HTTP responses (the error envelope)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from gateway import errors
from gateway.web.middleware.request_id import named_again
from gateway.web.validation import validation_error
from gateway.web.websocket import refuse

logger = logging.getLogger(__name__)


def _headers(error: errors.GatewayError) -> dict[str, str] | None:
    return {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None


async def render_error(error: errors.GatewayError, send: Send) -> None:
    """Send the envelope from a pure ASGI middleware, before the app runs."""
    body = json.dumps(error.envelope()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (_headers(error) or {}).items()]
    await send({"type": "http.response.start", "status": int(error.status_code), "headers": headers})
    await send({"type": "http.response.body", "body": body})


#: The sessions API's own routes: a request they cannot take is a 422 (its contract).
SESSIONS_API = "/v1/streaming_input/"


def _status(error: errors.GatewayError, request: Request) -> int:
    """OpenAI's doors answer a request they cannot take with a 400, as OpenAI and ``vllm serve``
    do: SDKs raise ``BadRequestError`` for it, and the code built on them catches that."""
    if error.status_code == 422 and not request.url.path.startswith(SESSIONS_API):
        return 400
    return int(error.status_code)


def _envelope(error: errors.GatewayError, request: Request, headers: Mapping[str, str] | None = None,
              ) -> JSONResponse:
    resources = getattr(request.state, "resources", None)
    if resources is not None:
        resources.metrics.errors.labels(error.code).inc()
    return JSONResponse(error.envelope(), status_code=_status(error, request),
                        headers={**(_headers(error) or {}), **(headers or {})})


def install_error_handlers(app: FastAPI) -> None:
    not_found = app.router.default

    async def no_such_route(scope: Scope, receive: Receive, send: Send) -> None:
        """A WebSocket to a path that has none is a 404 with the envelope: Starlette's own answer,
        a close that fails the handshake as a 403, reads as a refused key."""
        if scope["type"] != "websocket":
            await not_found(scope, receive, send)
            return
        await refuse(WebSocket(scope, receive, send), errors.NoSuchRoute(f"no WebSocket is served at {scope['path']}"))

    app.router.default = no_such_route

    @app.exception_handler(errors.GatewayError)
    async def gateway_error(request: Request, exc: errors.GatewayError) -> JSONResponse:
        return _envelope(exc, request)

    @app.exception_handler(RequestValidationError)
    async def request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _envelope(validation_error(exc.errors()), request)

    @app.exception_handler(RecursionError)
    async def too_deep(request: Request, exc: RecursionError) -> JSONResponse:
        return _envelope(errors.InvalidJson("request body is nested too deeply"), request)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, errors.GatewayError):
            # FastAPI wraps errors raised while it reads a body (our body
            # limits) in a 400; the cause is the real answer.
            return _envelope(exc.__cause__, request)
        if isinstance(exc.__cause__, RecursionError):
            return _envelope(errors.InvalidJson("request body is nested too deeply"), request)
        error = errors.GatewayError(str(exc.detail))
        # Starlette's own errors (404 route, 405 method) have no class of ours:
        # this instance takes their labels (class constants elsewhere).
        error.status_code = exc.status_code  # type: ignore[misc]
        error.code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")  # type: ignore[misc]
        error.type = "invalid_request_error"  # type: ignore[misc]
        return _envelope(error, request, exc.headers)  # a 405's Allow

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette runs this one outside every middleware (its ServerErrorMiddleware): the
        # request's id is named here, in the log line and the header.
        with named_again(request.scope) as request_id:
            logger.exception("unhandled error")
        return _envelope(errors.GatewayError("internal error; the request id is in the logs"), request,
                         {"X-Request-Id": request_id} if request_id is not None else None)
