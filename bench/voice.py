"""Voice: from the end of the spoken input to the first sound of the answer, and what hearing costs.

A real gateway process on its embedded default (real vLLM on the CPU, the
Listener: Silero VAD + Moonshine, the Talker: hibari) on a real Redis, one
process, load shedding as shipped. Spoken questions made by hibari are sent
as 200 ms pcm16 chunks at the pace of speech, ending 200 ms or 500 ms after
the speech (a push-to-talk release; OpenAI's server_vad ends a turn after
500 ms of silence); the clock runs from the acknowledgement of the last
chunk (``end_of_input``) to the first ``delta.audio`` frame. Measured:

- with 1 voice and with 4 at once (200 ms release), for a short and a long
  first sentence of the answer (the Talker speaks from the first phrase, so
  a long sentence should not cost more);
- beside the 4 voices, 20 text sessions appending every 200 ms: the appends
  refused (503 overloaded or any other non-2xx) and the gateway's own
  event-loop lag (the gauge its load shedding reads, polled every 50 ms);
- the word error rate of the Listener on 24 clips (tests/wer.py);
- each native call of the voice path run in a thread beside a 5 ms timer on
  an event loop: how late the timer gets (a call that holds the GIL stalls it).

    python -m bench.voice                 # writes results/voice.{json,md}
    python -m bench.voice --rounds 1      # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

from bench.overhead import GATEWAY_ENV
from bench.procs import embedded_gateway_on_redis, write_results
from bench.stats import summary

RESULTS = Path(__file__).parent / "results"
QUESTIONS = (
    "What is the capital of France?",
    "How many days are there in a week?",
    "What color is the sky on a clear day?",
    "Name a large animal that lives in the sea.",
    "What do bees make?",
)
#: The system prompts that make the answer's first sentence short or long.
FIRST_SENTENCE = {
    "short": "You are a helpful assistant. Answer in one short sentence.",
    "long": "You are a helpful assistant. Answer in one long sentence of at least thirty words.",
}
CHUNK_MS = 200
RATE = 24_000
#: Silence sent after the speech before the end of input: a push-to-talk release; server_vad's wait.
RELEASES_MS = (200, 500)
TEXTERS = 20
GOAL_P50_SEC, GOAL_P99_SEC = 0.8, 1.5


def spoken(question: str, release_ms: int) -> bytes:
    from tests.voice import speech

    pcm = speech(question)[:-RATE]  # speech() ends in 0.5 s of silence
    return pcm + bytes(2 * RATE * release_ms // 1000)


class Refusals:
    def __init__(self) -> None:
        self.appends = 0
        self.refused: list[str] = []
        #: New sessions refused (load shedding may refuse new work; issue 33 asks only for appends).
        self.creates_refused: list[str] = []

    async def create(self, client: httpx.AsyncClient, body: dict) -> str | None:
        response = await client.post("/v1/streaming_input/sessions", json=body)
        if response.status_code != 201:
            self.creates_refused.append(f"{response.status_code} {response.text[:120]}")
            return None
        return str(response.json()["session_id"])

    async def append(self, client: httpx.AsyncClient, sid: str, **request: object) -> httpx.Response:
        response = await client.post(f"/v1/streaming_input/sessions/{sid}/chunks", **request)  # type: ignore[arg-type]
        self.appends += 1
        if response.status_code not in (200, 202):
            self.refused.append(f"{response.status_code} {response.text[:120]}")
        return response


async def spoken_turn(client: httpx.AsyncClient, audio: bytes, first: str, refusals: Refusals,
                      clock: Callable[[], float] = time.perf_counter) -> tuple[str, float, float] | None:
    """One spoken question at the pace of speech: its session, when the end of input was
    acknowledged and when the first audio frame was read (on ``clock``); ``None`` if refused."""
    sid = await refusals.create(client, {
        "messages": [{"role": "system", "content": FIRST_SENTENCE[first]}], "modalities": ["text", "audio"],
        "max_tokens": 48 if first == "long" else 24})
    if sid is None:
        return None
    first_sound = asyncio.get_running_loop().create_future()

    async def listen() -> None:
        async with client.stream("GET", f"/v1/streaming_input/sessions/{sid}/events") as events:
            async for line in events.aiter_lines():
                if line.startswith("data: ") and '"audio"' in line and not first_sound.done():
                    first_sound.set_result(clock())
                if line == "data: [DONE]":
                    return

    listener = asyncio.create_task(listen())
    step = RATE * CHUNK_MS // 1000 * 2
    pieces = [audio[i:i + step] for i in range(0, len(audio), step)]
    acked = 0.0
    for seq, piece in enumerate(pieces):
        started = clock()
        await refusals.append(client, sid, content=piece, headers={
            "Content-Type": "application/octet-stream", "X-Sequence-Id": str(seq), "X-Modality": "audio",
            "X-Sample-Rate": str(RATE), "X-End-Of-Input": "true" if seq == len(pieces) - 1 else "false"})
        acked = clock()
        if seq < len(pieces) - 1:  # the pace of speech
            await asyncio.sleep(max(0.0, CHUNK_MS / 1000 - (acked - started)))
    sound_at = await asyncio.wait_for(first_sound, 120)
    await asyncio.wait_for(listener, 120)
    return sid, acked, sound_at


async def one_turn(client: httpx.AsyncClient, audio: bytes, first: str, refusals: Refusals) -> dict | None:
    turn = await spoken_turn(client, audio, first, refusals)
    if turn is None:
        return None
    sid, acked, sound_at = turn
    result = (await client.get(f"/v1/streaming_input/sessions/{sid}/result", params={"wait": 30})).json()
    return {"first_sentence": first, "end_to_first_audio_sec": sound_at - acked,
            "heard": result.get("input_transcript"),
            "answer": result["completion"]["choices"][0]["message"]["content"]}


async def texter(client: httpx.AsyncClient, n: int, refusals: Refusals) -> None:
    sid = await refusals.create(client, {"max_tokens": 8})
    if sid is None:
        return
    words = f"Please count from {n} to {n + 3} in words, separated by commas.".split()
    for seq, word in enumerate(words):
        await refusals.append(client, sid, json={"sequence_id": seq, "text": word + " ",
                                                 "end_of_input": seq == len(words) - 1})
        await asyncio.sleep(CHUNK_MS / 1000)
    await client.get(f"/v1/streaming_input/sessions/{sid}/result", params={"wait": 60})


async def watch_loop_lag(client: httpx.AsyncClient, samples: list[float], stop: asyncio.Event) -> None:
    """The gateway's own loop-lag gauge, every 50 ms."""
    pattern = re.compile(r"^omni_gateway_event_loop_lag_seconds (\S+)$", re.MULTILINE)
    while not stop.is_set():
        found = pattern.search((await client.get("/metrics")).text)
        if found:
            samples.append(float(found.group(1)))
        await asyncio.sleep(0.05)


async def measure(url: str, rounds: int) -> dict:
    audio = {(q, r): spoken(q, r) for q in QUESTIONS for r in RELEASES_MS}
    turns: list[dict] = []
    refusals = Refusals()
    lag: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        # Warm-up: the first compile of each shape.
        await one_turn(client, audio[(QUESTIONS[0], RELEASES_MS[0])], "short", Refusals())
        for _ in range(rounds):
            for question in QUESTIONS:
                for first in FIRST_SENTENCE:
                    for release in RELEASES_MS:
                        turn = await one_turn(client, audio[(question, release)], first, Refusals())
                        assert turn is not None, "one voice alone was refused"
                        turns.append({"voices": 1, "release_ms": release, **turn})
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch_loop_lag(client, lag, stop))
        for _ in range(rounds):
            for first in FIRST_SENTENCE:
                together = await asyncio.gather(
                    *(one_turn(client, audio[(q, RELEASES_MS[0])], first, refusals) for q in QUESTIONS[:4]),
                    *(texter(client, n, refusals) for n in range(TEXTERS)))
                turns += [{"voices": 4, "release_ms": RELEASES_MS[0], **t} for t in together[:4] if t]
        stop.set()
        await watcher
    cases = [(1, first, release) for first in FIRST_SENTENCE for release in RELEASES_MS]
    cases += [(4, first, RELEASES_MS[0]) for first in FIRST_SENTENCE]
    latency = {f"{voices} voice{'s' if voices > 1 else ''}, {first} first sentence, {release} ms release": summary(
        [t["end_to_first_audio_sec"] for t in turns
         if (t["voices"], t["first_sentence"], t["release_ms"]) == (voices, first, release)])
        for voices, first, release in cases}
    one_voice = summary([t["end_to_first_audio_sec"] for t in turns if t["voices"] == 1])
    return {"chunk_ms": CHUNK_MS, "releases_ms": list(RELEASES_MS), "rounds": rounds, "questions": list(QUESTIONS),
            "end_to_first_audio_sec": latency, "one_voice": one_voice,
            "goal_met": one_voice["p50"] <= GOAL_P50_SEC and one_voice["p99"] <= GOAL_P99_SEC,
            "beside_4_voices": {"text_sessions": TEXTERS, "appends": refusals.appends,
                                "refused_appends": len(refusals.refused), "refusals": refusals.refused[:10],
                                "refused_creates": len(refusals.creates_refused),
                                "create_refusals": refusals.creates_refused[:10],
                                "loop_lag_sec": summary(lag)},
            "turns": turns}


def word_error_rates() -> dict:
    from tests.wer import make_clips
    from tests.wer import measure as measure_wer

    tallies, misses = asyncio.run(measure_wer(make_clips()))
    return {"wer": {f"{condition}, {feed}": {"errors": t.errors, "words": t.words, "rate": round(t.rate, 4)}
                    for (condition, feed), t in sorted(tallies.items())},
            "misses": misses}


def native_calls() -> dict:
    """Each native call of the voice path in a thread, beside a 5 ms timer on the loop."""
    from omni_adapter.audio import StreamResampler, resample
    from omni_adapter.listener import PocketsphinxRecognizer
    from tests.voice import _talker, hearing, speech

    pcm = speech("Please tell me a short story about a dog and then explain why the sky is blue.")
    phrase = np.frombuffer(resample(pcm, RATE, 16_000), dtype="<i2")
    ears, talker, resampler = hearing(), _talker(), StreamResampler(16_000)
    vad = ears.vad.stream()
    sphinx = PocketsphinxRecognizer()
    from pocketsphinx import Decoder

    in_process = Decoder(samprate=16_000, loglevel="FATAL")

    def decode_here() -> None:
        in_process.start_utt()
        in_process.process_raw(phrase.tobytes(), False, True)
        in_process.end_utt()

    seconds = len(phrase) / 16_000
    calls = {
        f"Moonshine, a {seconds:.1f} s phrase": lambda: ears.recognizer.transcribe(phrase),
        f"Silero VAD, {seconds:.1f} s of audio": lambda: vad.push(phrase),
        f"soxr stream, {seconds:.1f} s 24 -> 16 kHz": lambda: resampler.push(pcm, RATE),
        "hibari, one sentence": lambda: talker._synthesize("The capital of France is Paris, a city on the Seine."),
        f"pocketsphinx in its worker process, {seconds:.1f} s": lambda: sphinx.transcribe(phrase),
        f"pocketsphinx in this process (how it ran before), {seconds:.1f} s": decode_here,
    }
    try:
        return {name: asyncio.run(_probe(call)) for name, call in calls.items()}
    finally:
        sphinx.close()


async def _probe(call: object, reps: int = 3) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    lateness: list[float] = []
    running = True

    async def tick() -> None:
        while running:
            started = time.perf_counter()
            await asyncio.sleep(0.005)
            lateness.append(time.perf_counter() - started - 0.005)

    ticker = asyncio.create_task(tick())
    started = time.perf_counter()
    with ThreadPoolExecutor(1) as thread:
        for _ in range(reps):
            await asyncio.get_running_loop().run_in_executor(thread, call)  # type: ignore[arg-type]
    call_sec = (time.perf_counter() - started) / reps
    running = False
    await ticker
    return {"call_ms": round(call_sec * 1000, 1), "loop_lag_p99_ms": round(float(np.percentile(lateness, 99)) * 1000, 1),
            "loop_lag_max_ms": round(max(lateness) * 1000, 1)}


def report(result: dict) -> str:
    rows = ["| case | n | P50 (s) | P95 (s) | P99 (s) |", "|---|---|---|---|---|"]
    for case, s in result["end_to_first_audio_sec"].items():
        rows.append(f"| {case} | {s['n']} | {s['p50']} | {s['p95']} | {s['p99']} |")
    beside = result["beside_4_voices"]
    lag = beside["loop_lag_sec"]
    wer = ["| feed | WER | errors / words |", "|---|---|---|"]
    wer += [f"| {name} | {w['rate']:.1%} | {w['errors']} / {w['words']} |" for name, w in result["wer"].items()]
    native = ["| call (in a thread) | call (ms) | loop lag P99 (ms) | max (ms) |", "|---|---|---|---|"]
    native += [f"| {name} | {p['call_ms']} | {p['loop_lag_p99_ms']} | {p['loop_lag_max_ms']} |"
               for name, p in result["native_calls"].items()]
    one = result["one_voice"]
    return "\n".join([
        "# Voice: end of input -> first audio of the answer", "",
        *rows, "",
        f"One voice, all turns: P50 {one['p50']} s, P99 {one['p99']} s; goal P50 <= {GOAL_P50_SEC} s and "
        f"P99 <= {GOAL_P99_SEC} s: {'met' if result['goal_met'] else 'missed'}.", "",
        f"Beside the 4 voices, {beside['text_sessions']} text sessions appending: {beside['refused_appends']} of "
        f"{beside['appends']} appends refused ({beside['refused_creates']} new sessions refused); the gateway's loop lag P50 {lag['p50'] * 1000:.0f} ms, "
        f"P99 {lag['p99'] * 1000:.0f} ms, max {lag['max'] * 1000:.0f} ms ({lag['n']} samples).", "",
        "## Word error rate (24 clips, tests/wer.py)", "", *wer, "",
        "## Native calls beside the event loop", "", *native, ""])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    result = {**word_error_rates(), "native_calls": native_calls()}
    with embedded_gateway_on_redis(GATEWAY_ENV) as url:
        result |= asyncio.run(measure(url, args.rounds))
    write_results(args.results, "voice", result, report(result))


if __name__ == "__main__":
    main()
