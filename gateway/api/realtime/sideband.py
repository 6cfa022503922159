"""A backend's control socket (``?call_id=``) on a call another process holds.

A call's media cannot move: the call lives in the process that answered its
offer. Behind an edge that round robins, or beside the replica's other API
workers, the backend's socket reaches any process. That process asks every
process for the call (``SessionStore.ask_attach``), and the holder relays the
call through the attachment's two pub/sub channels::

    backend ─ws─► this process ──── in ───► holder ─► Call.handle (as a local control socket's events)
    backend ◄─ws─ this process ◄─── out ─── holder ◄─ the call's events (Call.watching)

The socket subscribes to ``out`` before it asks, and the holder to ``in``
before it answers, so nothing told is missed. The holder tells the call's
events in order, from one task. When the call ends the holder says so on
``out`` and the socket closes; when the socket closes it says so on ``in``
and the holder stops relaying. A quiet call's holder says it is alive every few
seconds: a socket that hears nothing for longer takes the holder's process, and
so the call, for dead, and closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from gateway import errors
from gateway.api.realtime import events as ev
from gateway.api.realtime.webrtc import Call, Calls, keep_hearing
from gateway.store.redis_store import SessionStore

logger = logging.getLogger(__name__)

#: How long a control socket waits for the processes that heard its ask (each answers, so an
#: unknown call is a 404 as soon as all have).
ASK_WAIT_SEC = 1.0
#: Said on ``out`` when the call ended, on ``in`` when the socket closed, and on ``out`` while
#: the call is quiet (events are JSON objects, so none of them is ever an event).
ENDED, DETACHED, ALIVE = "ended", "detached", "alive"
#: The holder says it is alive after this long without an event; a socket that hears nothing
#: for three times as long takes its process (and so the call, whose media it held) for dead.
ALIVE_EVERY_SEC = 5.0


# --- the holder's half ------------------------------------------------------------

async def serve_attaches(calls: Calls, store: SessionStore) -> None:
    """Control sockets on this process's calls that reached another process (for the process's life)."""
    async def hear() -> None:
        async for call_id, identity, reply, attachment in store.attach_requests():
            call = calls.get(call_id)
            if call is not None and call.identity == identity:
                call.keep(_relay(call, store, attachment, reply), f"control socket {attachment}")
            else:  # every process answers, so the asker need not wait out a call nobody holds
                await store.answer_ask(reply, held=False)

    await keep_hearing(hear, "control sockets on other processes")


async def _relay(call: Call, store: SessionStore, attachment: str, reply: str) -> None:
    """The call's events out and the socket's events in, until the socket leaves or the call ends."""
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def watcher(event: dict[str, Any]) -> None:
        outbox.put_nowait(event)  # told in the order the call made them (one task tells them)

    async def tell_events() -> None:
        while True:
            try:
                event = await asyncio.wait_for(outbox.get(), ALIVE_EVERY_SEC)
            except TimeoutError:
                await store.tell_sideband(attachment, "out", ALIVE)
                continue
            await store.tell_sideband(attachment, "out", ev.encoded(event))

    async with store.sideband(attachment, "in") as incoming, call.watching(watcher):
        telling = asyncio.create_task(tell_events(), name=f"call {call.id}: to control socket {attachment}")
        try:
            await store.answer_ask(reply, held=True)
            async for message in incoming:
                if message == DETACHED:
                    return
                await call.handle(json.loads(message))  # checked by the socket's process (receive_event)
        finally:
            telling.cancel()
            await asyncio.gather(telling, return_exceptions=True)
            if call.ended:  # the call's last events, then the end, so the socket closes
                with contextlib.suppress(Exception):
                    while not outbox.empty():
                        await store.tell_sideband(attachment, "out", ev.encoded(outbox.get_nowait()))
                    await store.tell_sideband(attachment, "out", ENDED)


# --- the socket's half ------------------------------------------------------------

@contextlib.asynccontextmanager
async def attached(store: SessionStore, call_id: str, identity: str) -> AsyncIterator[Attachment]:
    """The call held by another process, relayed here for the block; 404 when no process holds
    the caller's call."""
    attachment = secrets.token_hex(8)
    async with store.sideband(attachment, "out") as events:
        try:
            if not await store.ask_attach(call_id, identity, attachment, ASK_WAIT_SEC):
                raise errors.CallNotFound(f"no call {call_id!r}: no process holds it (it ended, or "
                                             "was never answered)", param="call_id")
            yield Attachment(store, attachment, events)
        finally:  # also when the ask timed out after the holder said yes: it stops relaying
            with contextlib.suppress(Exception):
                await store.tell_sideband(attachment, "in", DETACHED)


class Attachment:
    """A call another process holds, as a control socket here sees it (``router._control``)."""

    def __init__(self, store: SessionStore, attachment: str, events: AsyncIterator[str]) -> None:
        self._store = store
        self._attachment = attachment
        self._events = events
        #: Set when the holder says the call ended.
        self._over = asyncio.Event()

    @property
    def ended(self) -> bool:
        return self._over.is_set()

    async def wait_ended(self) -> None:
        await self._over.wait()

    async def handle(self, message: dict[str, Any]) -> None:
        """A client event for the call (``receive_event`` checked it)."""
        await self._store.tell_sideband(self._attachment, "in", json.dumps(message))

    @contextlib.asynccontextmanager
    async def watching(self, send: Callable[[dict[str, Any]], Awaitable[None]]) -> AsyncIterator[None]:
        """The call's events go to ``send`` during the block."""
        async def forward() -> None:
            while True:
                try:
                    async with asyncio.timeout(3 * ALIVE_EVERY_SEC):
                        text = await anext(self._events)
                except (TimeoutError, StopAsyncIteration, errors.StoreUnavailable) as exc:
                    # Its process died (its media with it), or Redis is away: the call is not heard any more.
                    logger.warning("control socket %s: the call is not heard any more (%s); closing it",
                                   self._attachment, type(exc).__name__)
                    text = ENDED
                if text == ENDED:
                    self._over.set()
                    return
                if text != ALIVE:
                    await send(json.loads(text))

        forwarding = asyncio.create_task(forward(), name=f"control socket {self._attachment}: the call's events")
        try:
            yield
        finally:
            forwarding.cancel()
            await asyncio.gather(forwarding, return_exceptions=True)
