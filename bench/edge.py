"""What the NGINX edge costs: relay and append latency through it against direct, same run.

The stamping gateway of ``bench.servers`` (real Redis, real HTTP stack, the
scripted engine: no inference) alone, and behind NGINX rendered from the
production Ingress by ``deploy/edge_nginx.py``. Relay: engine token -> SSE
client; append: one paced chunk per session every 0.25 s.

    python -m bench.edge          # writes results/edge.{json,md}
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from bench.client import SessionClient, http_session
from bench.overhead import GATEWAY_ENV, OverheadConfig, drive, relay
from bench.procs import server, write_results
from bench.stats import summary
from tests.gateway.test_edge import nginx
from tests.redis_server import free_port, redis_process

RESULTS = Path(__file__).parent / "results"


async def measure(direct: str, edge: str, pid: int, config: OverheadConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"relay": [], "append": []}
    for sessions in config.relay_sessions:
        for path, url in (("direct", direct), ("edge", edge)):
            out["relay"].append({"path": path, "sessions": sessions,
                                 **summary(await relay(url, sessions, config.relay_tokens))})
    # Paced only: the edge limits each client address to 50 requests/s (limit-rps), so
    # 10 sessions at 4 appends/s stay under it; flat-out load is the gateway's (bench.overhead).
    for concurrency in (1, 10):
        for path, url in (("direct", direct), ("edge", edge)):
            async with http_session(concurrency) as http:
                client = SessionClient(http, url)
                sessions = [await client.create(start_policy="on_end_only") for _ in range(concurrency)]
                paced = await drive(client, dict.fromkeys(sessions, 0), config, config.pace_sec, pid, None)
                await asyncio.gather(*(client.delete(sid) for sid in sessions))
            out["append"].append({"path": path, "concurrency": concurrency, "p50_ms": paced["p50_ms"],
                                  "p99_ms": paced["p99_ms"], "refused": paced["refused"]})
    return out


def report(result: dict[str, Any]) -> str:
    lines = ["# The NGINX edge against direct (stamping gateway, same run)", "",
             "| relay | sessions | P50 (ms) | P99 (ms) |", "|---|---|---|---|"]
    lines += [f"| {r['path']} | {r['sessions']} | {r['p50']} | {r['p99']} |" for r in result["relay"]]
    lines += ["", "| append | sessions | P50 (ms) | P99 (ms) |", "|---|---|---|---|"]
    lines += [f"| {r['path']} | {r['concurrency']} | {r['p50_ms']} | {r['p99_ms']} |" for r in result["append"]]
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="per append level")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    # 1 and 20 sessions: the edge limits each client address (limit-rps 50, a burst of 5x), and
    # 200 sessions opened at once from this one address are refused there, as they should be.
    config = dataclasses.replace(OverheadConfig(), seconds_per_level=args.seconds, relay_sessions=(1, 20))
    with redis_process() as redis, tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        env = GATEWAY_ENV | {"OMNI_GATEWAY_REDIS_URL": redis.url}
        with server(["bench.servers", "stamp", "--port", str(port)], port=port, env=env,
                    log=Path(tmp) / "stamp.log", ready_path="/readyz") as proc, \
                nginx([f"127.0.0.1:{port}"], Path(tmp) / "edge") as edge:
            result = asyncio.run(measure(f"http://127.0.0.1:{port}", edge, proc.pid, config))
    write_results(args.results, "edge", result, report(result))


if __name__ == "__main__":
    main()
