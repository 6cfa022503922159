"""Engine start and speed on the embedded model: eager against torch.compile, cold and warm.

Each start runs in a fresh process, so it pays what a replica pays: Python's
imports, vLLM's engine process, the model load, torch.compile (or not), the
profiling / warm-up run and the KV cache. Measured, per start:

- ``ready_sec``: from the process's start to the first answer (a one-token request);
- what vLLM says the start spent: loading the model, torch.compile, and the
  engine's init (profiling run, KV cache, warm-up), from its own log lines;
- ``prefill_tokens_per_sec``: a prompt of about ``PREFILL_TOKENS`` tokens, one token out;
- ``decode_tokens_per_sec``: ``DECODE_TOKENS`` greedy tokens after a short prompt.

Modes: ``eager`` (``enforce_eager``: no torch.compile) and ``compiled``
(vLLM's default on the CPU: Dynamo traced once, Inductor). ``compiled`` starts
``cold`` (empty compile caches: a fresh machine, or a new model or vLLM) and
``warm`` (the caches the cold start left: a restart). The caches live in a
folder of this run (``VLLM_CACHE_ROOT``, ``TORCHINDUCTOR_CACHE_DIR``), so the
cold start is truly cold and the machine's own caches are left alone. The
modes alternate, so the machine's noise falls on both. Eager also starts
with its engine processes spawned (vLLM's own way on the CPU,
``VLLM_WORKER_MULTIPROC_METHOD=spawn``) beside forked (the gateway's).

The ``auto`` scenario (the CPU default, ``omni_adapter/compile_warmup.py``), in
compile caches of its own: a first start (auto finds no warm cache: eager, and
a niced background compile once ready) and how long that compile takes, the
first process waiting for it; then restarts (auto finds the cache warm:
compiled), each beside an eager start for decode in the same run.

    python -m bench.engine_start              # writes results/engine_start.{json,md}
    python -m bench.engine_start --rounds 1
    python -m bench.engine_start --scenario auto   # writes results/engine_start_auto.{json,md}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
PROMPT = "Write a short story about a lighthouse keeper."
DECODE_TOKENS = 96
PREFILL_TOKENS = 1000
#: vLLM's own log lines about its start: (name, pattern of the seconds).
VLLM_PHASES = {
    "load_model_sec": re.compile(r"Loading weights took ([\d.]+) seconds"),
    "torch_compile_sec": re.compile(r"torch\.compile took ([\d.]+) s in total"),
    "init_engine_sec": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
}


async def _measure_in_process(mode: str, process_started: float) -> dict:
    from vllm import SamplingParams

    from omni_adapter.model_bootstrap import ensure_default_model
    from omni_adapter.vllm_engine import VllmEngineConfig, open_vllm_engine

    model = str(ensure_default_model())
    engine = await open_vllm_engine(VllmEngineConfig(
        model=model, served_model_name="bench", compile={"compiled": True, "eager": False}.get(mode)))
    llm = engine._llm  # the raw AsyncLLM: measure the engine, not the session plumbing

    async def timed(prompt: str | list[int], params: SamplingParams, request_id: str) -> tuple[float, float, int]:
        """Seconds to the first output, seconds from it to the last, tokens out."""
        started = time.perf_counter()
        first: float | None = None
        tokens = 0
        async for out in llm.generate({"prompt_token_ids": prompt} if isinstance(prompt, list)
                                      else {"prompt": prompt}, params, request_id=request_id):
            first = first or time.perf_counter()
            tokens = len(out.outputs[0].token_ids)
        assert first is not None
        return first - started, time.perf_counter() - first, tokens

    try:
        await timed("warm up", SamplingParams(max_tokens=1, temperature=0.0), "warm")
        ready_sec = time.time() - process_started
        tokenizer = llm.get_tokenizer()
        words = tokenizer.encode(" ".join(["the lighthouse keeper watched the sea"] * 200))
        prefill_sec, _, _ = await timed(words[:PREFILL_TOKENS], SamplingParams(max_tokens=1, temperature=0.0),
                                        "prefill")
        params = SamplingParams(max_tokens=DECODE_TOKENS, min_tokens=DECODE_TOKENS, temperature=0.0)
        first_token_sec, decode_sec, tokens = await timed(PROMPT, params, "decode")
        run = {"mode": mode, "ready_sec": round(ready_sec, 1), "first_token_sec": round(first_token_sec, 3),
               "prefill_tokens_per_sec": round(PREFILL_TOKENS / prefill_sec, 1),
               "decode_tokens_per_sec": round((tokens - 1) / decode_sec, 1),
               "compiled": engine.compiled, "background_compile_sec": None}
        warmup = engine.compile_warmup
        if warmup is not None:  # auto started eager: wait for the compile it launched (it dies with us)
            exit_code = await warmup.done
            run |= {"background_compile_sec": round(time.monotonic() - warmup.started, 1),
                    "background_compile_exit": exit_code}
            # The same engine's decode without the compile beside it (the one above ran beside it).
            _, decode_sec, tokens = await timed(PROMPT, params, "decode-after")
            run["decode_after_compile_tokens_per_sec"] = round((tokens - 1) / decode_sec, 1)
        return run
    finally:
        await engine.aclose()


def _run_fresh(mode: str, label: str, caches: Path, start_method: str = "fork") -> dict:
    """One start in its own process, its compile caches in ``caches``; the engine's
    processes forked (the gateway's way on the CPU) or spawned (vLLM's own)."""
    env = os.environ | {"VLLM_CACHE_ROOT": str(caches / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor")}
    if start_method == "spawn":
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    else:
        env.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
    out = subprocess.run([sys.executable, "-m", "bench.engine_start", "--mode", mode, "--child", str(time.time())],
                         check=True, capture_output=True, text=True, env=env)
    run = json.loads(out.stdout.strip().splitlines()[-1]) | {"start": label, "processes": start_method}
    for name, pattern in VLLM_PHASES.items():
        found = pattern.findall(out.stdout + out.stderr)  # vLLM logs to stdout
        run[name] = round(sum(float(seconds) for seconds in found), 1) if found else None
    return run


def _markdown(columns: dict[str, Callable[[dict], object]], runs: list[dict]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    lines += ["| " + " | ".join(str(cell(run)) for cell in columns.values()) + " |" for run in runs]
    return "\n".join(lines) + "\n"


def _table(runs: list[dict]) -> str:
    return _markdown({
        "mode": lambda r: r["mode"], "start": lambda r: r["start"], "engine processes": lambda r: r["processes"],
        "ready after (s)": lambda r: r["ready_sec"], "model load (s)": lambda r: r["load_model_sec"],
        "torch.compile (s)": lambda r: r["torch_compile_sec"],
        "engine init: profile, KV, warm-up (s)": lambda r: r["init_engine_sec"],
        "prefill tokens/s": lambda r: r["prefill_tokens_per_sec"],
        "decode tokens/s": lambda r: r["decode_tokens_per_sec"]}, runs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["eager", "compiled", "auto"], default=None)
    parser.add_argument("--scenario", choices=["modes", "auto"], default="modes",
                        help="eager against compiled (cold, warm), or auto's first start and restarts")
    parser.add_argument("--child", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=2, help="eager + compiled (warm) starts, alternating")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(asyncio.run(_measure_in_process(args.mode, args.child))))
        return
    if args.scenario == "auto":
        _auto(args.rounds, args.results)
        return
    runs = []
    with tempfile.TemporaryDirectory(prefix="engine-start-") as scratch:
        caches = Path(scratch)
        runs.append(_run_fresh("compiled", "cold", caches))
        print(json.dumps(runs[-1]), flush=True)
        for _ in range(args.rounds):
            for mode, label, start_method in (("eager", "-", "fork"), ("eager", "-", "spawn"),
                                              ("compiled", "warm", "fork")):
                runs.append(_run_fresh(mode, label, caches, start_method))
                print(json.dumps(runs[-1]), flush=True)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "engine_start.json").write_text(json.dumps(runs, indent=2) + "\n")
    (args.results / "engine_start.md").write_text(_table(runs))


def _auto(rounds: int, results: Path) -> None:
    """Auto's first start (eager + the background compile), then its restarts beside eager.

    An eager first start with empty caches of its own comes first: any first start with an
    empty ``VLLM_CACHE_ROOT`` pays vLLM's inspection of the model class (~10 s, then cached
    under ``modelinfos/``), which the later starts of the run do not."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="engine-start-auto-") as scratch:
        eager_caches, caches = Path(scratch, "eager"), Path(scratch, "auto")
        plan = [("eager", "first", eager_caches), ("auto", "first", caches)]
        plan += [("eager", "-", caches), ("auto", "restart", caches)] * rounds
        for mode, label, where in plan:
            runs.append(_run_fresh(mode, label, where))
            print(json.dumps(runs[-1]), flush=True)
    results.mkdir(parents=True, exist_ok=True)
    (results / "engine_start_auto.json").write_text(json.dumps(runs, indent=2) + "\n")
    (results / "engine_start_auto.md").write_text(_auto_table(runs))


def _auto_table(runs: list[dict]) -> str:
    return _markdown({
        "mode": lambda r: r["mode"], "start": lambda r: r["start"],
        "ran": lambda r: "compiled" if r["compiled"] else "eager", "ready after (s)": lambda r: r["ready_sec"],
        "background compile (s)": lambda r: r["background_compile_sec"] or "-",
        "engine init (s)": lambda r: r["init_engine_sec"], "prefill tokens/s": lambda r: r["prefill_tokens_per_sec"],
        "decode tokens/s": lambda r: r["decode_tokens_per_sec"],
        "decode after the background compile": lambda r: r.get("decode_after_compile_tokens_per_sec") or "-"}, runs)


if __name__ == "__main__":
    main()
