"""A WebRTC call's audio: the caller's track in as 24 kHz pcm16, the answer out as a paced track.

aiortc decodes the caller's Opus (PyAV/libopus) into 48 kHz frames; they are
mixed down and resampled with soxr, state carried across frames
(``omni_adapter/audio.py``), into the pcm16 the Realtime events carry.

A gap in the caller's frames is heard as silence while it lasts. A
browser that mutes its track keeps sending (silent) packets, but a track
that ends, a sender that stops, or a lost network sends nothing at all:
without it, server_vad would wait for silence that never comes and the
turn would stay open until the session's timeout. OpenAI's server ends
such a turn; so does this, after the turn's own ``silence_duration_ms``.

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
from collections.abc import AsyncGenerator, Callable
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
PIECE_MS = 100
PIECE_BYTES = RATE * 2 * PIECE_MS // 1000
#: No frame for this long is a gap in RTP (packets come every 20 ms; aiortc's jitter
#: buffer smooths ordinary jitter): from then on, each such stretch is heard as silence.
GAP_MS = 100
#: Silence heard beyond what ends a turn: Silero's windows (32 ms) and the resampler's
#: delay, so the last window before the gap is not what decides.
GAP_MARGIN_MS = 200


async def heard(track: MediaStreamTrack, turn_silence_ms: Callable[[], int | None] = lambda: None,
                ) -> AsyncGenerator[bytes]:
    """The caller's audio as 24 kHz pcm16 pieces of about 100 ms, until the track ends.

    ``turn_silence_ms``: the silence that ends a turn now (server_vad's
    ``silence_duration_ms``; ``None`` when turns end by a commit). A gap in
    the frames, and the end of the track, are heard as silence up to that
    (plus a margin): as it passes during a gap, at once at the end.
    """
    resampler = StreamResampler(RATE)
    pending = bytearray()
    silent_ms = 0  # silence heard in the current gap
    frame = asyncio.ensure_future(track.recv())
    try:
        while True:
            limit = turn_silence_ms()
            fill = limit is not None and silent_ms < limit + GAP_MARGIN_MS
            done, _ = await asyncio.wait({frame}, timeout=GAP_MS / 1000 if fill else None)
            if not done:  # RTP stopped: what came before, then the gap's silence as it passes
                if silent_ms == 0:
                    pending += resampler.flush().astype("<i2").tobytes()
                    if pending:
                        yield bytes(pending)
                        pending.clear()
                silent_ms += GAP_MS
                yield silence(GAP_MS)
                continue
            try:
                decoded = frame.result()
            except MediaStreamError:  # the caller hung up or the track was stopped
                break
            silent_ms = 0
            frame = asyncio.ensure_future(track.recv())
            pending += mono_pcm16(decoded, resampler)
            if len(pending) >= PIECE_BYTES:
                yield bytes(pending)
                pending.clear()
    finally:
        frame.cancel()
    pending += resampler.flush().astype("<i2").tobytes()
    if pending:
        yield bytes(pending)
    limit = turn_silence_ms()
    if limit is not None and silent_ms < limit + GAP_MARGIN_MS:  # no more audio will come: a turn it was in ends
        yield silence(limit + GAP_MARGIN_MS - silent_ms)


def silence(ms: int) -> bytes:
    return bytes(RATE * 2 * ms // 1000)


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
        if pcm and not self._playing:
            # It goes out with the next frame, within 20 ms. Said now, not at that frame: an
            # answer whose audio comes at once (one short phrase) ended (``response.done``)
            # before that frame, and OpenAI's server says the buffer started before the end.
            self._playing = True
            self._on_started(response_id)

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
