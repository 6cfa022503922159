"""Spoken test input made on the spot by the real Talker (hibari), and word error rates."""

from __future__ import annotations

import functools
import re

import numpy as np

from omni_adapter.audio import StreamResampler, pcm16_from_waveform
from omni_adapter.listener import LISTEN_RATE, Hearing
from omni_adapter.talker import HibariTalker

SPEECH_RATE = 24_000


@functools.lru_cache(maxsize=32)
def speech(text: str) -> bytes:
    """pcm16 mono at 24 kHz (OpenAI's rate): hibari speaking ``text``, with a little silence after
    (and hibari's own before and after: a recording, not the Talker's trimmed answer)."""
    return pcm16_from_waveform(_talker().voice(text)) + bytes(2 * SPEECH_RATE // 4)


@functools.lru_cache(maxsize=1)
def _talker() -> HibariTalker:
    talker = HibariTalker.load()
    assert talker is not None, "hibari-tts is not installed (scripts/setup.sh installs it)"
    return talker


@functools.lru_cache(maxsize=1)
def hearing() -> Hearing:
    """The Listener's parts as the engine loads them (Moonshine, Silero VAD), once per test process."""
    loaded = Hearing.load()
    assert loaded is not None, "no recognizer: scripts/setup.sh converts Moonshine"
    return loaded


def pieces(pcm16: bytes, rate: int, ms: int) -> list[bytes]:
    step = rate * ms // 1000 * 2
    return [pcm16[i:i + step] for i in range(0, len(pcm16), step)]


def recognize(pcm16: bytes, rate: int) -> str:
    """The recognizer's words for a whole recording (one phrase, no VAD)."""
    resampler = StreamResampler(LISTEN_RATE)
    samples = np.concatenate([resampler.push(pcm16, rate), resampler.flush()])
    return hearing().recognizer.transcribe(samples)


_NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]


def normalize(text: str) -> list[str]:
    """Words as a WER compares them: lower case, no punctuation, hyphens joined ("to-night"),
    small numbers spelled out."""
    words = re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", "")).split()
    return [_NUMBERS[int(w)] if w.isdigit() and int(w) < len(_NUMBERS) else w.strip("'") for w in words]


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(Levenshtein distance over normalized words, the reference's word count)."""
    ref, hyp = normalize(reference), normalize(hypothesis)
    row = np.arange(len(hyp) + 1)
    for i, word in enumerate(ref, start=1):
        prev, row = row, np.empty_like(row)
        row[0] = i
        for j, other in enumerate(hyp, start=1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (word != other))
    return int(row[-1]), len(ref)


def word_error_rate(reference: str, hypothesis: str) -> float:
    errors, words = word_errors(reference, hypothesis)
    return errors / max(1, words)
