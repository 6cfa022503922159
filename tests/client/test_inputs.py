"""What the client makes of its callers' input, before any request: chunks, WAVs, paced files."""

from __future__ import annotations

import io
import wave
from pathlib import Path

import numpy as np
import pytest

from omni_client.audio import read_wav, wav_bytes
from omni_client.chunks import Chunk, chunk_of
from omni_client.inputs import InputError, audio_chunks, load, text_chunks


def wav_of(samples: np.ndarray, width: int, channels: int, rate: int = 8_000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(channels)
        wav.setsampwidth(width)
        wav.setframerate(rate)
        wav.writeframes(samples.tobytes())
    return out.getvalue()


def test_wavs_of_any_common_shape_become_mono_pcm16() -> None:
    mono = np.array([0, 1000, -1000, 32767], dtype="<i2")
    assert read_wav(wav_of(mono, 2, 1)) == (mono.tobytes(), 8_000)
    stereo = np.stack([mono, mono // 2], axis=1).astype("<i2")  # left, right at half
    pcm, _ = read_wav(wav_of(stereo, 2, 2))
    assert np.abs(np.frombuffer(pcm, "<i2").astype(int) - mono.astype(int) * 3 // 4).max() <= 1
    eight_bit = np.array([128, 255, 0], dtype=np.uint8)
    assert np.frombuffer(read_wav(wav_of(eight_bit, 1, 1))[0], "<i2").tolist() == [0, 32511, -32767]
    wide = (mono.astype("<i4") << 16).astype("<i4")
    assert np.abs(np.frombuffer(read_wav(wav_of(wide, 4, 1))[0], "<i2") - mono).max() <= 1
    with pytest.raises(ValueError, match="24-bit WAV is not supported"):
        read_wav(wav_of(np.zeros(6, np.uint8), 3, 1))
    with pytest.raises(ValueError, match="not a PCM WAV file"):
        read_wav(b"RIFF....WAVEjunk")
    assert read_wav(wav_bytes(mono.tobytes(), 24_000)) == (mono.tobytes(), 24_000)


def test_chunk_of_each_shape() -> None:
    assert chunk_of("hi") == Chunk("text", b"hi")
    assert chunk_of(b"\x01\x00") == Chunk("audio", b"\x01\x00", "pcm16", 16_000)
    assert chunk_of(np.array([0.5, -2.0]), sample_rate=24_000) == Chunk(
        "audio", np.array([16384, -32767], "<i2").tobytes(), "pcm16", 24_000)
    assert chunk_of(wav_bytes(b"\x00\x00")).format == "wav"
    with pytest.raises(ValueError, match="int16 or float"):
        chunk_of(np.array([1, 2], dtype=np.int64))
    with pytest.raises(TypeError, match="cannot send dict"):
        chunk_of({"text": "hi"})
    headers = Chunk("audio", b"", "pcm16", 8_000).headers(7, end_of_input=True)
    assert headers["X-Sequence-Id"] == "7" and headers["X-End-Of-Input"] == "true"
    assert headers["X-Sample-Rate"] == "8000" and headers["X-Modality"] == "audio"


def test_text_is_cut_by_words_or_characters_and_joins_back_exactly() -> None:
    text = "  What is\tthe capital\n of France?  \n"
    by_words = text_chunks(text, chunk_ms=100, words=2, chars=None)
    assert "".join(p.chunk.body.decode() for p in by_words) == text
    assert [p.chunk.body.decode() for p in by_words] == ["  What is\t", "the capital\n ", "of France?  \n"]
    assert [p.ready_at for p in by_words] == [0.0, 0.1, 0.2]
    by_chars = text_chunks(text, chunk_ms=100, words=2, chars=10)
    assert "".join(p.chunk.body.decode() for p in by_chars) == text and len(by_chars) == 4
    with pytest.raises(InputError, match="is empty"):
        text_chunks(" \n", 100, 1, None)


def test_audio_is_cut_by_duration_and_ready_when_spoken(tmp_path: Path) -> None:
    pcm = np.arange(1_000, dtype="<i2").tobytes()  # 62.5 ms at 16 kHz
    paced = audio_chunks(wav_bytes(pcm, 16_000), "q.wav", chunk_ms=20)
    assert b"".join(p.chunk.body for p in paced) == pcm and len(paced) == 4
    assert [p.ready_at for p in paced] == [0.02, 0.04, 0.06, 0.0625]
    assert {(p.chunk.format, p.chunk.sample_rate) for p in paced} == {("pcm16", 16_000)}
    (path := tmp_path / "q.wav").write_bytes(wav_bytes(pcm, 16_000))
    assert load(str(path), chunk_ms=20, words=1, chars=None)[1] == "audio"
    (latin := tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(InputError, match="neither UTF-8 text nor a WAV"):
        load(str(latin), chunk_ms=20, words=1, chars=None)
