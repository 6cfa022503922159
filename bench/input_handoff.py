"""How fast newly contiguous input reaches the owner's engine session.

Issue #4 asks that a chunk appended on one replica reach the engine session
of the replica that owns the session within 50 ms (p99, loopback). This
script runs two real gateway replicas (uvicorn on loopback ports, in one
process so one clock serves both) on a real ``redis-server``: replica A owns
every session (its engine is the scripted one, which notes when each chunk is fed),
clients append every chunk on replica B over HTTP.

Measured per chunk, in one run:
- ``send_to_feed``: from the client starting the append on B to A's engine
  session receiving the chunk (includes B's HTTP handling and the Redis
  script, then A's XREAD wake-up and chunk load);
- ``ack_to_feed``: from the client reading B's 202 to the feed (negative
  when A had it before the client saw the acknowledgement).

Run: ``.venv/bin/python -m bench.input_handoff [--sessions 20 --chunks 50]``;
writes ``bench/results/input_handoff.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import time
from pathlib import Path

import httpx
import uvicorn

from bench.stats import summary
from gateway.runtime.app import create_app
from gateway.settings import Settings
from omni_adapter.scripted import Script, ScriptedEngine, text_capabilities
from tests.redis_server import free_port, redis_process

RESULTS = Path(__file__).parent / "results"
SESSIONS = "/v1/streaming_input/sessions"


def recording_engine() -> ScriptedEngine:
    """Notes when each chunk reaches the engine (``fed_at``); never answers (input only)."""
    return ScriptedEngine(Script(answer=lambda *_: [], hang=True),
                          capabilities=text_capabilities("recorder"))


def fed_at(engine: ScriptedEngine) -> dict[tuple[str, int], float]:
    """When each chunk reached the engine, by session id and sequence id."""
    return {(session.request.request_id.rsplit("-", 1)[0], chunk.sequence_id): at
            for session in engine.sessions for chunk, at in zip(session.fed, session.fed_at, strict=True)}


async def serve(app: object, port: int) -> uvicorn.Server:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    asyncio.get_running_loop().create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 - uvicorn offers no event for this
        await asyncio.sleep(0.05)
    return server


async def one_session(a: httpx.AsyncClient, b: httpx.AsyncClient, chunks: int,
                      sent_at: dict[tuple[str, int], tuple[float, float]]) -> None:
    created = await a.post(SESSIONS, json={"start_policy": "on_first_chunk"})
    sid = created.json()["session_id"]
    first = await a.post(f"{SESSIONS}/{sid}/chunks", json={"sequence_id": 0, "text": "start "})
    assert first.json()["started"], "replica A must own the session"
    for seq in range(1, chunks + 1):
        await asyncio.sleep(random.uniform(0.005, 0.05))  # a talker's pace, not a flood
        start = time.perf_counter()
        response = await b.post(f"{SESSIONS}/{sid}/chunks", json={"sequence_id": seq, "text": f"w{seq} "})
        assert response.status_code == 202, response.text
        sent_at[(sid, seq)] = (start, time.perf_counter())
    await a.delete(f"{SESSIONS}/{sid}")


async def measure(sessions: int, chunks: int) -> dict:
    with redis_process() as redis:
        limits_off = {"max_sessions_per_identity": 0, "rate_limit_rps": 0, "max_open_sessions": 0,
                      "shutdown_grace_sec": 0}
        engine = recording_engine()
        apps = [create_app(Settings(redis_url=redis.url, replica_id=name, **limits_off), engine=e)
                for name, e in (("replica-a", engine), ("replica-b", recording_engine()))]
        ports = [free_port(), free_port()]
        servers = [await serve(app, port) for app, port in zip(apps, ports, strict=True)]
        sent_at: dict[tuple[str, int], tuple[float, float]] = {}
        limits = httpx.Limits(max_connections=sessions * 2)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports[0]}", limits=limits) as a, \
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports[1]}", limits=limits) as b:
            await asyncio.gather(*(one_session(a, b, chunks, sent_at) for _ in range(sessions)))
        for server in servers:
            server.should_exit = True
        await asyncio.sleep(0.5)
    fed = fed_at(engine)
    send_to_feed = [(fed[key] - start) * 1000 for key, (start, _) in sent_at.items()]
    ack_to_feed = [(fed[key] - acked) * 1000 for key, (_, acked) in sent_at.items()]
    return {
        "sessions": sessions, "chunks_per_session": chunks, "samples": len(send_to_feed),
        "send_to_feed_ms": summary(send_to_feed, 2), "ack_to_feed_ms": summary(ack_to_feed, 2),
        "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()},
    }


def report(result: dict) -> str:
    s, a = result["send_to_feed_ms"], result["ack_to_feed_ms"]
    verdict = "met" if s["p99"] <= 50 else "missed"
    return f"""# Input hand-off latency (issue #4: p99 <= 50 ms on loopback)

Two gateway replicas on loopback sharing one real redis-server; every chunk is
appended on replica B and fed to the engine session owned by replica A.
{result['sessions']} concurrent sessions x {result['chunks_per_session']} chunks
({result['samples']} samples), {result['machine']['cpus']} CPUs, Python {result['machine']['python']}.

| from | p50 ms | p99 ms | max ms | mean ms |
|---|---|---|---|---|
| client sends the append to B -> A's engine session has it | {s['p50']} | {s['p99']} | {s['max']} | {s['mean']} |
| client reads B's 202 -> A's engine session has it | {a['p50']} | {a['p99']} | {a['max']} | {a['mean']} |

Target p99 <= 50 ms (send -> feed): **{verdict}**.
Run with `.venv/bin/python -m bench.input_handoff`.
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--chunks", type=int, default=50)
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args.sessions, args.chunks))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "input_handoff.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "input_handoff.md").write_text(report(result))
    print(report(result))


if __name__ == "__main__":
    main()
