"""``GET /v1/realtime``: the OpenAI Realtime protocol over a WebSocket.

The handshake authenticates like every route: ``Authorization: Bearer`` or,
for browsers (which cannot set headers on a WebSocket), the subprotocols
``realtime`` + ``openai-insecure-api-key.<key>``; ``realtime`` is echoed.
Either may carry a client secret (``client_secrets.py``) instead of a key:
the connection is then its minter's and starts from its session configuration.
The identity's rate limit is charged once per connection here and once per
turn (``connection.py``), never per event: a voice client sends 50 audio
frames a second. Each connection has its own event budget instead
(``web/websocket.py``); an event over it, over the size cap, or one that meets a
store error gets an ``error`` event and the connection goes on. A
connection with no message for the session timeout is closed with 1000.

``?intent=transcription`` opens a transcription session (OpenAI's): the audio is only heard,
and ``model`` names a recognizer, so any name is taken (``config.py``).

Resume (ours; OpenAI's protocol has none): a client whose socket broke
reconnects to any replica with ``?session_id=<the session.created id>`` and
``&last_event_id=<the last event it got>``; it gets ``session.created`` for
the same session, then exactly the events after that one (see
``connection.py``).

A backend attaches to a WebRTC call it (or its browser) opened with
``?call_id=``, as OpenAI's server-side controls do: it gets the call's events
(but the audio, which is the track's) and its events go into the call, to run
tools server side. Any process takes the socket: the call's own, or another
(another replica, another API worker), which relays it (``sideband.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from gateway import errors
from gateway.api.realtime import events as ev
from gateway.api.realtime import sideband
from gateway.api.realtime.audio_formats import Transcoder
from gateway.api.realtime.client_secrets import session_config
from gateway.api.realtime.config import RealtimeConfig
from gateway.api.realtime.connection import RealtimeConnection
from gateway.api.realtime.webrtc import CALLS, Call, Calls
from gateway.settings import Settings
from gateway.web.resources import Resources, resolve_caller
from gateway.web.websocket import (
    NORMAL,
    POLICY_VIOLATION,
    EventBudget,
    close_reason,
    handshake,
    read_event,
    receive_frame,
    refuse,
    send_text,
)

logger = logging.getLogger(__name__)
router = APIRouter(tags=["realtime"])

@router.websocket("/v1/realtime")
async def realtime(websocket: WebSocket, model: str | None = None, session_id: str | None = None,
                   last_event_id: str | None = None, call_id: str | None = None,
                   intent: str | None = None) -> None:
    resources: Resources = websocket.state.resources
    protocols, headers = handshake(websocket)
    try:
        caller = await resolve_caller(resources, headers, websocket.client.host if websocket.client else None,
                                      client_secret_ok=True)
        resources.service.check_enabled()
    except errors.GatewayError as exc:
        await refuse(websocket, exc)
        return
    if call_id is not None:  # the call has its model: one named here is not checked (OpenAI's need none)
        await _attach(websocket, resources, caller.identity, call_id, protocols)
        return
    await websocket.accept(subprotocol="realtime" if "realtime" in protocols else None)
    try:
        config = session_config(resources, model or (caller.session or {}).get("model"),
                                transcribing=intent == "transcription")
        if caller.session:  # checked when the secret was minted (on a replica that may have spoken)
            config.update(caller.session)
    except errors.GatewayError as exc:
        # Said in an event, as OpenAI does, then closed: a refused handshake reaches a
        # framework's log as "HTTP 404" at best, without the names that are served.
        with contextlib.suppress(WebSocketDisconnect):  # the client left already
            await send_text(websocket, ev.encoded(ev.error(exc)))
            await websocket.close(POLICY_VIOLATION, close_reason(exc.message))
        return
    identity, settings, metrics = caller.identity, resources.settings, resources.metrics
    lock = asyncio.Lock()
    audio = Transcoder()  # the session's audio formats on this socket (G.711 for telephony)

    async def send(event: dict[str, Any]) -> None:
        for out in audio.server_events(event, connection.config.output_audio_format):
            metrics.realtime_event("out", out["type"])
            async with lock:
                await send_text(websocket, ev.encoded(out))

    connection, budget = new_connection(resources, identity, config, send)
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
                await websocket.close(POLICY_VIOLATION, close_reason(exc.message))
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
        await _serve(websocket, connection, send, settings, budget, audio)
    except WebSocketDisconnect:
        pass
    finally:
        await connection.close()
        metrics.connections.dec()
        metrics.connection_seconds.observe(time.monotonic() - opened)
        logger.info("realtime %s: closed", connection.id)


def new_connection(resources: Resources, identity: str, config: RealtimeConfig,
                   send: Callable[[dict[str, Any]], Awaitable[None]]) -> tuple[RealtimeConnection, EventBudget]:
    """A Realtime connection over any transport, with its own event budget."""
    settings = resources.settings
    budget = EventBudget.of(settings)
    return RealtimeConnection(send, resources.service, resources.store, identity, config, resources.metrics,
                              settings, budget), budget


async def _attach(websocket: WebSocket, resources: Resources, identity: str, call_id: str,
                  protocols: list[str]) -> None:
    """A backend's socket on the caller's call: held by this process (the one that answered its
    offer), else relayed from the process that holds it (``sideband.py``); 404 when none does."""
    calls: Calls = websocket.scope["state"][CALLS]
    here = calls.get(call_id)
    async with contextlib.AsyncExitStack() as elsewhere:
        try:
            call = here if here is not None and here.identity == identity else \
                await elsewhere.enter_async_context(sideband.attached(resources.store, call_id, identity))
        except errors.GatewayError as exc:
            await refuse(websocket, exc)
            return
        await websocket.accept(subprotocol="realtime" if "realtime" in protocols else None)
        await _control(websocket, call, resources.settings)


async def _control(websocket: WebSocket, call: Call | sideband.Attachment, settings: Settings) -> None:
    """A backend's socket on a call (OpenAI's sideband control): the call's events out, client events
    in; closed when the call ends (the backend need not send anything to learn it)."""
    lock = asyncio.Lock()

    async def send(event: dict[str, Any]) -> None:
        async with lock:
            await send_text(websocket, ev.encoded(event))

    async def read() -> None:
        budget = EventBudget.of(settings)
        while True:
            async with asyncio.timeout(settings.session_timeout_sec):
                raw = await receive_frame(websocket)
            await receive_event(raw, call.handle, send, settings, budget)

    async with call.watching(send):
        reading = asyncio.create_task(read(), name="control socket: client events")
        ending = asyncio.create_task(call.wait_ended(), name="control socket: the call's end")
        try:
            await asyncio.wait([reading, ending], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reading, ending):
                task.cancel()
            await asyncio.gather(reading, ending, return_exceptions=True)
    failure = reading.exception() if reading.done() and not reading.cancelled() else None
    if isinstance(failure, WebSocketDisconnect):
        return  # the backend closed it
    if failure is not None and not isinstance(failure, TimeoutError):
        raise failure  # a bug or the store: the server's error, as when it fails on any socket
    with contextlib.suppress(RuntimeError, WebSocketDisconnect):  # closed by the backend meanwhile
        await websocket.close(NORMAL, "the call ended" if call.ended else "idle for longer than the session timeout")


async def _serve(websocket: WebSocket, connection: RealtimeConnection,
                 send: Callable[[dict[str, Any]], Awaitable[None]], settings: Settings, budget: EventBudget,
                 audio: Transcoder) -> None:
    async def handle(message: dict[str, Any]) -> None:
        await connection.handle(await audio.client_event(message, connection.config.input_audio_format))

    while True:
        try:
            async with asyncio.timeout(settings.session_timeout_sec):
                raw = await receive_frame(websocket)
        except TimeoutError:
            await websocket.close(NORMAL, "idle for longer than the session timeout")
            return
        await receive_event(raw, handle, send, settings, budget)


async def receive_event(raw: str | bytes, handle: Callable[[dict[str, Any]], Awaitable[None]],
                        send: Callable[[dict[str, Any]], Awaitable[None]], settings: Settings,
                        budget: EventBudget) -> None:
    """One client event, from any transport: one that cannot be read is an ``error`` event."""
    try:
        message = await read_event(raw, settings, budget)
    except errors.GatewayError as exc:
        await send(ev.error(exc))
        return
    await handle(message)
