"""Spoken test input made on the spot by the real Talker (hibari), and word error rates."""

from __future__ import annotations

import functools

import numpy as np

from omni_adapter.audio import resample
from omni_adapter.listener import LISTEN_RATE, Recognizer, RecognizerPool
from omni_adapter.talker import HibariTalker

SPEECH_RATE = 24_000


@functools.lru_cache(maxsize=16)
def speech(text: str) -> bytes:
    """pcm16 mono at 24 kHz (OpenAI's rate): hibari speaking ``text``, with a little silence after."""
    talker = _talker()
    pcm = talker._synthesize(text)
    return pcm + bytes(2 * SPEECH_RATE // 4)


@functools.lru_cache(maxsize=1)
def _talker() -> HibariTalker:
    talker = HibariTalker.load()
    assert talker is not None, "hibari-tts is not installed (scripts/setup.sh installs it)"
    return talker


def pieces(pcm16: bytes, rate: int, ms: int) -> list[bytes]:
    step = rate * ms // 1000 * 2
    return [pcm16[i:i + step] for i in range(0, len(pcm16), step)]


def recognize(pcm16: bytes, rate: int) -> str:
    recognizer = Recognizer(RecognizerPool().take())
    words = recognizer.hear(resample(pcm16, rate, LISTEN_RATE)) + recognizer.end_utterance()
    return " ".join(words)


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Levenshtein distance over words, divided by the reference's length."""
    ref = [w.strip(".,?!;:").lower() for w in reference.split()]
    hyp = [w.strip(".,?!;:").lower() for w in hypothesis.split()]
    row = np.arange(len(hyp) + 1)
    for i, word in enumerate(ref, start=1):
        prev, row = row, np.empty_like(row)
        row[0] = i
        for j, other in enumerate(hyp, start=1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (word != other))
    return float(row[-1]) / max(1, len(ref))
