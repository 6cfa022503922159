"""vLLM's own benchmark (``vllm bench serve``) against the gateway, and against vLLM behind it.

What a vLLM user runs first to size a server, pointed at us unchanged: its random dataset
(``--ignore-eos``: every answer is ``--output-len`` tokens), through ``/v1/completions``
(its ``vllm`` backend) and ``/v1/chat/completions`` (``openai-chat``). The engine is the same
for all three: one ``vllm serve`` of the embedded model (tests/vllm_sidecar.py), measured

- directly (the floor: what vLLM gives without us);
- through the gateway (``OMNI_GATEWAY_ENGINE=openai-http`` in front of that same server, on a
  real Redis of its own): every request a session, its frames through Redis;

so the ratios are the gateway's cost as ``vllm bench serve`` sees it, measured in one run.
The CLI entry point of this CPU build cannot find its own package metadata, so the
benchmark's module is called as ``vllm bench serve`` calls it.

    python -m bench.vllm_bench                    # writes results/vllm_bench.{json,md}
    python -m bench.vllm_bench --prompts 16       # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

from bench.procs import server, write_results

RESULTS = Path(__file__).parent / "results"
METRICS = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
           "p99_tpot_ms", "median_itl_ms", "p99_itl_ms")


def run_benchmark(base_url: str, model: str, tokenizer: str, backend: str, endpoint: str,
                  args: argparse.Namespace) -> dict[str, Any]:
    """One ``vllm bench serve`` run; its result (vLLM's own keys)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = ["--backend", backend, "--endpoint", endpoint, "--base-url", base_url, "--model", model,
            "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.prompts),
            "--max-concurrency", str(args.concurrency), "--ignore-eos", "--disable-tqdm", "--seed", "0"]
    with contextlib.redirect_stdout(io.StringIO()):
        result: dict[str, Any] = main(parser.parse_args(argv))
    return result


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from omni_adapter.model_bootstrap import ensure_default_model
    from tests.redis_server import free_port, redis_process
    from tests.vllm_sidecar import SERVED_NAME, VllmSidecar

    model, tokenizer = SERVED_NAME, str(ensure_default_model())
    rows: list[dict[str, Any]] = []
    with VllmSidecar() as sidecar, redis_process() as redis, tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        env = {"OMNI_GATEWAY_ENGINE": "openai-http", "OMNI_GATEWAY_ENGINE_URL": sidecar.url,
               "OMNI_GATEWAY_REDIS_URL": redis.url, "OMNI_GATEWAY_RATE_LIMIT_RPS": "0"}
        with server(["gateway.runtime.cli", "serve", "--host", "127.0.0.1", "--port", str(port)], port=port,
                    env=env, log=Path(tmp) / "gateway.log", ready_path="/readyz"):
            gateway = f"http://127.0.0.1:{port}"
            for name, backend, endpoint in (("completions", "vllm", "/v1/completions"),
                                            ("chat", "openai-chat", "/v1/chat/completions")):
                run_benchmark(gateway, model, tokenizer, backend, endpoint, args)  # warms both: not measured
                for target, url in (("vllm serve", sidecar.url), ("gateway -> vllm serve", gateway)):
                    result = run_benchmark(url, model, tokenizer, backend, endpoint, args)
                    assert result["completed"] == args.prompts, f"{target} {name}: {result['completed']} done"
                    rows.append({"endpoint": name, "target": target, "completed": result["completed"],
                                 **{m: result[m] for m in METRICS}})
    return {"setup": {"cpus": os.cpu_count(), "machine": f"{platform.machine()}, {platform.system()}",
                      "engine": "vllm serve (tests/vllm_sidecar.py): SmolLM2-135M-Instruct, float32, on the CPU",
                      "prompts": args.prompts, "concurrency": args.concurrency, "input_len": args.input_len,
                      "output_len": args.output_len},
            "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    s = result["setup"]
    lines = [
        "# vLLM's own benchmark against the gateway", "",
        "Produced by `python -m bench.vllm_bench` (see its docstring). `vllm bench serve`, random dataset, "
        f"{s['prompts']} prompts of {s['input_len']} tokens, {s['output_len']} tokens out each (`--ignore-eos`), "
        f"{s['concurrency']} at once; {s['engine']}; {s['cpus']} CPUs ({s['machine']}), shared and noisy: "
        "compare rows of one run.", "",
        "| endpoint | target | done | req/s | out tok/s | TTFT P50 ms | TTFT P99 ms | TPOT P50 ms | TPOT P99 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['endpoint']} | {r['target']} | {r['completed']} | {r['request_throughput']:.2f} | "
                     f"{r['output_throughput']:.1f} | {r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | "
                     f"{r['median_tpot_ms']:.1f} | {r['p99_tpot_ms']:.1f} |")
    lines += ["", "Ratios, gateway over vllm serve (1.00: no cost):", ""]
    for endpoint in ("completions", "chat"):
        direct, ours = (next(r for r in result["rows"] if r["endpoint"] == endpoint and r["target"] == t)
                        for t in ("vllm serve", "gateway -> vllm serve"))
        lines.append(f"- {endpoint}: output throughput {ours['output_throughput'] / direct['output_throughput']:.2f}, "
                     f"TTFT P50 {ours['median_ttft_ms'] / direct['median_ttft_ms']:.2f}, "
                     f"TPOT P50 {ours['median_tpot_ms'] / direct['median_tpot_ms']:.2f}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    result = measure(args)
    write_results(RESULTS, "vllm_bench", result, markdown(result))


if __name__ == "__main__":
    main()
