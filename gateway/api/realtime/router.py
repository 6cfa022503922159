"""``GET /v1/realtime``: the OpenAI Realtime protocol over a WebSocket.

The handshake authenticates like every route: ``Authorization: Bearer`` or,
for browsers (which cannot set headers on a WebSocket), the subprotocols
``realtime`` + ``openai-insecure-api-key.<key>``; ``realtime`` is echoed.
The identity's rate limit is charged once per connection here and once per
turn (``connection.py``), never per event: a voice client sends 50 audio
frames a second. Each connection has its own event budget instead
(``limits.py``); an event over it, over the size cap, or one that meets a
store error gets an ``error`` event and the connection goes on. A
connection with no message for the session timeout is closed with 1000.

Resume (ours; OpenAI's protocol has none): a client whose socket broke
reconnects to any replica with ``?session_id=<the session.created id>`` and
``&last_event_id=<the last event it got>``; it gets ``session.created`` for
the same session, then exactly the events after that one (see
``connection.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse

from gateway import errors
from gateway.api.realtime import events as ev
from gateway.api.realtime.config import RealtimeConfig
from gateway.api.realtime.connection import RealtimeConnection
from gateway.api.realtime.limits import EventBudget
from gateway.settings import Settings
from gateway.web.resources import Resources

logger = logging.getLogger(__name__)
router = APIRouter(tags=["realtime"])

#: The browser's way to send a key: a WebSocket subprotocol (OpenAI's name).
KEY_PROTOCOL = "openai-insecure-api-key."
#: WebSocket close codes (RFC 6455).
POLICY_VIOLATION, TRY_AGAIN_LATER, NORMAL = 1008, 1013, 1000


@router.websocket("/v1/realtime")
async def realtime(websocket: WebSocket, model: str | None = None, session_id: str | None = None,
                   last_event_id: str | None = None) -> None:
    resources: Resources = websocket.state.resources
    protocols = [p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    headers = dict(websocket.headers.items())
    key = next((p[len(KEY_PROTOCOL):] for p in protocols if p.startswith(KEY_PROTOCOL)), None)
    if key and "authorization" not in headers:
        headers["authorization"] = f"Bearer {key}"
    try:
        identity = resources.identity.resolve(headers, websocket.client.host if websocket.client else None)
        served = resources.engine.capabilities.model_names
        if model is not None and model not in served:
            raise errors.ModelNotFound(f"model {model!r} is not served here", param="model")
        resources.service.check_enabled()
    except errors.GatewayError as exc:
        # Refused before the upgrade: an HTTP answer with the envelope where the
        # server can send one, else the close that makes the handshake fail (403).
        try:
            await websocket.send_denial_response(JSONResponse(exc.envelope(), status_code=int(exc.status_code)))
        except RuntimeError:
            await websocket.close(POLICY_VIOLATION, exc.message[:120])
        return
    await websocket.accept(subprotocol="realtime" if "realtime" in protocols else None)
    settings, metrics = resources.settings, resources.metrics
    config = RealtimeConfig(model=model or served[0], can_speak="audio" in resources.engine.capabilities.output_modalities)
    lock = asyncio.Lock()

    async def send(event: dict[str, Any]) -> None:
        metrics.realtime_event("out", event["type"])
        async with lock:
            await websocket.send_text(ev.encoded(event))

    budget = EventBudget(settings.realtime_events_per_sec, max(1, int(2 * settings.realtime_events_per_sec)))
    connection = RealtimeConnection(send, resources.service, resources.store, identity, config, metrics,
                                    settings, budget)
    metrics.connections.inc()
    metrics.connections_total.inc()
    opened = time.monotonic()
    logger.info("realtime %s: opened for %s", connection.id, identity)
    try:
        if session_id is not None:
            try:
                await connection.restore(session_id, last_event_id)
            except errors.GatewayError as exc:
                await send(ev.error(exc))
                await websocket.close(POLICY_VIOLATION, exc.message[:120])
                return
        await connection.opened()
        if settings.rate_limit_rps > 0:  # the connection is one request of the identity's rate
            try:
                await resources.store.take_token(identity, settings.rate_limit_rps, settings.token_burst)
            except errors.TooManyRequests as exc:
                await send(ev.error(exc))
                await websocket.close(POLICY_VIOLATION, "too many requests for this identity")
                return
            except errors.StoreUnavailable as exc:
                await send(ev.error(exc))  # said, and the connection goes on: its turns are checked again
        await _serve(websocket, connection, send, settings, budget)
    except WebSocketDisconnect:
        pass
    finally:
        await connection.close()
        metrics.connections.dec()
        metrics.connection_seconds.observe(time.monotonic() - opened)
        logger.info("realtime %s: closed", connection.id)


#: Events from this size on (a long stretch of audio) are parsed in a worker thread.
OFF_LOOP_CHARS = 256 * 1024


async def parse_event(raw: str) -> Any:
    """The event's JSON; a big one parsed off the event loop, where every other session waits."""
    return json.loads(raw) if len(raw) < OFF_LOOP_CHARS else await asyncio.to_thread(json.loads, raw)


async def _serve(websocket: WebSocket, connection: RealtimeConnection,
                 send: Callable[[dict[str, Any]], Awaitable[None]], settings: Settings, budget: EventBudget) -> None:
    while True:
        try:
            async with asyncio.timeout(settings.session_timeout_sec):
                raw = await websocket.receive_text()
        except TimeoutError:
            await websocket.close(NORMAL, "idle for longer than the session timeout")
            return
        if not budget.take():
            await send(ev.error(errors.TooManyRequests(
                f"more than {settings.realtime_events_per_sec:g} events a second on this connection; "
                "this event is dropped", retry_after=1)))
            continue
        if len(raw) > settings.realtime_max_event_bytes:
            await send(ev.error(errors.RequestTooLarge(
                f"an event may be at most {settings.realtime_max_event_bytes} bytes")))
            continue
        try:
            message = await parse_event(raw)
        except (ValueError, RecursionError):
            await send(ev.error(errors.InvalidJson("the event is not valid JSON (or nested too deeply)")))
            continue
        if not isinstance(message, dict):
            await send(ev.error(errors.InvalidRequest("an event is a JSON object with a type", param="type")))
            continue
        await connection.handle(message)
