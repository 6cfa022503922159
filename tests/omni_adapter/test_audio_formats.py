"""wav / pcm16 conversion and resampling."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from omni_adapter.audio import parse_wav, resample, wav_of


def tone(frequency: float, rate: int, seconds: float) -> bytes:
    count = int(rate * seconds)
    return b"".join(struct.pack("<h", int(10_000 * math.sin(2 * math.pi * frequency * i / rate)))
                    for i in range(count))


def dominant_frequency(pcm: bytes, rate: int) -> float:
    samples = np.frombuffer(pcm, dtype="<i2").astype(float)
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[spectrum.argmax()])


def test_wav_round_trip() -> None:
    pcm = tone(440, 16_000, 0.1)
    assert parse_wav(wav_of(pcm, 16_000)) == (pcm, 16_000)


def test_streaming_wav_with_placeholder_sizes_is_read_to_the_end() -> None:
    # What `espeak-ng --stdout` writes: sizes it could not know, set to ~2 GiB.
    pcm = tone(300, 22_050, 0.05)
    header = (b"RIFF" + struct.pack("<I", 0x7FFFFF24) + b"WAVE"
              + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, 22_050, 44_100, 2, 16)
              + b"data" + struct.pack("<I", 0x7FFFF000))
    assert parse_wav(header + pcm) == (pcm, 22_050)


def test_wav_that_is_not_pcm16_mono_is_refused() -> None:
    stereo = (b"RIFF" + struct.pack("<I", 40) + b"WAVE"
              + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 2, 8_000, 32_000, 4, 16)
              + b"data" + struct.pack("<I", 4) + b"\0\0\0\0")
    with pytest.raises(ValueError, match="2 channels"):
        parse_wav(stereo)
    with pytest.raises(ValueError, match="RIFF"):
        parse_wav(b"not a wav file at all")
    with pytest.raises(ValueError, match="no data"):
        parse_wav(stereo[:36].replace(struct.pack("<HH", 1, 2), struct.pack("<HH", 1, 1), 1))


def test_resampling_keeps_duration_and_pitch() -> None:
    pcm = tone(440, 22_050, 0.5)
    out = resample(pcm, 22_050, 24_000)
    assert len(out) // 2 == round(len(pcm) // 2 * 24_000 / 22_050)
    assert dominant_frequency(out, 24_000) == pytest.approx(440, abs=3)
    assert resample(pcm, 24_000, 24_000) is pcm
