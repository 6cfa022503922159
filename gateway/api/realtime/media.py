"""A WebRTC call's audio: the caller's track in as 24 kHz pcm16, the answer out as a paced track.

aiortc decodes the caller's Opus (PyAV/libopus) into 48 kHz frames; they are
mixed down and resampled with soxr, state carried across frames
(``omni_adapter/audio.py``), into the pcm16 the Realtime events carry.

The answer goes out as :class:`SpeakerTrack`, which aiortc encodes to Opus.
aiortc asks it for a frame whenever it wants one, so the track sets the pace:
a 20 ms frame every 20 ms of wall time, the answer's audio while there is
some, silence otherwise (RTP keeps flowing, as a browser expects). What it
holds is the *output audio buffer* of OpenAI's WebRTC protocol: ``flush``
drops it at once (barge-in), and the track tells when playback starts and
stops.
"""

from __future__ import annotations

import asyncio
import fractions
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
from aiortc import MediaStreamTrack
from aiortc.mediastreams import MediaStreamError
from av import AudioFrame

from omni_adapter.audio import StreamResampler

#: The Realtime protocol's audio: pcm16 mono at 24 kHz.
RATE = 24_000
#: One RTP packet's worth (WebRTC's usual Opus packet time).
FRAME_MS = 20
FRAME_SAMPLES = RATE * FRAME_MS // 1000
FRAME_BYTES = FRAME_SAMPLES * 2
#: Caller audio is handed on in pieces this long: the size of a voice client's appends.
PIECE_BYTES = RATE * 2 * 100 // 1000


async def heard(track: MediaStreamTrack) -> AsyncIterator[bytes]:
    """The caller's audio as 24 kHz pcm16 pieces of about 100 ms, until the track ends."""
    resampler = StreamResampler(RATE)
    pending = bytearray()
    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:  # the caller hung up or the track was stopped
            break
        pending += mono_pcm16(frame, resampler)
        if len(pending) >= PIECE_BYTES:
            yield bytes(pending)
            pending.clear()
    pending += resampler.flush().astype("<i2").tobytes()
    if pending:
        yield bytes(pending)


def mono_pcm16(frame: Any, resampler: StreamResampler) -> bytes:
    """One decoded frame (aiortc's Opus decoder: 48 kHz stereo) as 24 kHz mono pcm16."""
    samples = frame.to_ndarray()
    channels = len(frame.layout.channels)
    # Planar: one row per channel; packed: one row, channels interleaved.
    mixed = samples.mean(axis=0) if frame.format.is_planar else samples.reshape(-1, channels).mean(axis=1)
    if samples.dtype.kind == "f":
        mixed = mixed * 32767
    pcm = np.clip(mixed, -32768, 32767).astype("<i2").tobytes()
    return bytes(resampler.push(pcm, frame.sample_rate).astype("<i2").tobytes())


class SpeakerTrack(MediaStreamTrack):
    """The answer's audio, paced in real time; its buffer is OpenAI's output audio buffer."""

    kind = "audio"

    def __init__(self, on_started: Callable[[str], None], on_stopped: Callable[[str], None]) -> None:
        super().__init__()
        self._buffer = bytearray()
        #: The response whose audio is in the buffer, and whether all of it has come.
        self._response: str | None = None
        self._complete = False
        self._playing = False
        self._on_started, self._on_stopped = on_started, on_stopped
        self._start: float | None = None
        self._pts = 0

    def speak(self, response_id: str, pcm: bytes) -> None:
        """Queue a piece of a response's audio (24 kHz pcm16)."""
        if response_id != self._response:
            self._response, self._complete = response_id, False
        self._buffer += pcm

    def spoken(self, response_id: str) -> None:
        """All of the response's audio is queued: playback stops when the buffer runs dry."""
        if response_id == self._response:
            self._complete = True

    def flush(self) -> str | None:
        """Drop what is not played yet; the response that was playing, if one was."""
        playing = self._response if self._playing else None
        self._buffer.clear()
        self._response, self._complete, self._playing = None, False, False
        return playing

    async def recv(self) -> AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        now = time.monotonic()
        if self._start is None:
            self._start = now
        else:
            self._pts += FRAME_SAMPLES
            await asyncio.sleep(max(0.0, self._start + self._pts / RATE - now))
        return self._frame(self._next_pcm())

    def _next_pcm(self) -> bytes:
        if self._buffer and not self._playing and self._response is not None:
            self._playing = True
            self._on_started(self._response)
        pcm = bytes(self._buffer[:FRAME_BYTES])
        del self._buffer[:FRAME_BYTES]
        # A Talker slower than real time leaves gaps: silence, still playing, until all has come.
        if self._playing and self._complete and not self._buffer and self._response is not None:
            response, self._response, self._playing = self._response, None, False
            self._on_stopped(response)
        return pcm.ljust(FRAME_BYTES, b"\0")

    def _frame(self, pcm: bytes) -> AudioFrame:
        frame = AudioFrame(format="s16", layout="mono", samples=FRAME_SAMPLES)
        frame.planes[0].update(pcm)
        frame.pts = self._pts
        frame.sample_rate = RATE
        frame.time_base = fractions.Fraction(1, RATE)
        return frame
