"""One WebRTC call: a Realtime connection whose wire is a peer connection.

Transports translate, sessions decide: the call is a :class:`RealtimeConnection`
like a WebSocket's (the same sessions in Redis, turns, VAD, barge-in, tools);
only the wire differs, as OpenAI's WebRTC protocol has it:

    browser                                     this replica
    ── Opus track (microphone) ───────────────► decoded, 24 kHz pcm16 ─► input_audio_buffer.append
    ── "oai-events" data channel: client events ─────────────────────► connection.handle
    ◄─ data channel: server events, but the audio deltas ◄─────────── connection's send
    ◄─ Opus track (SpeakerTrack, paced) ◄───── response.output_audio.delta

The answer's audio goes out as a media track, not as events, so the data
channel carries OpenAI's ``output_audio_buffer.started`` / ``.stopped`` /
``.cleared`` instead: the buffer is the track's, flushed at once on barge-in
(speech starts while ``interrupt_response`` is on; the connection cancels the
answer if it is still being made) or a client's ``output_audio_buffer.clear``.

The connection begins when the browser's data channel opens (events before
it would have nowhere to go); the caller's audio waits for that in aiortc's
queue. The call ends when the peer connection fails or closes, the data
channel closes, or the replica stops.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription
from aiortc.rtcdatachannel import RTCDataChannel

from gateway import errors
from gateway.api.realtime import events as ev
from gateway.api.realtime.connection import RealtimeConnection
from gateway.api.realtime.media import SpeakerTrack, heard
from gateway.api.realtime.tasks import spawn
from gateway.settings import IceServer
from gateway.store.redis_store import SessionStore

logger = logging.getLogger(__name__)

#: Where the lifespan puts the process's calls (``runtime/app.py``).
CALLS = "calls"
#: How long a hang-up waits for the processes that heard it to say whether they ended the call
#: (each answers, so an unknown call is a 404 as soon as all have).
HANG_UP_WAIT_SEC = 1.0
#: The data channel OpenAI's WebRTC clients open for events.
EVENTS_CHANNEL = "oai-events"
#: Checks a client event's text as the WebSocket does (budget, size, JSON), then hands it on.
Receive = Callable[[str | bytes, Callable[[dict[str, Any]], Awaitable[None]]], Awaitable[None]]


def peer_configuration(ice_servers: Sequence[IceServer]) -> RTCConfiguration:
    """No STUN unless configured: aiortc's default asks Google's server, unreachable from many clusters."""
    return RTCConfiguration(iceServers=[RTCIceServer(urls=list(server.urls), username=server.username,
                                                     credential=server.credential) for server in ice_servers])


class Call:
    def __init__(self, call_id: str, identity: str, ice_servers: Sequence[IceServer], on_end: Callable[[Call], None]) -> None:
        self.id = call_id
        #: Whose call it is: only they may hang it up or attach to it.
        self.identity = identity
        self._pc = RTCPeerConnection(peer_configuration(ice_servers))
        self._speaker = SpeakerTrack(self._started, self._stopped)
        self._channel: RTCDataChannel | None = None
        self._connection: RealtimeConnection | None = None
        self._receive: Receive | None = None
        self._opened = asyncio.Event()
        self._inbox: asyncio.Queue[str | bytes] = asyncio.Queue()
        self._tasks: set[asyncio.Task[None]] = set()
        self._on_end = on_end
        self._over = asyncio.Event()
        #: Backends' control sockets on the call (``?call_id=``): they get its events too.
        self._watchers: list[Callable[[dict[str, Any]], Awaitable[None]]] = []

    async def answer(self, offer_sdp: str) -> str:
        """The SDP answer to the browser's offer (ICE candidates included: aiortc gathers before answering)."""
        pc = self._pc
        pc.on("datachannel", self._on_channel)
        pc.on("track", self._on_track)
        pc.on("connectionstatechange", self._on_state)
        await pc.setRemoteDescription(RTCSessionDescription(sdp=offer_sdp, type="offer"))
        if any(t.kind == "audio" for t in pc.getTransceivers()):  # an offer of events only (text) gets none
            pc.addTrack(self._speaker)
        await pc.setLocalDescription(await pc.createAnswer())
        return str(pc.localDescription.sdp)

    def attach(self, connection: RealtimeConnection, receive: Receive) -> None:
        self._connection, self._receive = connection, receive

    # --- what the connection sends ------------------------------------------

    async def send(self, event: dict[str, Any]) -> None:
        """The connection's ``send``: audio to the track, everything else to the data channel."""
        kind = event["type"]
        if kind == "response.output_audio.delta":
            self._speaker.speak(event["response_id"], base64.b64decode(event["delta"]))
            return
        if kind == "response.output_audio.done":
            self._speaker.spoken(event["response_id"])
        elif kind == "response.done":
            self._speaker.spoken(event["response"]["id"])
        self._tell(event)
        if kind == "input_audio_buffer.speech_started" and self._interrupts():
            # Barge-in: what was not heard yet is never heard, even of an answer generated in full.
            self._clear()

    def _interrupts(self) -> bool:
        vad = self._connection.config.server_vad if self._connection else None
        return vad is not None and vad.interrupt_response

    def _tell(self, event: dict[str, Any]) -> None:
        channel = self._channel
        if channel is not None and channel.readyState == "open":
            channel.send(ev.encoded(event))
        for watcher in self._watchers:  # a control socket that failed only logs: the call goes on
            spawn(self._tasks, watcher(event), f"call {self.id}: control socket")

    @property
    def ended(self) -> bool:
        return self._over.is_set()

    async def wait_ended(self) -> None:
        await self._over.wait()

    @contextlib.asynccontextmanager
    async def watching(self, send: Callable[[dict[str, Any]], Awaitable[None]]) -> AsyncIterator[None]:
        """The call's events (but the audio, which is the track's) also go to ``send`` during the block."""
        self._watchers.append(send)
        try:
            yield
        finally:
            with contextlib.suppress(ValueError):
                self._watchers.remove(send)

    def keep(self, work: Awaitable[None], what: str) -> None:
        """Run ``work`` for the call's life (cancelled when it ends); its failure is logged, the call goes on."""
        spawn(self._tasks, work, f"call {self.id}: {what}")

    def _started(self, response_id: str) -> None:
        self._tell(ev.event("output_audio_buffer.started", response_id=response_id))

    def _stopped(self, response_id: str) -> None:
        self._tell(ev.event("output_audio_buffer.stopped", response_id=response_id))

    def _clear(self) -> None:
        playing = self._speaker.flush()
        if playing is not None:
            self._tell(ev.event("output_audio_buffer.cleared", response_id=playing))

    # --- what the browser sends ---------------------------------------------

    def _on_channel(self, channel: RTCDataChannel) -> None:
        if channel.label != EVENTS_CHANNEL or self._channel is not None:
            return
        self._channel = channel
        channel.on("message", self._inbox.put_nowait)
        channel.on("close", lambda: self._spawn(self.close(), "hang-up"))
        self._spawn(self._serve_events(), "events")

    def _on_track(self, track: Any) -> None:
        if track.kind == "audio":
            self._spawn(self._serve_audio(track), "audio")

    async def _on_state(self) -> None:
        if self._pc.connectionState in ("failed", "closed"):
            self._spawn(self.close(), "hang-up")

    async def _serve_events(self) -> None:
        connection, receive = self._connection, self._receive
        assert connection is not None and receive is not None, "attach() before the call is answered"
        await connection.opened()
        self._opened.set()
        while True:
            await receive(await self._inbox.get(), self.handle)  # text, or JSON in UTF-8 bytes

    async def handle(self, message: dict[str, Any]) -> None:
        """A client event, from the data channel or a control socket."""
        if message.get("type") == "output_audio_buffer.clear":  # the buffer is the track's: the transport's own
            self._clear()
            return
        connection = self._connection
        assert connection is not None
        await connection.handle(message)

    async def _serve_audio(self, track: Any) -> None:
        await self._opened.wait()
        connection = self._connection
        assert connection is not None
        async with contextlib.aclosing(heard(track, self._turn_silence_ms)) as pieces:
            async for pcm in pieces:
                await connection.handle({"type": "input_audio_buffer.append",
                                         "audio": base64.b64encode(pcm).decode()})

    def _turn_silence_ms(self) -> int | None:
        """What ends a turn now: a gap in the caller's RTP is heard as that much silence."""
        vad = self._connection.config.server_vad if self._connection else None
        return vad.silence_duration_ms if vad is not None else None

    def _spawn(self, work: Awaitable[None], what: str) -> None:
        # A task's failure is the call's own: it ends the call (its sessions stay in Redis).
        spawn(self._tasks, work, f"call {self.id}: {what}", None if what == "hang-up" else self.close)

    async def close(self) -> None:
        """Hang up: the connection ends as a closed WebSocket's does; the peer connection closes."""
        if self.ended:
            return
        self._over.set()
        self._on_end(self)
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._connection is not None:
            await self._connection.close()
        self._speaker.stop()
        with contextlib.suppress(Exception):  # a peer connection half torn down by a failed network
            await self._pc.close()
        logger.info("call %s: ended", self.id)


class Calls:
    """The calls this process holds (media cannot move between replicas; their sessions can)."""

    def __init__(self, ice_servers: Sequence[IceServer]) -> None:
        self.ice_servers = ice_servers
        self._calls: dict[str, Call] = {}

    def new(self, identity: str) -> Call:
        call = Call(ev.new_id("rtc"), identity, self.ice_servers, self._forget)
        self._calls[call.id] = call
        return call

    def _forget(self, call: Call) -> None:
        self._calls.pop(call.id, None)

    def get(self, call_id: str) -> Call | None:
        return self._calls.get(call_id)

    def __len__(self) -> int:
        return len(self._calls)

    async def hang_up(self, store: SessionStore, call_id: str, identity: str) -> bool:
        """End the caller's call wherever it is held: here, or (the edge round robins, and a
        replica runs several API workers) in the process that answered it; whether one did."""
        call = self.get(call_id)
        if call is not None and call.identity == identity:
            await call.close()
            return True
        return await store.ask_hang_up(call_id, identity, HANG_UP_WAIT_SEC)

    async def serve_hang_ups(self, store: SessionStore) -> None:
        """Hang-ups of this process's calls that reached another process (for the process's life)."""
        async def hear() -> None:
            async for call_id, identity, reply in store.hang_up_requests():
                call = self.get(call_id)
                if call is not None and call.identity == identity:
                    await call.close()
                    await store.answer_ask(reply, held=True)
                else:  # every process answers, so the asker need not wait out a call nobody holds
                    await store.answer_ask(reply, held=False)

        await keep_hearing(hear, "hang-ups from other processes")

    async def aclose(self) -> None:
        await asyncio.gather(*(call.close() for call in list(self._calls.values())), return_exceptions=True)


async def keep_hearing(hear: Callable[[], Awaitable[None]], what: str) -> None:
    """Run ``hear`` for the process's life: a failure (Redis away) is logged and it runs again."""
    while True:
        try:
            await hear()
        except errors.StoreUnavailable as exc:
            logger.warning("calls: %s not heard (%s); listening again", what, exc.message)
        except Exception:
            logger.exception("calls: %s not heard; listening again", what)
        await asyncio.sleep(1)
