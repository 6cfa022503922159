"""Many sessions, one engine: Stream2LLM's pressure experiment at this machine's scale.

    python -m bench.pressure                # every configuration (~10 min on 2 cores)
    python -m bench.pressure --load heavy   # more idle sessions, twice the active rate
    python -m bench.pressure --load quick   # fewer sessions: checks the plumbing

The engine runs at most ``MAX_NUM_SEQS`` requests at once (vLLM's
``max_num_seqs``): on a GPU the limit that idle streaming sessions pin is KV
memory; on this CPU engine with SmolLM2 a KV cache small enough to fill
would take minutes of prefill, so the engine's request slots stand in for it
(the same mechanism: a streaming request that waits for input holds what a
complete request needs). The workload (``Workload``):

- **slow sessions**: more of them than the engine has slots, each sending
  pages with heavy-tailed gaps (lognormal, median ``slow_gap_sec``), so most
  of them are idle at any moment, like users who pause or retrievers that
  wait on a slow source;
- **active queries**: a Poisson stream of short queries whose pages arrive
  quickly, as a user would expect an answer.

Each configuration replays the same trace against a fresh gateway process
(real vLLM on the CPU, real Redis): ``on_end_only`` (no streaming), naive
streaming (``on_first_chunk``, no cap, no parking) and the scheduler with
each policy. TTFT is measured at the client, from the acknowledgement of
the last chunk to the first content delta. An update-mode run compares the
TTFT after replacing a chunk (re-ranked context) with a from-scratch request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from bench.client import SessionClient, http_session
from bench.overhead import GATEWAY_ENV
from bench.procs import server
from bench.stats import summary
from bench.trace import PageSource
from tests.redis_server import free_port, redis_process

RESULTS = Path(__file__).parent / "results"
SYSTEM = "Summarize the text the user sends in one sentence."
MAX_NUM_SEQS = 4


@dataclass(frozen=True)
class Workload:
    slow_sessions: int = 8
    slow_pages: int = 5
    slow_gap_sec: float = 3.0
    active_queries: int = 16
    active_rate_per_sec: float = 0.4
    active_pages: int = 3
    active_gap_sec: float = 0.2
    page_chars: int = 250
    max_tokens: int = 8
    seed: int = 11


#: The load levels `--load` picks; each writes results/pressure[_<load>].{json,md}.
LOADS: dict[str, Workload] = {
    "base": Workload(),
    # Half again as many idle sessions and twice the rate of active queries.
    "heavy": Workload(slow_sessions=12, active_queries=24, active_rate_per_sec=0.8),
    "quick": Workload(slow_sessions=5, slow_pages=3, slow_gap_sec=1.5, active_queries=4, active_rate_per_sec=1.0),
}

#: name -> (start policy of every session, gateway settings)
CONFIGS: dict[str, tuple[str, dict[str, str]]] = {
    "on_end_only": ("on_end_only", {"OMNI_GATEWAY_IDLE_PARK_SEC": "0"}),
    "naive streaming": ("on_first_chunk", {"OMNI_GATEWAY_IDLE_PARK_SEC": "0"}),
    **{f"scheduler {policy}": ("on_first_chunk", {
        "OMNI_GATEWAY_MAX_ENGINE_SESSIONS": str(MAX_NUM_SEQS),
        "OMNI_GATEWAY_MAX_LISTENING_SESSIONS": str(MAX_NUM_SEQS - 1),
        "OMNI_GATEWAY_SCHEDULE_POLICY": policy, "OMNI_GATEWAY_IDLE_PARK_SEC": "1.0",
        "OMNI_GATEWAY_TEND_INTERVAL_SEC": "0.1"}) for policy in ("fcfs", "lcas", "mcps")},
}


@dataclass(frozen=True)
class Session:
    kind: str
    start_sec: float
    pages: tuple[str, ...]
    gaps_sec: tuple[float, ...]


def make_trace(workload: Workload) -> list[Session]:
    rng = random.Random(workload.seed)
    source = PageSource(workload.page_chars, workload.seed)
    trace = []
    for n in range(workload.slow_sessions):
        gaps = (0.0, *(min(4 * workload.slow_gap_sec, rng.lognormvariate(0, 0.8) * workload.slow_gap_sec)
                       for _ in range(workload.slow_pages - 1)))
        trace.append(Session("slow", rng.uniform(0, 1.0), source.take(workload.slow_pages, f"slow-{n}"), gaps))
    clock = 2.0  # the slow sessions hold the engine by then
    for n in range(workload.active_queries):
        gaps = (0.0, *([workload.active_gap_sec] * (workload.active_pages - 1)))
        trace.append(Session("active", clock, source.take(workload.active_pages, f"active-{n}"), gaps))
        clock += rng.expovariate(workload.active_rate_per_sec)
    return trace


async def first_content(client: SessionClient, sid: str) -> float:
    async for arrived, _ in client.content_deltas(sid):
        return arrived
    raise RuntimeError(f"{sid}: no content")


async def run_session(client: SessionClient, session: Session, policy: str, t0: float, max_tokens: int) -> dict:
    await asyncio.sleep(max(0.0, t0 + session.start_sec - time.monotonic()))
    sid = await client.create(messages=[{"role": "system", "content": SYSTEM}], start_policy=policy,
                              temperature=0, max_tokens=max_tokens)
    watcher = asyncio.create_task(first_content(client, sid))
    last_ack = 0.0
    for seq, (gap, page) in enumerate(zip(session.gaps_sec, session.pages, strict=True)):
        await asyncio.sleep(gap)
        await client.append(sid, seq, page, end=seq == len(session.pages) - 1)
        last_ack = time.time()
    return {"kind": session.kind, "ttft_s": round(await watcher - last_ack, 4)}


async def replay(base_url: str, trace: list[Session], policy: str, max_tokens: int) -> list[dict]:
    async with http_session(connections=len(trace) * 2) as http:
        client = SessionClient(http, base_url)
        t0 = time.monotonic()
        return list(await asyncio.gather(*(run_session(client, s, policy, t0, max_tokens) for s in trace)))


async def update_mode(base_url: str, workload: Workload, rounds: int = 5) -> dict:
    """TTFT after replacing a context chunk, vs the same final input sent from scratch."""
    source = PageSource(workload.page_chars, workload.seed + 1)
    after_update, from_scratch = [], []
    async with http_session(connections=8) as http:
        client = SessionClient(http, base_url)
        base = base_url + "/v1/streaming_input/sessions"
        for n in range(rounds):
            pages = source.take(5, f"update-{n}")
            reranked = source.take(1, f"reranked-{n}")[0]
            question = "Which topic matters most here?"
            sid = await client.create(messages=[{"role": "system", "content": SYSTEM}],
                                      start_policy="on_first_chunk", temperature=0, max_tokens=workload.max_tokens)
            for seq, page in enumerate(pages):
                await client.append(sid, seq, page)
                await asyncio.sleep(0.3)
            watcher = asyncio.create_task(first_content(client, sid))
            # The retriever re-ranks: the fourth document is replaced, then the question ends the input.
            async with http.put(f"{base}/{sid}/chunks/3", json={"sequence_id": 3, "text": reranked}) as response:
                assert response.status == 200, await response.text()
            await client.append(sid, len(pages), question, end=True)
            acked = time.time()
            after_update.append(await watcher - acked)

            final = "".join([*pages[:3], reranked, *pages[4:], question]).replace(f"update-{n}", f"scratch-{n}")
            sid = await client.create(messages=[{"role": "system", "content": SYSTEM}], start_policy="on_end_only",
                                      temperature=0, max_tokens=workload.max_tokens)
            watcher = asyncio.create_task(first_content(client, sid))
            await client.append(sid, 0, final, end=True)
            acked = time.time()
            from_scratch.append(await watcher - acked)
    return {"after_update": summary(after_update), "from_scratch": summary(from_scratch)}


def run_config(name: str, workload: Workload, trace: list[Session], *, with_update: bool) -> dict:
    policy, settings = CONFIGS[name]
    with redis_process() as redis, tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        env = GATEWAY_ENV | {"OMNI_GATEWAY_REDIS_URL": redis.url, "OMNI_GATEWAY_KV_CACHE_SPACE_GIB": "1",
                             "OMNI_GATEWAY_ENGINE_MAX_NUM_SEQS": str(MAX_NUM_SEQS),
                             "OMNI_GATEWAY_MAX_ENGINE_SESSIONS": "64"} | settings
        with server(["gateway.runtime.cli", "serve", "--host", "127.0.0.1", "--port", str(port)], port=port, env=env,
                    log=Path(tmp) / "gateway.log", ready_path="/readyz"):
            url = f"http://127.0.0.1:{port}"
            started = time.monotonic()
            sessions = asyncio.run(replay(url, trace, policy, workload.max_tokens))
            result: dict = {"config": name, "wall_s": round(time.monotonic() - started, 1)}
            for kind in ("all", "slow", "active"):
                ttfts = [s["ttft_s"] for s in sessions if kind in ("all", s["kind"])]
                result[kind] = summary(ttfts)
            result["samples"] = sessions
            if with_update:
                result["update_mode"] = asyncio.run(update_mode(url, workload))
            metrics = asyncio.run(_metrics(url))
            result["parks"] = metrics
    return result


async def _metrics(url: str) -> dict[str, float]:
    """The gateway's park counters, by reason."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as response:
        text = await response.text()
    parks: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("omni_gateway_sessions_parked_total"):
            reason = line.split('reason="')[1].split('"')[0]
            parks[reason] = float(line.rsplit(" ", 1)[1])
    return parks


def markdown(results: list[dict], workload: Workload) -> str:
    lines = ["# Many sessions, one engine (issue #16)", "",
             f"`python -m bench.pressure`, {time.strftime('%Y-%m-%d')}, one run, real vLLM on the CPU "
             f"(SmolLM2-135M, `max_num_seqs={MAX_NUM_SEQS}`), real Redis; client, Redis and gateway share 2 cores.",
             "", f"Workload: {asdict(workload)}", "",
             "TTFT after the last chunk's acknowledgement, seconds:", "",
             "| configuration | all P50 | all P99 | active P50 | active P99 | slow P50 | slow P99 | parks |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        parks = ", ".join(f"{k} {int(v)}" for k, v in sorted(r["parks"].items())) or "0"
        lines.append(f"| {r['config']} | {r['all']['p50']} | {r['all']['p99']} | {r['active']['p50']} | "
                     f"{r['active']['p99']} | {r['slow']['p50']} | {r['slow']['p99']} | {parks} |")
    base = next(r for r in results if r["config"] == "on_end_only")
    lines += ["", "Speed-up over `on_end_only` (above 1: faster), all sessions:", "",
              "| configuration | P50 | P99 |", "|---|---|---|"]
    for r in results:
        lines.append(f"| {r['config']} | {base['all']['p50'] / r['all']['p50']:.2f}x | "
                     f"{base['all']['p99'] / r['all']['p99']:.2f}x |")
    for r in results:
        if "update_mode" in r:
            u = r["update_mode"]
            lines += ["", f"Update mode ({r['config']}): TTFT after replacing one of five context chunks, "
                      f"P50 {u['after_update']['p50']} s (P99 {u['after_update']['p99']}), vs the same input "
                      f"from scratch P50 {u['from_scratch']['p50']} s (P99 {u['from_scratch']['p99']})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", choices=list(LOADS), default="base")
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    workload = LOADS[args.load]
    stem = "pressure" if args.load == "base" else f"pressure_{args.load}"
    trace = make_trace(workload)
    results = []
    for name in args.configs:
        result = run_config(name, workload, trace, with_update=name == "scheduler fcfs")
        print(f"{name}: all p50 {result['all']['p50']} p99 {result['all']['p99']}; active p50 "
              f"{result['active']['p50']} p99 {result['active']['p99']} ({result['wall_s']} s)", flush=True)
        results.append(result)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    if any(r["config"] == "on_end_only" for r in results):
        text = markdown(results, workload)
        (args.results / f"{stem}.md").write_text(text)
        print(text)


if __name__ == "__main__":
    main()
