"""What every WebSocket door shares: the handshake's credentials and refusal, a frame's text,
a send to a socket that may have closed, a client event read within the connection's budget, and that budget.

A door (Realtime's ``/v1/realtime``, the Responses API's ``/v1/responses``) turns the events
into its own calls and a refused event into its own ``error`` event; the rules of reading
one are here, once.

The budget: a voice client sends an audio event every 20-100 ms; charging each to the
identity's REST bucket in Redis cost a store call per frame and closed the sockets of a
second voice user on the same key. Instead the identity's bucket is charged per
connection and per turn (the calls that start engine work), and each connection has an
``EventBudget`` for its events; an event over it gets an ``error`` event and the socket stays.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from typing import Any

from fastapi import WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse

from gateway import errors
from gateway.settings import Settings

#: The browser's way to send a key: a WebSocket subprotocol (OpenAI's name).
KEY_PROTOCOL = "openai-insecure-api-key."
#: WebSocket close codes (RFC 6455).
POLICY_VIOLATION, TRY_AGAIN_LATER, NORMAL = 1008, 1013, 1000
#: Events from this size on (a long stretch of audio) are parsed in a worker thread.
OFF_LOOP_CHARS = 256 * 1024


class EventBudget:
    """A token bucket: ``rate`` events a second, ``burst`` at once."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()

    @staticmethod
    def of(settings: Settings) -> EventBudget:
        """A connection's budget as the settings size it."""
        return EventBudget(settings.realtime_events_per_sec, max(1, int(2 * settings.realtime_events_per_sec)))

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate)
        self._at = now

    def take(self) -> bool:
        """One event's worth, if there is one."""
        if self.rate <= 0:
            return True
        self._refill()
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def rate_limit(self) -> dict[str, float | int | str]:
        """OpenAI's ``rate_limits.updated`` entry for it."""
        self._refill()
        missing = self.burst - self._tokens
        return {"name": "requests", "limit": self.burst, "remaining": math.floor(self._tokens),
                "reset_seconds": round(missing / self.rate, 3) if self.rate > 0 else 0.0}


def handshake(websocket: WebSocket) -> tuple[list[str], dict[str, str]]:
    """The subprotocols the client offers and the handshake's headers, with a key sent as a
    subprotocol (``openai-insecure-api-key.<key>``) as its ``Authorization``."""
    protocols = [p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    headers = dict(websocket.headers.items())
    key = next((p[len(KEY_PROTOCOL):] for p in protocols if p.startswith(KEY_PROTOCOL)), None)
    if key and "authorization" not in headers:
        headers["authorization"] = f"Bearer {key}"
    return protocols, headers


def close_reason(message: str) -> str:
    """``message`` cut to fit a close frame (123 bytes of UTF-8, not characters)."""
    return message.encode()[:120].decode("utf-8", "ignore")


async def refuse(websocket: WebSocket, exc: errors.GatewayError) -> None:
    """Refused before the upgrade: an HTTP answer with the envelope where the server can
    send one, else the close that makes the handshake fail (403)."""
    try:
        await websocket.send_denial_response(JSONResponse(exc.envelope(), status_code=int(exc.status_code)))
    except RuntimeError:
        await websocket.close(POLICY_VIOLATION, close_reason(exc.message))


async def send_text(websocket: WebSocket, text: str) -> None:
    """Send ``text``; a socket the client closed meanwhile is a ``WebSocketDisconnect``, as a
    receive says it (Starlette raises ``RuntimeError`` or the server's ``OSError`` on a send), so a
    door ends its connection the one way it does when the client leaves."""
    try:
        await websocket.send_text(text)
    except (RuntimeError, OSError) as exc:
        raise WebSocketDisconnect(1006) from exc


async def receive_frame(websocket: WebSocket) -> str | bytes:
    """The next frame's text, or its bytes: some clients send their JSON events in binary frames
    (Starlette's ``receive_text`` fails on those with a ``KeyError`` and drops the socket)."""
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000), message.get("reason"))
    text = message.get("text")
    return text if text is not None else message.get("bytes") or b""


async def parse_event(raw: str | bytes) -> Any:
    """The event's JSON; a big one parsed off the event loop, where every other session waits."""
    return json.loads(raw) if len(raw) < OFF_LOOP_CHARS else await asyncio.to_thread(json.loads, raw)


async def read_event(raw: str | bytes, settings: Settings, budget: EventBudget) -> dict[str, Any]:
    """One client event as text (or UTF-8 bytes), from any transport; over the budget, too big,
    not JSON or not an object is the error the door says in its ``error`` event."""
    if not budget.take():
        raise errors.TooManyRequests(f"more than {settings.realtime_events_per_sec:g} events a second on this "
                                     "connection; this event is dropped", retry_after=1)
    if len(raw) > settings.realtime_max_event_bytes:
        raise errors.RequestTooLarge(f"an event may be at most {settings.realtime_max_event_bytes} bytes")
    try:
        message = await parse_event(raw)
    except (ValueError, RecursionError):
        raise errors.InvalidJson("the event is not valid JSON (or nested too deeply)") from None
    if not isinstance(message, dict):
        raise errors.InvalidRequest("an event is a JSON object with a type", param="type")
    return message
