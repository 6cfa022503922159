"""Audio in the shapes callers have, as the pcm16 the gateway takes (numpy only when given arrays).

The gateway reads audio chunks as raw pcm16 mono (any common rate, given
with ``X-Sample-Rate``) or as WAV; the answer's audio is pcm16 at 24 kHz.
"""

from __future__ import annotations

import io
import wave
from pathlib import Path
from typing import Any

#: The rate of the answer's audio (OpenAI's pcm16 rate).
ANSWER_RATE = 24_000


def pcm16_of_array(array: Any) -> bytes:
    """A numpy array as pcm16 little-endian: int16 as is, floats in [-1, 1] scaled and clipped."""
    import numpy as np

    samples = np.asarray(array)
    if samples.ndim != 1:
        raise ValueError(f"audio must be mono: a 1-D array, not shape {samples.shape}")
    if samples.dtype == np.int16:
        return samples.astype("<i2").tobytes()
    if samples.dtype.kind == "f":
        return (np.clip(samples, -1.0, 1.0) * 32767).round().astype("<i2").tobytes()
    raise ValueError(f"audio arrays must be int16 or float, not {samples.dtype}")


def read_wav(source: str | Path | bytes) -> tuple[bytes, int]:
    """pcm16 mono and its rate from a WAV (a path or its bytes); channels are mixed down."""
    data = source if isinstance(source, bytes) else Path(source).read_bytes()
    try:
        with wave.open(io.BytesIO(data)) as wav:
            width, channels, rate = wav.getsampwidth(), wav.getnchannels(), wav.getframerate()
            frames = wav.readframes(wav.getnframes())
    except (wave.Error, EOFError) as exc:
        raise ValueError(f"not a PCM WAV file: {exc}") from exc
    if width != 2 or channels != 1:
        frames = _to_mono_pcm16(frames, width, channels)
    return frames, rate


def wav_bytes(pcm16: bytes, rate: int = ANSWER_RATE) -> bytes:
    """pcm16 mono wrapped as a WAV file."""
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(pcm16)
    return out.getvalue()


def _to_mono_pcm16(frames: bytes, width: int, channels: int) -> bytes:
    import numpy as np

    if width == 1:  # 8-bit WAV is unsigned
        samples = (np.frombuffer(frames, np.uint8).astype(np.float64) - 128) / 128
    elif width in (2, 4):
        kind = "<i2" if width == 2 else "<i4"
        samples = np.frombuffer(frames, kind).astype(np.float64) / (2 ** (8 * width - 1))
    else:
        raise ValueError(f"{8 * width}-bit WAV is not supported: use 8, 16 or 32-bit PCM")
    return pcm16_of_array(samples.reshape(-1, channels).mean(axis=1))
