"""The audio doors: ``/v1/audio/transcriptions`` and ``/v1/audio/speech`` as a cascaded voice
agent's STT and TTS call them.

A real gateway process on its embedded default (``omni-gateway serve``: the Listener's Silero
VAD + Moonshine, the Talker's hibari; the model is never asked), on a real Redis, called with
the official OpenAI client. Measured, one request at a time and ``--concurrency`` at once:

- transcription: the time to the text of a WAV file of one spoken question (hibari's voice
  and espeak-ng's), as a real-time factor (seconds of work per second of audio), its word
  error rate, and for a long file (the questions joined) the first ``transcript.text.delta``;
- speech: the time to the first byte (pcm, as pipecat reads it; mp3, as LiveKit does) and to
  the whole file of one sentence, as a real-time factor.

    python -m bench.audio_doors                   # writes results/audio_doors.{json,md}
    python -m bench.audio_doors --rounds 1        # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import io
import shutil
import subprocess
import time
import wave
from pathlib import Path

from openai import AsyncOpenAI

from bench.overhead import GATEWAY_ENV
from bench.procs import embedded_gateway_on_redis, write_results
from bench.stats import summary
from omni_adapter.audio import wav_of

RESULTS = Path(__file__).parent / "results"
QUESTIONS = (
    "What is the capital of France?",
    "How many days are there in a week?",
    "Can you recommend a good book about the history of Rome?",
    "Set a timer for twelve minutes and remind me to call my sister.",
    "What's the weather going to be like in Seattle tomorrow morning?",
)
SENTENCE = "Your table is booked for seven tonight, and the chef has saved you a seat by the window."


def clips() -> list[tuple[str, str, bytes, float]]:
    """(voice, question, WAV file, seconds) for each question in hibari's voice and espeak-ng's."""
    from tests.voice import SPEECH_RATE, speech

    made = []
    for question in QUESTIONS:
        pcm = speech(question)
        made.append(("hibari", question, wav_of(pcm, SPEECH_RATE), len(pcm) / 2 / SPEECH_RATE))
        espeak = shutil.which("espeak-ng")
        if espeak:
            data = subprocess.run([espeak, "-v", "en-us+m3", "--stdout", question], check=True,
                                  capture_output=True).stdout
            with wave.open(io.BytesIO(data)) as file:
                seconds = file.getnframes() / file.getframerate()
            made.append(("espeak en-us+m3", question, data, seconds))
    return made


def joined(files: list[bytes]) -> tuple[bytes, float]:
    """The clips one after another with a second of silence between: one long recording."""
    pcm, rate = b"", 0
    for data in files:
        with wave.open(io.BytesIO(data)) as file:
            if rate and file.getframerate() != rate:
                continue
            rate = file.getframerate()
            pcm += file.readframes(file.getnframes()) + bytes(2 * rate)
    return wav_of(pcm, rate), len(pcm) / 2 / rate


async def transcribe(oai: AsyncOpenAI, data: bytes) -> tuple[float, str]:
    start = time.perf_counter()
    heard = await oai.audio.transcriptions.create(model="whisper-1", file=("clip.wav", data))
    return time.perf_counter() - start, heard.text


async def first_delta(oai: AsyncOpenAI, data: bytes) -> tuple[float, float]:
    """Seconds to the first ``transcript.text.delta`` and to ``transcript.text.done``."""
    start = time.perf_counter()
    first = None
    stream = await oai.audio.transcriptions.create(model="gpt-4o-transcribe", file=("long.wav", data), stream=True)
    async for _event in stream:
        if first is None:
            first = time.perf_counter() - start
    return first or 0.0, time.perf_counter() - start


async def speak(oai: AsyncOpenAI, fmt: str) -> tuple[float, float, int]:
    """Seconds to the first byte and to the last, and the bytes, of ``SENTENCE`` in ``fmt``."""
    start = time.perf_counter()
    first, size = None, 0
    async with oai.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input=SENTENCE,
                                                               response_format=fmt) as response:  # type: ignore[arg-type]
        async for piece in response.iter_bytes():
            first = first if first is not None else time.perf_counter() - start
            size += len(piece)
    return first or 0.0, time.perf_counter() - start, size


async def measure(url: str, rounds: int, concurrency: int) -> dict:
    from tests.voice import word_error_rate

    oai = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    made = clips()
    await transcribe(oai, made[0][2])  # the first call loads nothing, but warms the path
    seconds: list[float] = []
    rtf: list[float] = []
    words: dict[str, list[float]] = {}
    for _ in range(rounds):
        for voice, question, data, length in made:
            took, text = await transcribe(oai, data)
            seconds.append(took)
            rtf.append(took / length)
            words.setdefault(voice, []).append(word_error_rate(question, text))
    together = []
    for _ in range(rounds):
        start = time.perf_counter()
        await asyncio.gather(*(transcribe(oai, made[i % len(made)][2]) for i in range(concurrency)))
        together.append(time.perf_counter() - start)
    long_file, long_sec = joined([data for voice, _, data, _ in made if voice == "hibari"])
    streamed = [await first_delta(oai, long_file) for _ in range(rounds)]
    speech_sec = {}
    spoken_bytes = 0
    for fmt in ("pcm", "mp3"):
        runs = [await speak(oai, fmt) for _ in range(rounds)]
        speech_sec[fmt] = {"first_byte": summary([r[0] for r in runs]), "whole": summary([r[1] for r in runs])}
        spoken_bytes = spoken_bytes or runs[0][2]
    audio_sec = spoken_bytes / 2 / 24_000  # pcm16 at 24 kHz
    start = time.perf_counter()
    await asyncio.gather(*(speak(oai, "mp3") for _ in range(concurrency)))
    speech_together = time.perf_counter() - start
    return {
        "rounds": rounds, "concurrency": concurrency, "clips": len(made),
        "transcription": {"seconds": summary(seconds), "real_time_factor": summary(rtf),
                          "word_error_rate": {v: round(sum(w) / len(w), 3) for v, w in words.items()},
                          f"{concurrency}_at_once_sec": summary(together)},
        "long_file": {"audio_sec": round(long_sec, 1), "first_delta_sec": summary([s[0] for s in streamed]),
                      "done_sec": summary([s[1] for s in streamed])},
        "speech": {"sentence_audio_sec": round(audio_sec, 2), **speech_sec,
                   "real_time_factor_pcm": round(speech_sec["pcm"]["whole"]["p50"] / audio_sec, 3),
                   f"{concurrency}_at_once_mp3_sec": round(speech_together, 2)},
    }


def markdown(result: dict) -> str:
    t, long_, s = result["transcription"], result["long_file"], result["speech"]
    n = result["concurrency"]
    rows = [
        "| measure | P50 | P99 |", "|---|---|---|",
        f"| transcription of one question (s) | {t['seconds']['p50']} | {t['seconds']['p99']} |",
        f"| its real-time factor (s of work per s of audio) | {t['real_time_factor']['p50']} | "
        f"{t['real_time_factor']['p99']} |",
        f"| {n} transcriptions at once, all done (s) | {t[f'{n}_at_once_sec']['p50']} | "
        f"{t[f'{n}_at_once_sec']['p99']} |",
        f"| streamed {long_['audio_sec']} s file: first delta (s) | {long_['first_delta_sec']['p50']} | "
        f"{long_['first_delta_sec']['p99']} |",
        f"| streamed {long_['audio_sec']} s file: done (s) | {long_['done_sec']['p50']} | {long_['done_sec']['p99']} |",
        f"| speech, {s['sentence_audio_sec']} s sentence as pcm: first byte (s) | {s['pcm']['first_byte']['p50']} | "
        f"{s['pcm']['first_byte']['p99']} |",
        f"| same, whole file (s) | {s['pcm']['whole']['p50']} | {s['pcm']['whole']['p99']} |",
        f"| same as mp3: first byte (s) | {s['mp3']['first_byte']['p50']} | {s['mp3']['first_byte']['p99']} |",
    ]
    wer = ", ".join(f"{voice} {rate:.1%}" for voice, rate in t["word_error_rate"].items())
    return (f"# Audio doors ({result['clips']} clips x {result['rounds']} rounds)\n\n" + "\n".join(rows)
            + f"\n\nWord error rate: {wer}. Speech real-time factor (pcm, whole file): "
            f"{s['real_time_factor_pcm']}; {n} mp3 speeches at once: {s[f'{n}_at_once_mp3_sec']} s.\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    with embedded_gateway_on_redis(GATEWAY_ENV) as url:
        result = asyncio.run(measure(url, args.rounds, args.concurrency))
    write_results(RESULTS, "audio_doors", result, markdown(result))


if __name__ == "__main__":
    main()
