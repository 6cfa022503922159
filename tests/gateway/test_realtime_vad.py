"""server_vad's detector (Silero VAD): speech opens and closes a turn; noise, music and breathing do not."""

from __future__ import annotations

import numpy as np

from gateway.api.realtime.vad import SpeechDetector, VadChange
from tests.voice import SPEECH_RATE, pieces, speech

RNG = np.random.default_rng(0)


def changes(pcm: bytes, frame_ms: int = 20, **knobs: float) -> list[VadChange]:
    detector = SpeechDetector(SPEECH_RATE, **knobs)  # type: ignore[arg-type]
    return [change for frame in pieces(pcm, SPEECH_RATE, frame_ms) for change in detector.feed(frame)]


def seconds(n: float) -> int:
    return int(SPEECH_RATE * n)


def as_pcm(samples: np.ndarray) -> bytes:
    return np.clip(samples, -32768, 32767).astype("<i2").tobytes()


def test_speech_starts_and_stops_a_turn_with_openai_s_timing() -> None:
    silence = bytes(2 * seconds(1))
    said = speech("What is the capital of France?")
    found = changes(silence + said + silence, prefix_padding_ms=300, silence_duration_ms=500)
    assert [c.kind for c in found] == ["speech_started", "speech_stopped"]
    loud = np.flatnonzero(np.abs(np.frombuffer(said, dtype="<i2")) > 1000)
    onset_ms, end_ms = (1000 + int(i) * 1000 // SPEECH_RATE for i in (loud[0], loud[-1]))
    started, stopped = found[0].at_ms, found[1].at_ms
    assert abs(started - (onset_ms - 300)) <= 100, (started, onset_ms)  # reported 300 ms before the onset
    assert abs(stopped - end_ms) <= 200, (stopped, end_ms)


def test_a_short_pause_inside_speech_does_not_end_the_turn() -> None:
    pause = bytes(2 * seconds(0.3))
    found = changes(speech("What is")[:-SPEECH_RATE] + pause + speech("the capital of France?"), silence_duration_ms=800)
    assert [c.kind for c in found] == ["speech_started"]  # it ends only after 800 ms of silence


def test_noise_music_and_breathing_do_not_open_a_turn() -> None:
    t = np.arange(seconds(4)) / SPEECH_RATE
    hiss = RNG.normal(0, 4000, t.size)  # loud white noise
    chords = sum(np.sin(2 * np.pi * f * t) for f in (220, 277, 330, 440)) * 3000  # music-like tones
    envelope = np.clip(np.sin(2 * np.pi * 0.5 * t), 0, None) ** 2  # slow breaths, one every 2 s
    breaths = np.convolve(RNG.normal(0, 6000, t.size), np.ones(8) / 8, mode="same") * envelope
    for name, sound in {"hiss": hiss, "music": chords, "breathing": breaths}.items():
        assert changes(as_pcm(sound)) == [], name


def test_a_piece_holding_several_changes_says_where_each_was_heard() -> None:
    """Fed a whole recording at once, the detector finds what it finds fed 20 ms at a time, and
    says where in the piece each change was decided (so the audio is cut there); a detector
    started later in the buffer counts from the buffer's start."""
    pause = bytes(2 * seconds(0.6))
    recording = bytes(2 * seconds(1)) + speech("Turn off the lights.") + pause + speech("What time is it?") + pause
    framed = changes(recording, silence_duration_ms=500)
    whole = SpeechDetector(SPEECH_RATE, silence_duration_ms=500, origin_ms=7000).feed(recording)
    assert [c.kind for c in whole] == [c.kind for c in framed] == ["speech_started", "speech_stopped"] * 2
    assert [c.at_ms - 7000 for c in whole] == [c.at_ms for c in framed]
    for change in whole:
        heard_ms = change.cut * 1000 // (2 * SPEECH_RATE)
        waited = 300 + 64 if change.kind == "speech_started" else 500  # the padding and two windows, or the silence
        assert 0 <= heard_ms - (change.at_ms - 7000) - waited <= 32, (change, heard_ms)
