"""What each ``redis_durability`` costs an append: appends/s and latency, one gateway, real Redis.

For each level, a gateway process (``bench.servers stamp``: the gateway as
served, with an engine that does no inference) on a Redis set up for it:

- ``everysec``: ``appendonly yes``, ``appendfsync everysec`` (the shipped default);
- ``always``: ``appendfsync always``: every write on disk before Redis answers;
- ``replica``: a primary, its replica and a Sentinel (``tests/redis_server.py``);
  each acknowledged script is followed by ``WAIT 1`` on its connection.

``--sessions`` clients each append to a session of their own as fast as
their answers come, for ``--seconds``, each level in turn, ``--rounds``
times; the latency is the client's (HTTP, the script, the fsync or the
replica's acknowledgement). What each level
survives is tests/gateway/test_durability.py's.

    python -m bench.durability              # writes results/durability.{json,md}
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import aiohttp

from bench.client import SessionClient
from bench.overhead import GATEWAY_ENV
from bench.procs import server, write_results
from bench.stats import summary
from tests.redis_server import free_port, redis_process, sentinel_group

RESULTS = Path(__file__).parent / "results"
LEVELS = ("everysec", "always", "replica")


@contextmanager
def redis_for(level: str) -> Iterator[dict[str, str]]:
    """A Redis set up for ``level``; the gateway's environment for it."""
    if level == "replica":
        with sentinel_group() as group:
            yield {"OMNI_GATEWAY_REDIS_URL": group.primary.url, "OMNI_GATEWAY_REDIS_DURABILITY": "replica",
                   "OMNI_GATEWAY_REDIS_SENTINELS": group.sentinels,
                   "OMNI_GATEWAY_REDIS_SENTINEL_MASTER": group.MASTER}
        return
    with redis_process(extra=("--appendonly", "yes", "--appendfsync", level)) as redis:
        yield {"OMNI_GATEWAY_REDIS_URL": redis.url, "OMNI_GATEWAY_REDIS_DURABILITY": level}


async def append_load(base: str, sessions: int, seconds: float) -> dict[str, Any]:
    latencies: list[float] = []
    async with aiohttp.ClientSession() as http:
        client = SessionClient(http, base)
        ids = [await client.create(start_policy="on_end_only") for _ in range(sessions)]
        deadline = time.monotonic() + seconds

        async def append(sid: str) -> None:
            seq = 0
            while time.monotonic() < deadline:
                started = time.perf_counter()
                await client.append(sid, seq, f"{seq} ")
                latencies.append(time.perf_counter() - started)
                seq += 1

        started = time.monotonic()
        await asyncio.gather(*(append(sid) for sid in ids))
        elapsed = time.monotonic() - started
    return {"appends": len(latencies), "appends_per_sec": round(len(latencies) / elapsed, 1),
            "latencies_ms": [x * 1000 for x in latencies]}


def measure(sessions: int, seconds: float, rounds: int) -> dict[str, Any]:
    """All three set up at once, loaded in turn, ``rounds`` times: the machine's noise then
    falls on every level alike (one level after the other measured the noise, not the level)."""
    with ExitStack() as stack:
        bases = {}
        for level in LEVELS:
            redis_env = stack.enter_context(redis_for(level))
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            port = free_port()
            env = GATEWAY_ENV | redis_env | {"OMNI_GATEWAY_MAX_IN_FLIGHT_REQUESTS": "0",
                                             "OMNI_GATEWAY_MAX_LOOP_LAG_SEC": "0"}
            stack.enter_context(server(["bench.servers", "stamp", "--port", str(port)], port=port, env=env,
                                       log=Path(tmp) / "gateway.log", ready_path="/readyz"))
            bases[level] = f"http://127.0.0.1:{port}"
        runs: dict[str, list[dict[str, Any]]] = {level: [] for level in LEVELS}
        for _ in range(rounds):
            for level in LEVELS:
                runs[level].append(asyncio.run(append_load(bases[level], sessions, seconds)))
    levels = {}
    for level, measured in runs.items():
        latencies = [x for run in measured for x in run.pop("latencies_ms")]
        levels[level] = {"appends_per_sec": round(statistics.median(r["appends_per_sec"] for r in measured), 1),
                         "rounds": measured, "latency_ms": summary(latencies)}
    return {"sessions": sessions, "seconds": seconds, "rounds": rounds, "levels": levels}


def report(result: dict[str, Any]) -> str:
    lines = [f"## Durability: appends at each `redis_durability` ({result['sessions']} sessions appending "
             f"back to back; {result['rounds']} rounds of {result['seconds']:g} s per level, levels in turn)", "",
             "| level | appends/s (median round) | P50 ms | P99 ms | vs everysec |", "|---|---:|---:|---:|---:|"]
    base = result["levels"]["everysec"]["appends_per_sec"]
    for level, run in result["levels"].items():
        latency = run["latency_ms"]
        lines.append(f"| {level} | {run['appends_per_sec']:.0f} | {latency['p50']:.2f} | {latency['p99']:.2f} | "
                     f"{run['appends_per_sec'] / base:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    result = measure(args.sessions, args.seconds, args.rounds)
    write_results(args.results, "durability", result, report(result))


if __name__ == "__main__":
    main()
