"""The word-error-rate set: spoken questions and commands, fed the way clients feed them.

24 clips: 16 by hibari at three speeds, 8 by espeak-ng (150 words a
minute: at its default 175 a listener also has to guess); each clean and with
white noise at 15 dB below the speech; each fed through the real Listener
(stateful resampling, Silero VAD, Moonshine) as 200 ms chunks at 24 kHz (an
HTTP client, OpenAI Realtime) and as 20 ms frames at 48 kHz (a browser,
WebRTC). Used by tests/omni_adapter/test_wer.py and bench/voice.py.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from omni_adapter.audio import parse_wav, resample
from omni_adapter.listener import ListeningSession
from omni_adapter.port import EngineRejectedError, InputChunk
from omni_adapter.scripted import ScriptedSession
from tests.voice import SPEECH_RATE, _talker, hearing, pieces, word_errors

SENTENCES = (
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Turn off the lights in the kitchen.",
    "What time does the train to Boston leave?",
    "Please set a timer for ten minutes.",
    "Tell me a joke about computers.",
    "How far is the moon from the earth?",
    "Play some relaxing music in the living room.",
    "What is the weather like tomorrow morning?",
    "Remind me to call my mother tonight.",
    "Why is the sky blue?",
    "Translate good morning into Spanish.",
    "Add milk and eggs to my shopping list.",
    "Who wrote the play Romeo and Juliet?",
    "How do I boil an egg?",
    "Send a message to Sarah saying I am running late.",
    "What is the largest animal in the ocean?",
    "Open the garage door.",
    "How many days are there in a leap year?",
    "Book a table for two people tonight.",
    "Explain how a rainbow is formed.",
    "Stop the alarm.",
    "Can you recommend a good book to read?",
    "What should I cook for dinner with chicken and rice?",
)
#: hibari's speaking speeds, in turn; the last 8 sentences are espeak-ng's.
HIBARI_SPEEDS = (0.85, 1.0, 1.2)
ESPEAK_FROM = 16
NOISE_DB = 15.0
#: How clients feed audio: (name, sample rate, chunk length in ms).
FEEDS = (("24 kHz, 200 ms chunks", 24_000, 200), ("48 kHz, 20 ms frames", 48_000, 20))


@dataclass(frozen=True)
class Clip:
    text: str
    voice: str
    pcm16: bytes  # at 24 kHz


def make_clips() -> list[Clip]:
    """The 24 clean clips (a few seconds of synthesis)."""
    clips = []
    for i, text in enumerate(SENTENCES):
        if i < ESPEAK_FROM:
            speed = HIBARI_SPEEDS[i % len(HIBARI_SPEEDS)]
            audio = _talker()._tts(text, speed=speed, seed=0)
            pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
            clips.append(Clip(text, f"hibari x{speed}", pcm + bytes(SPEECH_RATE)))  # 0.5 s of silence after
        else:
            clips.append(Clip(text, "espeak-ng", _espeak(text) + bytes(SPEECH_RATE)))
    return clips


def _espeak(text: str) -> bytes:
    executable = shutil.which("espeak-ng")
    assert executable, "espeak-ng is not installed (scripts/setup.sh installs it)"
    wav = subprocess.run([executable, "--stdout", "-v", "en-us", "-s", "150"], input=text.encode(),
                         capture_output=True, check=True).stdout
    pcm, rate = parse_wav(wav)
    return resample(pcm, rate, SPEECH_RATE)


def noisy(clip: Clip, seed: int) -> Clip:
    """The clip with white noise ``NOISE_DB`` below the speech's level."""
    samples = np.frombuffer(clip.pcm16, dtype="<i2").astype(np.float64)
    voiced = samples[np.abs(samples) > 500]
    level = np.sqrt(np.mean(voiced ** 2)) / 10 ** (NOISE_DB / 20)
    noise = np.random.default_rng(seed).normal(0, level, samples.size)
    return Clip(clip.text, clip.voice, np.clip(samples + noise, -32768, 32767).astype("<i2").tobytes())


async def heard(clip: Clip, rate: int, chunk_ms: int) -> str:
    """What the Listener feeds the Thinker for the clip, fed in chunks as a client would."""
    pcm = resample(clip.pcm16, SPEECH_RATE, rate)
    thinker = ScriptedSession()
    session = ListeningSession(thinker, hearing())
    for seq, piece in enumerate(pieces(pcm, rate, chunk_ms)):
        await session.feed([InputChunk(seq, "audio", piece, format="pcm16", sample_rate=rate)])
    try:
        await session.end_input()
    except EngineRejectedError:
        return ""
    return thinker.input_text


@dataclass
class Tally:
    errors: int = 0
    words: int = 0

    @property
    def rate(self) -> float:
        return self.errors / max(1, self.words)


async def measure(clips: list[Clip]) -> tuple[dict[tuple[str, str], Tally], list[tuple[str, str, str, str]]]:
    """WER by (clean|noisy, feed), and every miss as (condition, feed, said, heard)."""
    tallies: dict[tuple[str, str], Tally] = defaultdict(Tally)
    misses = []
    jobs = [(condition, feed, clip if condition == "clean" else noisy(clip, seed))
            for seed, clip in enumerate(clips) for condition in ("clean", "noisy") for feed in FEEDS]
    gate = asyncio.Semaphore(2)  # the Listener's two threads

    async def one(condition: str, feed: tuple[str, int, int], clip: Clip) -> None:
        async with gate:
            text = await heard(clip, feed[1], feed[2])
        errors, words = word_errors(clip.text, text)
        tally = tallies[(condition, feed[0])]
        tally.errors += errors
        tally.words += words
        if errors:
            misses.append((condition, feed[0], clip.text, text))

    await asyncio.gather(*(one(*job) for job in jobs))
    return dict(tallies), misses
