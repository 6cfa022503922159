"""Time to first token after the end of input: streaming input vs not.

Replays the append-mode trace of :mod:`bench.trace` through the real gateway
(a ``omni-gateway serve`` process: real vLLM on the CPU with SmolLM2-135M,
a real ``redis-server``) at several Poisson rates, once with every session on
``on_end_only`` (the baseline: the engine sees the input only when it is
complete) and once on ``on_first_chunk`` (the engine prefills each page as
it arrives). TTFT is measured at the client: from reading the 202 of the
last chunk (``end_of_input``) to reading the first content delta on SSE.

Both policies at one rate replay the same arrival times and page gaps; every
query's text is unique, so no query hits another's prefix cache.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from bench.client import SessionClient, http_session
from bench.stats import summary
from bench.trace import PageSource, Query, make_trace

SYSTEM = "Summarize the documentation the user sends in one sentence."
POLICIES = ("on_end_only", "on_first_chunk")


@dataclass(frozen=True)
class TtftConfig:
    #: One query alone keeps the CPU engine busy ~3 s (cold prefill), so these
    #: load it to about 15%, 30% and 45%; at 0.1/s with 1.5 k-token queries it
    #: was already saturated (TTFT P50 over 11 s for both policies).
    rates_per_sec: tuple[float, ...] = (0.05, 0.1, 0.15)
    queries: int = 12
    #: ~800 tokens per query in pages of ~100: a crawler appending search
    #: results. Pages arrive at ~140 tokens/s, under the engine's ~250 tokens/s
    #: prefill on one core, so streaming can keep up with one query at a time.
    pages_per_query: int = 8
    page_chars: int = 400
    #: The answer is not the point: a few tokens keep decode from crowding prefill.
    max_tokens: int = 8
    seed: int = 7


async def run_query(client: SessionClient, query: Query, policy: str, t0: float, max_tokens: int) -> dict:
    await asyncio.sleep(max(0.0, t0 + query.arrival_sec - time.monotonic()))
    sid = await client.create(messages=[{"role": "system", "content": SYSTEM}], start_policy=policy,
                              temperature=0, max_tokens=max_tokens)

    async def first_token_time() -> float:
        first = None
        async for arrived, _ in client.content_deltas(sid):
            first = first or arrived
        if first is None:
            raise RuntimeError(f"{sid}: no content")
        return first

    watcher = asyncio.create_task(first_token_time())
    last_ack = 0.0
    for seq, (gap, page) in enumerate(zip(query.gaps_sec, query.pages, strict=True)):
        await asyncio.sleep(gap)
        await client.append(sid, seq, page, end=seq == len(query.pages) - 1)
        last_ack = time.time()
    first = await watcher
    return {"session_id": sid, "arrival_s": round(query.arrival_sec, 3), "ttft_s": first - last_ack}


async def run_policy(base_url: str, trace: list[Query], policy: str, max_tokens: int) -> list[dict]:
    async with http_session(connections=len(trace) * 2) as http:
        client = SessionClient(http, base_url)
        t0 = time.monotonic()
        return list(await asyncio.gather(*(run_query(client, q, policy, t0, max_tokens) for q in trace)))


async def measure(base_url: str, config: TtftConfig, log: Callable[[str], object] = print) -> dict:
    """Every (rate, policy) run in turn against one gateway; returns the ``ttft`` results."""
    source = PageSource(config.page_chars, config.seed)
    runs = []
    for rate in config.rates_per_sec:
        for policy in POLICIES:
            # Same seed per rate: both policies replay the same arrivals and gaps.
            trace = make_trace(source, queries=config.queries, pages_per_query=config.pages_per_query,
                               rate_per_sec=rate, seed=config.seed + int(rate * 1000),
                               label=f"{policy}-{rate}")
            started = time.monotonic()
            queries = await run_policy(base_url, trace, policy, config.max_tokens)
            ttfts = [q["ttft_s"] for q in queries]
            stats = summary(ttfts)
            log(f"rate {rate}/s {policy}: p50 {stats['p50']:.3f} s p99 {stats['p99']:.3f} s "
                f"({time.monotonic() - started:.0f} s)")
            runs.append({"rate": rate, "policy": policy, "p50_s": stats["p50"], "p95_s": stats["p95"],
                         "p99_s": stats["p99"], "mean_s": stats["mean"], "n": stats["n"],
                         "samples_s": [round(t, 4) for t in ttfts]})
    return {"config": config.__dict__ | {"rates_per_sec": list(config.rates_per_sec)}, "runs": runs}


def speedups(runs: list[dict]) -> list[dict]:
    """Baseline over streaming, per rate and percentile (above 1: streaming is faster)."""
    by = {(r["rate"], r["policy"]): r for r in runs}
    out = []
    for rate in sorted({r["rate"] for r in runs}):
        base, streamed = by[(rate, "on_end_only")], by[(rate, "on_first_chunk")]
        out.append({"rate": rate, **{q: round(base[f"{q}_s"] / streamed[f"{q}_s"], 2)
                                     for q in ("p50", "p95", "p99")}})
    return out
