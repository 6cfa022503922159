"""Slow senders beside a keyed client: its append latency, quiet and under each load of them.

A gateway process (``bench.servers stamp``, API keys on, load shedding as
shipped) on a real Redis. A keyed client appends to its session back to
back; meanwhile ``N`` sockets each send the headers of a create or finish
and the first bytes of a body, then nothing: half without a key, half with
one. Before issue 29 each of them counted as a call in flight from its
first byte, and 64 made the session API answer 503 to everyone; now a
keyless one is refused from its headers, and a body counts only once it
has arrived (and has a deadline).

    python -m bench.slow_clients            # writes results/slow_clients.{json,md}
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.overhead import GATEWAY_ENV
from bench.procs import server, write_results
from bench.stats import summary
from tests.gateway.test_slow_clients import slow_socket
from tests.redis_server import free_port, redis_process

RESULTS = Path(__file__).parent / "results"
KEY = "sk-bench"
SESSIONS = "/v1/streaming_input/sessions"
SLOW_SOCKETS = (0, 64, 128, 256)


async def appends(http: aiohttp.ClientSession, base: str, sid: str, first: int, count: int) -> dict[str, Any]:
    latencies, refused = [], 0
    for seq in range(first, first + count):
        started = time.perf_counter()
        async with http.post(f"{base}{SESSIONS}/{sid}/chunks", json={"sequence_id": seq, "text": "w "},
                             headers={"Authorization": f"Bearer {KEY}"}) as response:
            await response.read()
            if response.status not in (200, 202):
                refused += 1
        latencies.append((time.perf_counter() - started) * 1000)
    return {"latency_ms": summary(latencies), "refused": refused}


async def load(port: int, per_level: int) -> list[dict[str, Any]]:
    base = f"http://127.0.0.1:{port}"
    runs = []
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base}{SESSIONS}", json={"start_policy": "on_end_only"},
                             headers={"Authorization": f"Bearer {KEY}"}) as response:
            sid = (await response.json())["session_id"]
        await appends(http, base, sid, 0, 100)  # warm up
        seq = 100
        for slow in SLOW_SOCKETS:
            writers = []
            for i in range(slow // 2):
                writers.append(await slow_socket(port, SESSIONS, None))
                writers.append(await slow_socket(port, f"{SESSIONS}/{sid}/finish" if i % 2 else SESSIONS, KEY))
            await asyncio.sleep(0.5)
            run = await appends(http, base, sid, seq, per_level)
            seq += per_level
            runs.append({"slow_sockets": slow, **run})
            for writer in writers:
                writer.close()
                with contextlib.suppress(ConnectionError):
                    await writer.wait_closed()
    return runs


def measure(per_level: int) -> dict[str, Any]:
    with redis_process() as redis, tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        env = GATEWAY_ENV | {"OMNI_GATEWAY_REDIS_URL": redis.url, "OMNI_GATEWAY_API_KEYS": KEY,
                             "OMNI_GATEWAY_BODY_TIMEOUT_SEC": "600"}
        with server(["bench.servers", "stamp", "--port", str(port)], port=port, env=env,
                    log=Path(tmp) / "gateway.log", ready_path="/readyz"):
            return {"appends_per_level": per_level, "runs": asyncio.run(load(port, per_level))}


def report(result: dict[str, Any]) -> str:
    lines = ["## Slow clients: a keyed client's appends beside sockets that send headers and a first "
             f"few bytes, then nothing (half keyless; {result['appends_per_level']} appends each)", "",
             "| slow sockets | P50 ms | P99 ms | P99 vs quiet | refused |", "|---:|---:|---:|---:|---:|"]
    quiet = result["runs"][0]["latency_ms"]["p99"]
    for run in result["runs"]:
        latency = run["latency_ms"]
        lines.append(f"| {run['slow_sockets']} | {latency['p50']:.2f} | {latency['p99']:.2f} | "
                     f"{latency['p99'] / quiet:.2f}x | {run['refused']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--appends", type=int, default=1000, help="appends measured per level")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    result = measure(args.appends)
    write_results(args.results, "slow_clients", result, report(result))


if __name__ == "__main__":
    main()
