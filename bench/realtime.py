"""OpenAI Realtime: what early prefill buys at commit, and what the WebSocket relay costs.

Two parts, each against real gateway processes on a real Redis:

- ``answer``: the embedded default (vLLM on the CPU, the Listener, the
  Talker). Spoken questions (hibari, 24 kHz) go over ``/v1/realtime`` as
  200 ms ``input_audio_buffer.append`` events. *Streamed*: appended at the
  pace of speech, then ``commit`` + ``response.create``. *Buffered*: the
  client waits as long as the speech lasts, then appends it all at once
  before the commit (what a server without early prefill amounts to).
  Measured from sending the commit to the first ``response.output_audio_transcript.delta``
  (text) and the first ``response.output_audio.delta`` (sound).
- ``relay``: the stamping engine of ``bench.servers`` (no inference, a token
  every 10 ms carrying the time it was emitted): engine -> Redis -> client,
  over the WebSocket and over SSE, from the same server in the same run.

    python -m bench.realtime                # both; writes results/realtime.{json,md}
    python -m bench.realtime --rounds 1     # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import websockets

from bench.overhead import GATEWAY_ENV, relay
from bench.procs import embedded_gateway, server, write_results
from bench.stats import summary
from bench.voice import QUESTIONS
from tests.redis_server import free_port, redis_process

RESULTS = Path(__file__).parent / "results"
RATE = 24_000
CHUNK_MS = 200
MODES = ("streamed", "buffered")


async def recv(ws: Any, until: str) -> dict[str, Any]:
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), 120))
        if event["type"] == "error":
            raise RuntimeError(event["error"])
        if event["type"] == until:
            return event


async def one_turn(url: str, audio: bytes, mode: str) -> dict[str, Any]:
    async with websockets.connect(url.replace("http", "ws") + "/v1/realtime", max_size=None) as ws:
        await recv(ws, "session.created")
        await ws.send(json.dumps({"type": "session.update", "session": {
            "type": "realtime", "instructions": "You are a helpful assistant. Answer in one sentence.",
            "temperature": 0, "max_output_tokens": 32, "audio": {"input": {"turn_detection": None}}}}))
        await recv(ws, "session.updated")
        step = RATE * CHUNK_MS // 1000 * 2
        pieces = [audio[i:i + step] for i in range(0, len(audio), step)]
        if mode == "buffered":
            await asyncio.sleep(len(audio) / 2 / RATE)  # the user speaks; nothing is sent yet
        for piece in pieces:
            started = time.perf_counter()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(piece).decode()}))
            if mode == "streamed":
                await asyncio.sleep(max(0.0, CHUNK_MS / 1000 - (time.perf_counter() - started)))
        committed = time.perf_counter()
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await ws.send(json.dumps({"type": "response.create"}))
        await recv(ws, "response.output_audio_transcript.delta")
        text_at = time.perf_counter()
        await recv(ws, "response.output_audio.delta")
        sound_at = time.perf_counter()
        done = await recv(ws, "response.done")
    return {"mode": mode, "to_text_sec": text_at - committed, "to_sound_sec": sound_at - committed,
            "answer": done["response"]["output"][0]["content"][0].get("transcript")}


async def answers(url: str, rounds: int) -> dict[str, Any]:
    from tests.voice import speech

    audio = [speech(q) for q in QUESTIONS]
    await one_turn(url, audio[0], "streamed")  # warm-up
    turns = [await one_turn(url, clip, mode) for _ in range(rounds) for clip in audio for mode in MODES]
    out: dict[str, Any] = {"turns": turns}
    for what in ("to_text_sec", "to_sound_sec"):
        out[what] = {m: summary([t[what] for t in turns if t["mode"] == m]) for m in MODES}
    return out


async def ws_relay(url: str, sessions: int, tokens: int) -> list[float]:
    """Engine stamp -> WebSocket client read, in ms, for every token of ``sessions`` at once."""
    async def one() -> list[float]:
        lags: list[float] = []
        async with websockets.connect(url.replace("http", "ws") + "/v1/realtime") as ws:
            await ws.send(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "output_modalities": ["text"], "max_output_tokens": tokens,
                "audio": {"input": {"turn_detection": None}}}}))
            await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]}}))
            await ws.send(json.dumps({"type": "response.create"}))
            while True:
                event = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if event["type"] == "response.output_text.delta":
                    now = time.time_ns()
                    lags.extend((now - int(stamp)) / 1e6 for stamp in event["delta"].split())
                elif event["type"] in ("response.done", "error"):
                    return lags
    return [lag for lags in await asyncio.gather(*(one() for _ in range(sessions))) for lag in lags]


async def relays(url: str, tokens: int = 100) -> list[dict[str, Any]]:
    rows = []
    for sessions in (1, 20):
        rows.append({"sessions": sessions, "websocket_ms": summary(await ws_relay(url, sessions, tokens)),
                     "sse_ms": summary(await relay(url, sessions, tokens))})
    return rows


def report(result: dict[str, Any]) -> str:
    lines = ["# OpenAI Realtime", ""]
    if "answer" in result:
        a = result["answer"]
        lines += ["## Commit -> first answer (real engine, spoken questions)", "",
                  "| input | n | text P50 (s) | text P99 (s) | sound P50 (s) | sound P99 (s) |",
                  "|---|---|---|---|---|---|"]
        for mode in MODES:
            t, s = a["to_text_sec"][mode], a["to_sound_sec"][mode]
            lines.append(f"| {mode} | {t['n']} | {t['p50']} | {t['p99']} | {s['p50']} | {s['p99']} |")
        lines.append("")
    if "relay" in result:
        lines += ["## Relay: engine token -> client (stamping engine)", "",
                  "| sessions | WebSocket P50 (ms) | P99 | SSE P50 (ms) | P99 |", "|---|---|---|---|---|"]
        for row in result["relay"]:
            w, s = row["websocket_ms"], row["sse_ms"]
            lines.append(f"| {row['sessions']} | {w['p50']} | {w['p99']} | {s['p50']} | {s['p99']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", nargs="?", choices=["answer", "relay", "all"], default="all")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"chunk_ms": CHUNK_MS, "rounds": args.rounds, "questions": list(QUESTIONS)}
    with redis_process() as redis, tempfile.TemporaryDirectory() as tmp:
        env = GATEWAY_ENV | {"OMNI_GATEWAY_REDIS_URL": redis.url}
        if args.part in ("relay", "all"):
            port = free_port()
            with server(["bench.servers", "stamp", "--port", str(port)], port=port, env=env,
                        log=Path(tmp) / "stamp.log", ready_path="/readyz"):
                result["relay"] = asyncio.run(relays(f"http://127.0.0.1:{port}"))
        if args.part in ("answer", "all"):
            with embedded_gateway(env, Path(tmp)) as url:
                result["answer"] = asyncio.run(answers(url, args.rounds))
    write_results(args.results, "realtime", result, report(result))


if __name__ == "__main__":
    main()
