"""An API worker's heap after its first check: what a full collection walks.

A worker freezes its start-up heap (``DrainingServer``), so a full collection
walks only what came after. Each run is a fresh process that builds the
worker's request checks as ``open_request_checks`` does, freezes the heap as the
worker does once it serves, checks one request with a function (what a user's
first call does), then times one full collection. ``cold``: without the
warm-up check (``TokenizerChecks.warm``), as workers were before; ``warm``: as
they are now.

    python -m bench.worker_heap            # writes results/worker_heap.{json,md}
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench.procs import write_results

RESULTS = Path(__file__).parent / "results"

#: One measurement, in a fresh process: argv[1] is "cold" or "warm".
ONE_RUN = """
import asyncio, gc, json, sys, time
from omni_adapter import vllm_engine
from omni_adapter.factory import EngineChoice, open_request_checks
from omni_adapter.model_bootstrap import ensure_default_model
from omni_adapter.port import Capabilities, EngineRequest, SamplingOptions

if sys.argv[1] == "cold":
    vllm_engine.TokenizerChecks.warm = lambda self: None
caps = Capabilities(input_modalities=frozenset({"text"}), output_modalities=frozenset({"text"}), incremental=True,
                    model_names=("m",), tools=True, structured_outputs=True)
checks = asyncio.run(open_request_checks(EngineChoice(kind="vllm", model=str(ensure_default_model())), caps))
modules = len(sys.modules)
gc.collect()
gc.freeze()
tool = {"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": {}}}}
started = time.perf_counter()
checks.check_request(EngineRequest("r", "m", (), SamplingOptions(max_tokens=3), tools=(tool,)))
first_check = time.perf_counter() - started
unfrozen = len(gc.get_objects())
started = time.perf_counter()
gc.collect()
print(json.dumps({"modules_imported_by_the_first_check": len(sys.modules) - modules,
                  "first_check_ms": round(first_check * 1000, 1), "objects_not_frozen": unfrozen,
                  "full_collection_ms": round((time.perf_counter() - started) * 1000, 1)}))
"""


def measure(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", ONE_RUN, mode], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).parent.parent, timeout=600)
    return {"mode": mode, **json.loads(done.stdout.strip().splitlines()[-1])}


def table(rows: list[dict]) -> str:
    lines = ["| run | checks | modules the first check imported | its time (ms) | objects not frozen "
             "| a full collection (ms) |", "|---" * 6 + "|"]
    lines += [f"| {n} | {r['mode']} | {r['modules_imported_by_the_first_check']} | {r['first_check_ms']} "
              f"| {r['objects_not_frozen']} | {r['full_collection_ms']} |" for n, r in enumerate(rows)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rows = [measure(mode) for _ in range(args.rounds) for mode in ("cold", "warm")]
    write_results(args.results, "worker_heap", {"runs": rows}, table(rows))


if __name__ == "__main__":
    main()
