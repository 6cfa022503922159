"""A spoken answer (pcm16 mono at 24 kHz, as the engine's audio deltas carry it) as the bytes of an
audio file, written while the answer is spoken: OpenAI's speech formats.

``pcm`` is the samples as they are; ``wav`` puts a header before them whose sizes say "unknown"
(the length is not known when the first bytes leave, as in OpenAI's streamed WAV); the others
are encoded by FFmpeg (PyAV) into a container that can be written front to back.
"""

from __future__ import annotations

import io
import struct
from typing import Any, Literal

import numpy as np

from omni_adapter.audio import OPENAI_PCM16_RATE

SpeechFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]

MEDIA_TYPES: dict[SpeechFormat, str] = {
    "mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac", "wav": "audio/wav",
    "pcm": "audio/pcm",
}
#: (container, codec, sample rate) of each encoded format; Opus runs at 48 kHz.
_ENCODED: dict[str, tuple[str, str, int]] = {
    "mp3": ("mp3", "libmp3lame", OPENAI_PCM16_RATE), "opus": ("ogg", "libopus", 48_000),
    "aac": ("adts", "aac", OPENAI_PCM16_RATE), "flac": ("flac", "flac", OPENAI_PCM16_RATE),
}


class AudioFileWriter:
    """One file's bytes, piece by piece: ``write`` each stretch of samples, then ``close``."""

    def __init__(self, fmt: SpeechFormat) -> None:
        self.format = fmt
        self._started = False
        self._sink = _Sink()
        self._container: Any = None
        self._stream: Any = None
        self._resampler: Any = None
        if fmt in _ENCODED:
            import av

            container, codec, rate = _ENCODED[fmt]
            self._container = av.open(self._sink, "w", format=container)
            self._stream = self._container.add_stream(codec, rate=rate, layout="mono")
            self._resampler = av.AudioResampler(format=self._stream.format.name, layout="mono", rate=rate)

    def write(self, pcm16: bytes) -> bytes:
        """The file's next bytes, with ``pcm16`` (24 kHz) in them (an encoder may hold some back)."""
        head = b""
        if not self._started:
            self._started = True
            head = _streamed_wav_header() if self.format == "wav" else b""
        if self._container is None:
            return head + pcm16
        import av

        frame = av.AudioFrame.from_ndarray(np.frombuffer(pcm16, "<i2").reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = OPENAI_PCM16_RATE
        self._encode(self._resampler.resample(frame))
        return head + self._sink.take()

    def close(self) -> bytes:
        """The file's last bytes (what the encoder held, the container's end)."""
        head = b"" if self._started or self.format != "wav" else _streamed_wav_header()
        self._started = True
        if self._container is None:
            return head
        self._encode(self._resampler.resample(None))
        self._encode([None])
        self._container.close()
        return self._sink.take()

    def _encode(self, frames: list[Any]) -> None:
        for frame in frames:
            for packet in self._stream.encode(frame):
                self._container.mux(packet)


class _Sink(io.RawIOBase):
    """Where the container writes; written front to back and emptied as the answer is sent."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        taken = b"".join(self._parts)
        self._parts.clear()
        return taken


def _streamed_wav_header() -> bytes:
    """A 16-bit mono WAV header whose sizes say "to the end of the file" (0xFFFFFFFF)."""
    rate = OPENAI_PCM16_RATE
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, 2 * rate, 2, 16)
            + b"data" + struct.pack("<I", 0xFFFFFFFF))
