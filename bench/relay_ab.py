"""The relay at 200 sessions x 100 tokens/s beside its floor, and against another commit, in one run.

Issue #31's relay goals are ratios measured in one run: the gateway's settled
P99 against the floor's (``bare-relay``: the same stamped tokens through
nothing but uvicorn), and its CPU per token against a base commit's. A
second floor, ``redis-relay``, adds what the gateway's contract alone costs:
each token written to Redis and read back before a client sees it. This
runs the servers in turn, ``rounds`` times, with the same client and
the same Redis: the floor, the gateway of this tree, and the gateway of
``--base`` (its files exported to a temporary folder and run from there,
with this virtualenv). Each gateway runs on the stamping engine
(``bench/servers.py``), admission off, as in ``bench/overhead.py``: one
process, or with ``--workers 0,1`` also as ``omni-gateway serve`` runs on 2
cores (an API worker serving the streams, the runners in the engine process).

    python -m bench.relay_ab --base main           # writes results/relay_ab.{json,md}
    python -m bench.relay_ab --base HEAD~3 --rounds 3 --sessions 200 --rate 100
    python -m bench.relay_ab --workers 0,1     # one process, and serve's default shape
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import subprocess
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

from bench.overhead import GATEWAY_ENV, NO_SHEDDING, PY_SPY, relay_lags, relay_with_calls
from bench.procs import server
from tests.redis_server import free_port, redis_process

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).parent.parent


def export(commit: str, into: Path) -> Path:
    """The tree of ``commit``, as files in ``into``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


async def profiled(pid: int, seconds: float, into: Path) -> asyncio.subprocess.Process:
    """py-spy on the gateway while it relays (folded stacks: ``into``)."""
    return await asyncio.create_subprocess_exec(
        str(PY_SPY), "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))), "--format", "raw",
        "--output", str(into), "--nonblocking", "--rate", "250",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)


def top_functions(folded: Path, count: int = 25) -> list[tuple[str, float]]:
    """The functions most samples were in (self time), in % of the samples."""
    by_function: dict[str, int] = {}
    for line in folded.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        leaf = stack.rsplit(";", 1)[-1]
        by_function[leaf] = by_function.get(leaf, 0) + int(samples)
    total = sum(by_function.values()) or 1
    return [(name, round(100 * n / total, 1)) for name, n in sorted(by_function.items(), key=lambda kv: -kv[1])[:count]]


async def run(base: str | None, rounds: int, sessions: int, rate: int, seconds: float,
              profile_to: Path | None = None, shapes: tuple[int, ...] = (0,)) -> list[dict]:
    tokens = round(rate * seconds)
    interval = ["--token-interval", str(1 / rate)]
    rows = []
    with redis_process() as redis, tempfile.TemporaryDirectory() as tmp:
        trees = {"this tree": ROOT}
        if base is not None:
            trees[f"base {base}"] = export(base, Path(tmp) / "base")
        env = GATEWAY_ENV | NO_SHEDDING | {"OMNI_GATEWAY_REDIS_URL": redis.url}
        for round_ in range(rounds):
            port = free_port()
            with server(["bench.servers", "bare-relay", "--port", str(port), *interval], port=port, env={},
                        log=Path(tmp) / f"floor-{round_}.log", ready_path="/") as proc:
                result = await relay_lags(f"http://127.0.0.1:{port}", proc.pid, sessions, tokens)
            rows.append({"server": "floor", "round": round_, **result})
            print(json.dumps(rows[-1]), flush=True)
            port = free_port()
            with server(["bench.servers", "redis-relay", "--port", str(port), "--redis-url", redis.url, *interval],
                        port=port, env={}, log=Path(tmp) / f"redis-floor-{round_}.log", ready_path="/") as proc:
                result = await relay_with_calls(f"http://127.0.0.1:{port}", redis.url, proc.pid, sessions, tokens)
            rows.append({"server": "floor through Redis", "round": round_, **result})
            print(json.dumps(rows[-1]), flush=True)
            for (tree_name, tree), workers in itertools.product(trees.items(), shapes):
                name = tree_name if workers == 0 else f"{tree_name}, {workers} API worker{'s' * (workers > 1)}"
                shape = ["--workers", str(workers), "--engine-port", str(free_port())] if workers else []
                port = free_port()
                with server(["bench.servers", "stamp", "--port", str(port), *interval, *shape], port=port, env=env,
                            log=Path(tmp) / f"{name.replace(' ', '-')}-{round_}.log", ready_path="/readyz",
                            cwd=tree) as proc:
                    profiler = None
                    if profile_to is not None and round_ == 0 and PY_SPY.exists():
                        profiler = await profiled(proc.pid, seconds, profile_to / f"{name.replace(' ', '-')}.raw")
                    result = await relay_with_calls(f"http://127.0.0.1:{port}", redis.url, proc.pid, sessions,
                                                    tokens)
                    if profiler is not None:
                        await asyncio.wait_for(profiler.wait(), 60)
                rows.append({"server": name, "round": round_, **result})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| round | server | settled P50 ms | settled P99 ms | P99 / floor's | P99 / floor through Redis | "
             "CPU ms per token | Redis commands per token |", "|---" * 8 + "|"]

    def ratio(row: dict, floor_name: str) -> float | None:
        floor = next((r for r in rows if r["round"] == row["round"] and r["server"] == floor_name), None)
        p99, floor_p99 = (row["settled"] or {}).get("p99"), ((floor or {}).get("settled") or {}).get("p99")
        return round(p99 / floor_p99, 1) if p99 and floor_p99 else None

    for row in rows:
        settled = row["settled"] or {}
        commands = sum(row.get("commands_per_token", {}).values()) or None
        lines.append(f"| {row['round']} | {row['server']} | {settled.get('p50')} | {settled.get('p99')} "
                     f"| {ratio(row, 'floor')} | {ratio(row, 'floor through Redis')} "
                     f"| {row['gateway_cpu_ms_per_token']} | {round(commands, 2) if commands else '-'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=None, help="a commit to compare with (default: none)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--rate", type=int, default=100, help="tokens/s of each session")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long each session streams")
    parser.add_argument("--profile", type=Path, default=None,
                        help="a folder for py-spy's folded stacks of each gateway's first round")
    parser.add_argument("--workers", default="0",
                        help="the replica's shapes, comma-separated API worker counts: 0 is one process doing "
                             "everything; 1 is `omni-gateway serve`'s default on 2 cores (an API worker serving "
                             "the streams, the runners in the engine process)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    shapes = tuple(int(n) for n in args.workers.split(","))
    rows = asyncio.run(run(args.base, args.rounds, args.sessions, args.rate, args.seconds, args.profile, shapes))
    for raw in sorted(args.profile.glob("*.raw")) if args.profile is not None else []:
        print(raw.name, *top_functions(raw), sep="\n  ")
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "relay_ab.json").write_text(json.dumps(rows, indent=2) + "\n")
    (args.results / "relay_ab.md").write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
