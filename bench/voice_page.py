"""The voice page's own figure: end of speech -> first sound, in a real Chromium.

``bench/voice.py`` times the session API from the client's side; this is
what a person using ``/demo`` is shown. A gateway process on its embedded
default (real vLLM on the CPU, Listener, Talker; the page on), one real
Redis; Debian's Chromium driven by Playwright, its fake microphone playing
a question spoken by hibari (after 0.3 s of silence, then silence). Push to
talk: the button is held while the question plays and let go about 200 ms
or 500 ms after the speech ends (the file starts when the page opens the
microphone, a little before it shows "listening", so the hold after the
speech is at most that). The page's figure runs from the release
(``commit`` + ``response.create`` on /v1/realtime) to the moment the first
audio buffer is scheduled to play (``#latency``'s ``data-ms``). One fresh
browser per turn: the fake microphone plays its file once.

    python -m bench.voice_page              # writes results/voice_page.{json,md}
    python -m bench.voice_page --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from bench.overhead import GATEWAY_ENV
from bench.procs import embedded_gateway_on_redis, write_results
from bench.stats import summary
from bench.voice import QUESTIONS, RELEASES_MS
from omni_adapter.audio import resample, wav_of
from tests.gateway.test_demo_page import MIC_RATE, chromium, open_page, turn_texts
from tests.voice import SPEECH_RATE, speech

RESULTS = Path(__file__).parent / "results"
BEFORE_SEC = 0.3


def microphone(path: Path, question: str) -> tuple[Path, float]:
    """The fake microphone's file (48 kHz WAV) and how long its speech lasts after the file starts."""
    pcm = speech(question)[:-SPEECH_RATE]  # speech() ends in 0.5 s of silence
    seconds = BEFORE_SEC + len(pcm) / 2 / SPEECH_RATE
    pcm = bytes(2 * int(SPEECH_RATE * BEFORE_SEC)) + pcm + bytes(2 * SPEECH_RATE * 10)
    path.write_bytes(wav_of(resample(pcm, SPEECH_RATE, MIC_RATE), MIC_RATE))
    return path, seconds


async def one_turn(url: str, question: str, release_ms: int, folder: Path) -> dict:
    wav, speech_sec = microphone(folder / "question.wav", question)
    errors: list[str] = []
    async with chromium(wav) as browser:
        page = await open_page(browser, url, errors)
        box = await page.locator("#talk").bounding_box()
        assert box is not None
        await page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        await page.mouse.down()  # opens the microphone: the file starts playing
        await page.wait_for_selector("body[data-state=listening]", timeout=30_000)
        await page.wait_for_timeout(speech_sec * 1000 + release_ms)
        await page.mouse.up()
        await page.wait_for_selector("#turns .turn[data-audio-started]", timeout=60_000)
        await page.wait_for_selector("#turns .turn[data-status]", timeout=60_000)
        seen = await turn_texts(page)
    if seen["latency"] is None or seen["error"] or errors:
        raise RuntimeError(f"the page's turn failed: {seen} {errors}")
    return {"question": question, "release_ms": release_ms, "end_to_first_sound_sec": int(seen["latency"]) / 1000,
            "heard": seen["you"], "answer": seen["assistant"]}


async def measure(url: str, rounds: int) -> dict:
    turns = []
    with tempfile.TemporaryDirectory() as tmp:
        await one_turn(url, QUESTIONS[0], RELEASES_MS[0], Path(tmp))  # warm-up
        for _ in range(rounds):
            for question in QUESTIONS:
                for release in RELEASES_MS:
                    turns.append(await one_turn(url, question, release, Path(tmp)))
    cases = {f"released ~{release} ms after the speech": summary(
        [t["end_to_first_sound_sec"] for t in turns if t["release_ms"] == release]) for release in RELEASES_MS}
    return {"rounds": rounds, "end_to_first_sound_sec": cases,
            "all": summary([t["end_to_first_sound_sec"] for t in turns]), "turns": turns}


def report(result: dict) -> str:
    rows = ["| case | n | P50 (s) | P95 (s) | P99 (s) |", "|---|---|---|---|---|"]
    rows += [f"| {case} | {s['n']} | {s['p50']} | {s['p95']} | {s['p99']} |"
             for case, s in {**result["end_to_first_sound_sec"], "all turns": result["all"]}.items()]
    return "\n".join(["# The voice page's own figure: end of speech (release) -> first sound", "", *rows, ""])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    env = GATEWAY_ENV | {"OMNI_GATEWAY_DEMO": "true"}
    with embedded_gateway_on_redis(env) as url:
        result = asyncio.run(measure(url, args.rounds))
    write_results(args.results, "voice_page", result, report(result))


if __name__ == "__main__":
    main()
