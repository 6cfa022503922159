"""``python -m bench``: run the benchmarks of issue #5 and write their report.

    python -m bench               # everything: TTFT, the engine floor, overhead (~25 min here)
    python -m bench --quick       # a few queries and short levels: checks the plumbing (~4 min)
    python -m bench overhead      # one part; then ``python -m bench report`` rebuilds latest.*
    python -m bench relay         # only overhead's relay and memory parts (issue #17), to relay.json

Results go to ``bench/results/`` (or ``--results DIR``): one JSON per part,
then ``latest.json``, ``latest.md`` and ``ttft_ccdf.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import tempfile
from pathlib import Path

from bench import engine_floor, overhead, report, ttft
from bench.procs import server
from tests.redis_server import free_port, redis_process

RESULTS = Path(__file__).parent / "results"
QUICK_TTFT = ttft.TtftConfig(rates_per_sec=(0.5,), queries=3, pages_per_query=3, page_chars=300, max_tokens=2)
QUICK_OVERHEAD = overhead.OverheadConfig(concurrency=(1, 20), seconds_per_level=0.5, warmup_sec=0.25, relay_sessions=(1, 3),
                                         relay_tokens=10, relay_rates=(100,), relay_rate_sessions=3,
                                         relay_rate_seconds=0.2, idle_sessions=50, started_sessions=20,
                                         floor_samples=100, profile_at=0, api_workers=(1,),
                                         workers_concurrency=(20,), workers_relay_sessions=(3,),
                                         workers_relay_tokens=10, overload_sessions=20, handoff_sessions=3,
                                         memory_settle_sec=0.5)


def run_ttft(config: ttft.TtftConfig) -> dict:
    """The real gateway process (real vLLM) on a real Redis, for every TTFT run."""
    with redis_process() as redis, tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        env = overhead.GATEWAY_ENV | {"OMNI_GATEWAY_REDIS_URL": redis.url}
        with server(["gateway.runtime.cli", "serve", "--host", "127.0.0.1", "--port", str(port)], port=port, env=env,
                    log=Path(tmp) / "gateway.log", ready_path="/readyz"):
            return asyncio.run(ttft.measure(f"http://127.0.0.1:{port}", config))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", nargs="?", default="all", choices=["all", "ttft", "floor", "overhead", "relay", "report"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    ttft_config = QUICK_TTFT if args.quick else ttft.TtftConfig()
    overhead_config = QUICK_OVERHEAD if args.quick else overhead.OverheadConfig()
    args.results.mkdir(parents=True, exist_ok=True)

    def save(name: str, result: dict) -> None:
        (args.results / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")

    if args.part in ("all", "overhead"):
        save("overhead", asyncio.run(overhead.measure(overhead_config, args.results)))
    if args.part == "relay":
        relay_config = dataclasses.replace(overhead_config, concurrency=(), profile_at=0, api_workers=())
        save("relay", asyncio.run(overhead.measure(relay_config, args.results)))
    if args.part in ("all", "ttft"):
        save("ttft", run_ttft(ttft_config))
    if args.part in ("all", "floor"):
        save("floor", asyncio.run(engine_floor.measure(ttft_config, samples=2 if args.quick else 8)))
    if all((args.results / f"{name}.json").exists() for name in ("ttft", "floor", "overhead")):
        report.write(args.results)
        print((args.results / "latest.md").read_text())


if __name__ == "__main__":
    main()
