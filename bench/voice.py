"""Voice to voice: from the last audio chunk's acknowledgement to the first sound of the answer.

What a voice product quotes. A real gateway process (embedded default: real
vLLM on the CPU, the pocketsphinx Listener, the hibari Talker) on a real
Redis; spoken questions made by hibari, sent as 200 ms pcm16 chunks at the
pace of speech, under ``on_first_chunk`` (heard and prefilled while spoken)
and ``on_end_only`` (buffered until the end, the non-streaming baseline),
interleaved so both see the same machine. Beside it, the real-time factors
of the recognizer and the Talker measured on the same audio.

    python -m bench.voice                 # writes results/voice.{json,md}
    python -m bench.voice --rounds 1      # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import httpx

from bench.overhead import GATEWAY_ENV
from bench.procs import embedded_gateway, write_results
from bench.stats import summary
from tests.redis_server import redis_process

RESULTS = Path(__file__).parent / "results"
QUESTIONS = (
    "What is the capital of France?",
    "How many days are there in a week?",
    "What color is the sky on a clear day?",
    "Name a large animal that lives in the sea.",
    "What do bees make?",
)
CHUNK_MS = 200
RATE = 24_000
SYSTEM = "You are a helpful assistant. Answer in one sentence."
POLICIES = ("on_first_chunk", "on_end_only")


async def one_turn(client: httpx.AsyncClient, audio: bytes, policy: str) -> dict:
    created = await client.post("/v1/streaming_input/sessions", json={
        "messages": [{"role": "system", "content": SYSTEM}], "modalities": ["text", "audio"],
        "temperature": 0, "max_tokens": 32, "start_policy": policy})
    created.raise_for_status()
    sid = created.json()["session_id"]
    first_sound = asyncio.get_running_loop().create_future()

    async def listen() -> None:
        async with client.stream("GET", f"/v1/streaming_input/sessions/{sid}/events") as events:
            async for line in events.aiter_lines():
                if line.startswith("data: ") and '"audio"' in line and not first_sound.done():
                    first_sound.set_result(time.perf_counter())
                if line == "data: [DONE]":
                    return

    listener = asyncio.create_task(listen())
    step = RATE * CHUNK_MS // 1000 * 2
    pieces = [audio[i:i + step] for i in range(0, len(audio), step)]
    acked = 0.0
    for seq, piece in enumerate(pieces):
        started = time.perf_counter()
        response = await client.post(f"/v1/streaming_input/sessions/{sid}/chunks", content=piece, headers={
            "Content-Type": "application/octet-stream", "X-Sequence-Id": str(seq), "X-Modality": "audio",
            "X-Sample-Rate": str(RATE), "X-End-Of-Input": "true" if seq == len(pieces) - 1 else "false"})
        response.raise_for_status()
        acked = time.perf_counter()
        if seq < len(pieces) - 1:  # the pace of speech
            await asyncio.sleep(max(0.0, CHUNK_MS / 1000 - (acked - started)))
    sound_at = await asyncio.wait_for(first_sound, 120)
    await asyncio.wait_for(listener, 120)
    result = (await client.get(f"/v1/streaming_input/sessions/{sid}/result", params={"wait": 30})).json()
    return {"policy": policy, "voice_to_voice_sec": sound_at - acked,
            "heard": result.get("input_transcript"),
            "answer": result["completion"]["choices"][0]["message"]["content"]}


def real_time_factors(audio: list[bytes]) -> dict:
    """Seconds of audio per second of CPU work, for the Listener and the Talker."""
    from omni_adapter.audio import resample
    from omni_adapter.listener import LISTEN_RATE, Recognizer, RecognizerPool
    from omni_adapter.talker import HibariTalker

    recognizer = Recognizer(RecognizerPool().take())
    seconds = sum(len(a) / 2 / RATE for a in audio)
    started = time.perf_counter()
    for clip in audio:
        recognizer.hear(resample(clip, RATE, LISTEN_RATE))
        recognizer.end_utterance()
    listen_sec = time.perf_counter() - started
    talker = HibariTalker.load()
    assert talker is not None
    started = time.perf_counter()
    spoken = [talker._synthesize(q) for q in QUESTIONS]
    talk_sec = time.perf_counter() - started
    return {"listener_rtf": round(seconds / listen_sec, 1),
            "talker_rtf": round(sum(len(s) / 2 / RATE for s in spoken) / talk_sec, 1)}


async def measure(url: str, rounds: int) -> dict:
    from tests.voice import speech

    audio = [speech(q) for q in QUESTIONS]
    turns: list[dict] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await one_turn(client, audio[0], "on_first_chunk")  # warm-up: first compile of each shape
        for _ in range(rounds):
            for clip in audio:
                for policy in POLICIES:
                    turns.append(await one_turn(client, clip, policy))
    by_policy = {p: summary([t["voice_to_voice_sec"] for t in turns if t["policy"] == p]) for p in POLICIES}
    streamed, buffered = by_policy["on_first_chunk"]["p50"], by_policy["on_end_only"]["p50"]
    return {"chunk_ms": CHUNK_MS, "rounds": rounds, "questions": list(QUESTIONS),
            "voice_to_voice_sec": by_policy, "p50_speedup": round(buffered / streamed, 2) if streamed else None,
            "goal_streamed_p50_under_1s": streamed < 1.0, "turns": turns, **real_time_factors(audio)}


def report(result: dict) -> str:
    rows = ["| policy | n | P50 (s) | P95 (s) | P99 (s) |", "|---|---|---|---|---|"]
    for policy, s in result["voice_to_voice_sec"].items():
        rows.append(f"| {policy} | {s['n']} | {s['p50']} | {s['p95']} | {s['p99']} |")
    return "\n".join([
        "# Voice to voice (last audio chunk acknowledged -> first audio of the answer)", "",
        *rows, "",
        f"Streamed vs buffered at P50: {result['p50_speedup']}x. Goal streamed P50 < 1 s: "
        f"{'met' if result['goal_streamed_p50_under_1s'] else 'missed'}.",
        f"Real-time factors: Listener {result['listener_rtf']}x, Talker {result['talker_rtf']}x "
        "(seconds of audio per second of work).", ""])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    with redis_process() as redis, tempfile.TemporaryDirectory() as tmp, \
            embedded_gateway(GATEWAY_ENV | {"OMNI_GATEWAY_REDIS_URL": redis.url}, Path(tmp)) as url:
        result = asyncio.run(measure(url, args.rounds))
    write_results(args.results, "voice", result, report(result))

if __name__ == "__main__":
    main()
