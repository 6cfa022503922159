"""pcm16 audio helpers: wav in and out, resampling to OpenAI's rate.

OpenAI's ``pcm16`` audio (``delta.audio.data``) is 16-bit little-endian mono
at 24 kHz, with no header, so every engine's audio is brought to that rate
before it leaves the gateway. Only the standard library is needed, except
for resampling (numpy, which every engine installation has).
"""

from __future__ import annotations

import io
import struct
import wave

#: The rate OpenAI clients assume for ``pcm16`` audio.
OPENAI_PCM16_RATE = 24_000


def parse_wav(data: bytes) -> tuple[bytes, int]:
    """The pcm16 mono samples and sample rate of a wav file.

    Streaming writers (``espeak-ng --stdout``) cannot know the length up
    front and put a placeholder size in the header, so the ``data`` chunk is
    taken as everything after its header, whatever size it claims. Raises
    ``ValueError`` for anything but 16-bit PCM mono.
    """
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError("not a RIFF/WAVE file")
    position, rate = 12, None
    while position + 8 <= len(data):
        chunk_id, size = data[position:position + 4], struct.unpack_from("<I", data, position + 4)[0]
        body = position + 8
        if chunk_id == b"fmt ":
            audio_format, channels, rate = struct.unpack_from("<HHI", data, body)
            bits = struct.unpack_from("<H", data, body + 14)[0]
            if audio_format != 1 or channels != 1 or bits != 16:
                raise ValueError(f"expected 16-bit PCM mono, got format {audio_format}, "
                                 f"{channels} channels, {bits} bits")
        elif chunk_id == b"data":
            if rate is None:
                raise ValueError("wav data chunk before its fmt chunk")
            samples = data[body:body + size] if body + size <= len(data) else data[body:]
            return samples[:len(samples) // 2 * 2], rate
        position = body + size + (size & 1)
    raise ValueError("wav file has no data chunk")


def to_wav(pcm16: bytes, sample_rate: int) -> bytes:
    """A complete wav file around pcm16 mono samples."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm16)
    return buffer.getvalue()


def resample(pcm16: bytes, from_rate: int, to_rate: int) -> bytes:
    """Linear-interpolation resampling; plenty for speech at these rates."""
    if from_rate == to_rate or not pcm16:
        return pcm16
    import numpy as np

    samples = np.frombuffer(pcm16, dtype="<i2").astype(np.float64)
    count = max(1, round(len(samples) * to_rate / from_rate))
    positions = np.arange(count) * (from_rate / to_rate)
    resampled = np.interp(positions, np.arange(len(samples)), samples)
    return np.clip(np.rint(resampled), -32768, 32767).astype("<i2").tobytes()
