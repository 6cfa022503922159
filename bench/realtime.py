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
- ``turns`` (issue #27): one conversation of 50 text turns on the embedded
  default; the first text's latency at turn 1, 10 and 50, from sending the
  user's item and from ``response.create``; then the same history in a new
  conversation whose instructions differ (nothing of it in the prefix cache).
- ``users`` (issue #27): voice users on one key at 20 ms framing, each
  sending 50 appends a second and taking a turn every few seconds, against
  a gateway whose identity rate is set low enough to reach; the users that
  see no error against the number the limits allow.

    python -m bench.realtime                # answer and relay; writes results/realtime.{json,md}
    python -m bench.realtime turns          # one part (answer, relay, turns, users)
    python -m bench.realtime --rounds 1     # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
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


TURN_MARKS = (1, 10, 50)
INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence."


async def ask(ws: Any, text: str) -> dict[str, Any]:
    """One text turn: seconds from the item and from response.create to the first text; its usage."""
    sent = time.perf_counter()
    await ws.send(json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}))
    await recv(ws, "conversation.item.done")
    asked = time.perf_counter()
    await ws.send(json.dumps({"type": "response.create"}))
    await recv(ws, "response.output_text.delta")
    first = time.perf_counter()
    done = await recv(ws, "response.done")
    return {"from_item_sec": round(first - sent, 4), "from_response_sec": round(first - asked, 4),
            "input_tokens": done["response"]["usage"]["input_tokens"],
            "said": done["response"]["output"][0]["content"][0]["text"]}


async def conversation(url: str, turns: int) -> dict[str, Any]:
    """One conversation of ``turns`` turns, then the last turn's history without the prefix cache."""
    session = {"type": "realtime", "output_modalities": ["text"], "temperature": 0, "max_output_tokens": 16,
               "audio": {"input": {"turn_detection": None}}}
    history: list[tuple[str, str]] = []
    rows = []
    async with websockets.connect(url.replace("http", "ws") + "/v1/realtime", max_size=None) as ws:
        await recv(ws, "session.created")
        await ws.send(json.dumps({"type": "session.update", "session": {**session, "instructions": INSTRUCTIONS}}))
        await recv(ws, "session.updated")
        for n in range(1, turns + 1):
            question = f"Question {n}: name a fruit that is {('red', 'yellow', 'green')[n % 3]}."
            row = await ask(ws, question)
            rows.append({"turn": n, **row})
            history += [("user", question), ("assistant", row.pop("said"))]
    async with websockets.connect(url.replace("http", "ws") + "/v1/realtime", max_size=None) as ws:
        await recv(ws, "session.created")
        await ws.send(json.dumps({"type": "session.update", "session": {
            **session, "instructions": "Cold: " + INSTRUCTIONS}}))  # another first block: no cache hit
        await recv(ws, "session.updated")
        for role, text in history[:-2]:  # the history of the last turn, placed as items
            await ws.send(json.dumps({"type": "conversation.item.create", "previous_item_id": None, "item": {
                "type": "message", "role": role,
                "content": [{"type": "input_text" if role == "user" else "output_text", "text": text}]}}))
            await recv(ws, "conversation.item.done")
        cold = await ask(ws, history[-2][1])
        cold.pop("said")
    marks = {n: rows[n - 1] for n in TURN_MARKS if n <= turns}
    return {"turns": rows, "marks": marks, "cold_last_turn": cold}


async def voice_users(url: str, users: int, seconds: float, turn_every_sec: float) -> dict[str, Any]:
    """``users`` voice clients on one key for ``seconds``: 20 ms appends, a turn every ``turn_every_sec``."""
    frame = base64.b64encode(bytes(RATE * 2 // 50)).decode()

    async def one() -> dict[str, Any]:
        errors: dict[str, int] = {}
        closed = False
        try:
            async with websockets.connect(url.replace("http", "ws") + "/v1/realtime",
                                          additional_headers={"Authorization": "Bearer sk-bench"}) as ws:
                await ws.send(json.dumps({"type": "session.update", "session": {
                    "type": "realtime", "output_modalities": ["text"], "audio": {"input": {"turn_detection": None}}}}))

                async def read() -> None:
                    with contextlib.suppress(websockets.ConnectionClosed):
                        async for raw in ws:
                            event = json.loads(raw)
                            if event["type"] == "error":
                                errors[event["error"]["code"]] = errors.get(event["error"]["code"], 0) + 1

                reader = asyncio.create_task(read())
                start = next_turn = time.perf_counter()
                while (now := time.perf_counter()) - start < seconds:
                    await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": frame}))
                    if now - next_turn >= turn_every_sec:
                        next_turn = now
                        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
                        await ws.send(json.dumps({"type": "response.create"}))
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.5)
                reader.cancel()
        except websockets.ConnectionClosed:
            closed = True
        return {"errors": errors, "closed": closed}

    outcomes = await asyncio.gather(*(one() for _ in range(users)))
    clean = sum(not o["errors"] and not o["closed"] for o in outcomes)
    return {"users": users, "clean": clean, "errors": [o["errors"] for o in outcomes if o["errors"]],
            "closed": sum(o["closed"] for o in outcomes)}


async def users_on_one_key(redis_url: str, rate: float, seconds: float, turn_every_sec: float) -> dict[str, Any]:
    """Voice users against the identity rate ``rate`` (burst 2 s of it), in process, scripted engine."""
    from omni_adapter.port import Capabilities
    from omni_adapter.scripted import ScriptedEngine
    from tests.gateway.client import live_app, make_settings

    engine = ScriptedEngine(capabilities=Capabilities(
        input_modalities=frozenset({"text", "audio"}), output_modalities=frozenset({"text"}), incremental=True,
        model_names=("scripted",)), record=False)
    settings = make_settings(redis_url=redis_url, api_keys="sk-bench", rate_limit_rps=rate)
    allowed = int(rate * turn_every_sec)  # turns a second the key allows, times a turn's length
    rows = []
    async with live_app(settings, engine) as url:
        for users in sorted({1, max(1, allowed // 2), allowed - 1, allowed, allowed + 2, allowed * 2}):
            rows.append(await voice_users(url, users, seconds, turn_every_sec))
    return {"rate_limit_rps": rate, "turn_every_sec": turn_every_sec, "seconds": seconds, "allowed": allowed,
            "frames_per_sec": 50, "rows": rows}


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
    if "turns" in result:
        t = result["turns"]
        lines += ["## First text by turn number (one conversation, real engine)", "",
                  "| turn | input tokens | item -> first text (s) | response.create -> first text (s) |",
                  "|---|---|---|---|"]
        for n, row in t["marks"].items():
            lines.append(f"| {n} | {row['input_tokens']} | {row['from_item_sec']} | {row['from_response_sec']} |")
        c = t["cold_last_turn"]
        lines += [f"| last, no prefix cache | {c['input_tokens']} | {c['from_item_sec']} | {c['from_response_sec']} |",
                  ""]
    if "users" in result:
        u = result["users"]
        lines += [f"## Voice users on one key (20 ms frames, a turn every {u['turn_every_sec']} s, "
                  f"identity rate {u['rate_limit_rps']}/s: {u['allowed']} allowed)", "",
                  "| users | without an error | closed |", "|---|---|---|"]
        for row in u["rows"]:
            lines.append(f"| {row['users']} | {row['clean']} | {row['closed']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", nargs="?", choices=["answer", "relay", "turns", "users", "all"], default="all")
    parser.add_argument("--turns", type=int, default=50)
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
        if args.part == "turns":
            with embedded_gateway(env, Path(tmp)) as url:
                result["turns"] = asyncio.run(conversation(url, args.turns))
        if args.part == "users":
            result["users"] = asyncio.run(users_on_one_key(redis.url, rate=2.0, seconds=8.0, turn_every_sec=2.0))
    name = "realtime" if args.part in ("answer", "relay", "all") else f"realtime_{args.part}"
    write_results(args.results, name, result, report(result))


if __name__ == "__main__":
    main()
