"""Engine start time and decode speed: eager, vLLM's AOT compile cache, ours.

Every engine start on this machine used to recompile the model for minutes
(vLLM's AOT compile cache is saved but fails to load with this torch), so a
restart, a rollout or a test run paid that each time. This measures, each in
a fresh process so nothing is shared in memory: the time until the engine
answers its first request, and the decode speed of a short greedy answer.

- ``eager``: no torch.compile (``enforce_eager``);
- ``aot``: torch.compile with vLLM's AOT cache (vLLM's default here);
- ``default``: torch.compile without the AOT cache (what the gateway runs:
  torch's own caches serve a restart).

Compiled modes run twice: the second start is the one a restart pays.

    python -m bench.engine_start            # every mode, writes results/engine_start.{json,md}
    python -m bench.engine_start --mode eager
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
PROMPT = "Write a short story about a lighthouse keeper."
DECODE_TOKENS = 96


async def _measure_in_process(mode: str) -> dict:
    import os

    if mode == "aot":
        os.environ["VLLM_USE_AOT_COMPILE"] = "1"
    from vllm import SamplingParams

    from omni_adapter.model_bootstrap import ensure_default_model
    from omni_adapter.vllm_engine import VllmEngineConfig, open_vllm_engine

    model = str(ensure_default_model())
    started = time.perf_counter()
    engine = await open_vllm_engine(VllmEngineConfig(
        model=model, served_model_name="bench", enforce_eager=mode == "eager"))
    llm = engine._llm  # the raw AsyncLLM: measure the engine, not the session plumbing
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0)
        async for _ in llm.generate({"prompt": "warm up"}, params, request_id="warm"):
            pass
        ready_sec = time.perf_counter() - started
        params = SamplingParams(max_tokens=DECODE_TOKENS, min_tokens=DECODE_TOKENS, temperature=0.0)
        first: float | None = None
        tokens = 0
        t0 = time.perf_counter()
        async for out in llm.generate({"prompt": PROMPT}, params, request_id="decode"):
            if first is None:
                first = time.perf_counter()
            tokens = len(out.outputs[0].token_ids)
        done = time.perf_counter()
        assert first is not None
        return {"mode": mode, "ready_sec": round(ready_sec, 1),
                "first_token_sec": round(first - t0, 3), "decode_tokens": tokens,
                "decode_tokens_per_sec": round((tokens - 1) / (done - first), 1)}
    finally:
        await engine.aclose()


def _run_fresh(mode: str) -> dict:
    """One mode in its own process: start costs include everything a restart pays."""
    out = subprocess.run([sys.executable, "-m", "bench.engine_start", "--mode", mode, "--child"],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["eager", "aot", "default", "all"], default="all")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(asyncio.run(_measure_in_process(args.mode))))
        return
    modes = ["eager", "aot", "default"] if args.mode == "all" else [args.mode]
    # Compiled twice: the second start is the one a restart pays (cache warm).
    runs = [_run_fresh(m) for m in modes for _ in range(1 if m == "eager" else 2)]
    for run in runs:
        print(json.dumps(run))
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "engine_start.json").write_text(json.dumps(runs, indent=2) + "\n")
    lines = ["| mode | ready after (s) | first token (s) | decode tokens/s |", "|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['ready_sec']} | {r['first_token_sec']} | {r['decode_tokens_per_sec']} |"
              for r in runs]
    (args.results / "engine_start.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
