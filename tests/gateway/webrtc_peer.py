"""A WebRTC caller made with aiortc, as a browser would call ``/v1/realtime/calls``.

It offers an Opus microphone track and the ``oai-events`` data channel, posts
the offer with a client secret (the openai SDK's ``realtime.calls.create``), and keeps what comes back: the server's
events from the channel and the answer's audio track as 24 kHz pcm16.
The microphone is the gateway's own paced track (``media.SpeakerTrack``),
fed with speech made by the real Talker; it can go quiet on the wire (no RTP
at all, as when the network drops or a sender stops) or end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError
from av import AudioFrame
from av.audio.resampler import AudioResampler
from openai import AsyncOpenAI

from gateway.api.realtime.media import RATE, SpeakerTrack


class Microphone(SpeakerTrack):
    """Speech when told, silence otherwise; after :meth:`cut`, no frames at all (RTP stops)."""

    def __init__(self, on_said: Callable[[str], None] = lambda _: None) -> None:
        super().__init__(lambda _: None, on_said)
        self._cut = asyncio.Event()

    def cut(self) -> None:
        self._cut.set()

    async def recv(self) -> AudioFrame:
        if self._cut.is_set():
            await asyncio.Future()  # never: aiortc's sender waits for a frame and sends nothing
        return await super().recv()


class Peer:
    def __init__(self, url: str, secret: str, *, channel: bool = True) -> None:
        self.url, self.secret = url, secret
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.mic = Microphone(self._said_all)
        #: When the microphone played the last frame of what was said (``time.monotonic``).
        self.said_at: float | None = None
        self.pc.addTrack(self.mic)
        self.channel = self.pc.createDataChannel("oai-events") if channel else None
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        #: The answer's audio as heard from its first sound on (24 kHz pcm16), and when that came.
        self.heard = bytearray()
        self.first_sound_at: float | None = None
        self.sounding = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None
        self.location = ""
        self.answer_sdp = ""
        self._said = 0
        #: When each event came off the channel (``time.monotonic``), by type, in order.
        self.arrived: list[tuple[str, float]] = []
        #: The server ended the call (its side of the data channel closed).
        self.hung_up = asyncio.Event()
        if self.channel is not None:
            self.channel.on("message", self._on_message)
            self.channel.on("close", self.hung_up.set)
        self.pc.on("track", self._on_track)

    async def call(self, session: dict[str, Any] | None = None, resume: dict[str, str] | None = None) -> None:
        """Offer, and take the answer: signalling through the official SDK's ``realtime.calls.create``
        (``resume``: the ``session_id`` and ``last_event_id`` of a call that broke off)."""
        await self.pc.setLocalDescription(await self.pc.createOffer())
        client = AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.secret, max_retries=0)
        answer = await client.realtime.calls.create(sdp=self.pc.localDescription.sdp, extra_query=resume,
                                                    **({"session": session} if session else {}))  # type: ignore[arg-type]
        self.location = answer.response.headers["location"]
        self.answer_sdp = answer.text
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=answer.text, type="answer"))

    async def __aenter__(self) -> Peer:
        await self.call()
        return self

    async def __aexit__(self, *exc: tuple[type[BaseException], BaseException, TracebackType] | None) -> None:
        await self.pc.close()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)

    def say(self, pcm: bytes) -> None:
        """Speak into the microphone (24 kHz pcm16), in real time from now."""
        self._said += 1
        self.mic.speak(f"said-{self._said}", pcm)
        self.mic.spoken(f"said-{self._said}")

    def _on_message(self, raw: str) -> None:
        event = json.loads(raw)
        self.arrived.append((event["type"], time.monotonic()))
        self.events.put_nowait(event)

    def _said_all(self, _: str) -> None:
        self.said_at = time.monotonic()

    def send(self, event: dict[str, Any]) -> None:
        assert self.channel is not None
        self.channel.send(json.dumps(event))

    async def until(self, last: str, within_sec: float = 30) -> list[dict[str, Any]]:
        """Every event up to and including the first of type ``last``."""
        seen: list[dict[str, Any]] = []
        async with asyncio.timeout(within_sec):
            while not seen or seen[-1]["type"] != last:
                seen.append(await self.events.get())
        return seen

    def _on_track(self, track: Any) -> None:
        self._reader = asyncio.create_task(self._listen(track))

    async def _listen(self, track: Any) -> None:
        resampler = AudioResampler(format="s16", layout="mono", rate=RATE)
        with contextlib.suppress(MediaStreamError):
            while True:
                frame = await track.recv()
                for piece in resampler.resample(frame):
                    pcm = bytes(piece.planes[0])[:piece.samples * 2]
                    if self.first_sound_at is None and any(pcm):
                        self.first_sound_at = time.monotonic()
                        self.sounding.set()
                    if self.first_sound_at is not None:  # the recognizer hears nothing after seconds of silence
                        self.heard += pcm
