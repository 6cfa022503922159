"""Turn the parts' raw results into ``latest.json``, ``latest.md`` and the CCDF plot."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from bench.stats import ccdf
from bench.ttft import speedups

#: The issue's targets (goals, not assertions).
TARGETS = {"p50_speedup_min": 11.0, "p99_speedup_min": 1.0, "floor_multiple_max": 1.5,
           "append_p99_ms_at_200_max": 5.0, "appends_per_s_min": 2000, "relay_p99_ms_max": 2.0,
           "idle_session_bytes_max": 16 * 1024}


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpus": os.cpu_count(), "cpu": cpu, "python": platform.python_version()}


def summarize(ttft: dict, floor: dict, overhead: dict) -> dict:
    runs = ttft["runs"]
    by_rate = speedups(runs)
    lowest = min(by_rate, key=lambda s: s["rate"])
    streamed_low = next(r for r in runs if r["rate"] == lowest["rate"] and r["policy"] == "on_first_chunk")
    idle = next(m for m in overhead["memory"] if m["policy"] == "on_end_only")
    started = next(m for m in overhead["memory"] if m["policy"] == "on_first_chunk")
    relay_one = next(r for r in overhead["relay"] if r["sessions"] == 1)
    at_200 = next((o for o in overhead["overhead"] if o["concurrency"] == 200), None)
    redis_p50, http_p50 = overhead["redis_rtt_ms"]["p50"], overhead["bare_http_ms"]["p50"]
    result = {
        "machine": machine(),
        "ttft": [{k: r[k] for k in ("rate", "policy", "p50_s", "p95_s", "p99_s", "mean_s", "n")} for r in runs],
        "ttft_speedup": {"rate": lowest["rate"], "p50": lowest["p50"], "p99": lowest["p99"]},
        "ttft_speedup_by_rate": by_rate,
        "ttft_floor_s": floor["warm_s"]["p50"],
        "ttft_cold_prefill_s": floor["cold_s"]["p50"],
        "ttft_floor_multiple": round(streamed_low["p50_s"] / floor["warm_s"]["p50"], 2),
        "prompt_tokens_mean": floor["prompt_tokens_mean"],
        "last_page_tokens_mean": floor["last_page_tokens_mean"],
        "overhead": overhead["overhead"],
        "relay_p99_ms": relay_one["p99"],
        "relay": overhead["relay"],
        "relay_rates": overhead.get("relay_rates", []),
        "relay_floor": overhead.get("relay_floor", []),
        "idle_session_bytes": idle["gateway_bytes"] + idle["redis_bytes"],
        "started_session_bytes": started["gateway_bytes"] + started["redis_bytes"],
        "memory": overhead["memory"],
        "redis_rtt_p50_ms": redis_p50,
        "bare_http_p50_ms": http_p50,
        # Back to back from one client, like the floors themselves.
        "append_p50_over_bare_http": round(overhead["overhead"][0]["flat_out_p50_ms"] / http_p50, 2),
        "append_p50_over_redis_rtt": round(overhead["overhead"][0]["flat_out_p50_ms"] / redis_p50, 2),
        "profile_top": overhead.get("profile_top", []),
        "workers": overhead.get("workers", []),
        "targets": TARGETS,
    }
    result["met"] = {
        "p50_speedup": result["ttft_speedup"]["p50"] >= TARGETS["p50_speedup_min"],
        "p99_never_worse": min(s["p99"] for s in by_rate) >= TARGETS["p99_speedup_min"],
        "floor_multiple": result["ttft_floor_multiple"] <= TARGETS["floor_multiple_max"],
        "append_p99_at_200": at_200 is not None and at_200["append_p99_ms"] <= TARGETS["append_p99_ms_at_200_max"],
        "appends_per_s": max(o["appends_per_s"] for o in overhead["overhead"]) >= TARGETS["appends_per_s_min"],
        "relay_p99": result["relay_p99_ms"] <= TARGETS["relay_p99_ms_max"],
        "idle_session_bytes": result["idle_session_bytes"] <= TARGETS["idle_session_bytes_max"],
    }
    return result


def plot_ccdf(runs: list[dict], path: Path, floor_s: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    rates = sorted({r["rate"] for r in runs})
    fig, axes = plt.subplots(1, len(rates), figsize=(4.2 * len(rates), 3.6), sharex=True, sharey=True,
                             squeeze=False)
    for ax, rate in zip(axes[0], rates, strict=True):
        for run in (r for r in runs if r["rate"] == rate):
            x, y = ccdf(run["samples_s"])
            ax.step(x, y, where="post", label=run["policy"])
        if floor_s:
            ax.axvline(floor_s, color="grey", linestyle="--", linewidth=1, label="engine floor")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{rate} queries/s")
        ax.set_xlabel("TTFT after end of input (s)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("P[TTFT > x]")
    axes[0][0].legend()
    fig.suptitle("Append-mode trace, SmolLM2-135M on vLLM (CPU), through the gateway")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def yes(flag: bool) -> str:
    return "met" if flag else "**missed**"


def markdown(r: dict) -> str:
    t, met = r["targets"], r["met"]
    lines = [
        "# Benchmark results (generated by `python -m bench`; do not edit)",
        "",
        f"Machine: {r['machine']['cpus']} CPUs ({r['machine']['cpu']}), Python {r['machine']['python']}.",
        "",
        "## TTFT after end of input",
        "",
        f"Prompt {r['prompt_tokens_mean']} tokens on average, last page {r['last_page_tokens_mean']} tokens.",
        "",
        "| rate (q/s) | policy | n | P50 s | P95 s | P99 s |",
        "|---|---|---|---|---|---|",
        *(f"| {x['rate']} | {x['policy']} | {x['n']} | {x['p50_s']} | {x['p95_s']} | {x['p99_s']} |"
          for x in r["ttft"]),
        "",
        "| rate (q/s) | P50 speedup | P95 speedup | P99 speedup |",
        "|---|---|---|---|",
        *(f"| {s['rate']} | {s['p50']}x | {s['p95']}x | {s['p99']}x |" for s in r["ttft_speedup_by_rate"]),
        "",
        f"- P50 speedup at the lowest rate: {r['ttft_speedup']['p50']}x (target >= {t['p50_speedup_min']}x): "
        f"{yes(met['p50_speedup'])}",
        f"- P99 never worse than the baseline (>= {t['p99_speedup_min']}x at every rate): "
        f"{yes(met['p99_never_worse'])}",
        f"- Floor (vLLM alone: prefill only the last page, decode one token): {r['ttft_floor_s']} s; "
        f"the same prompt with nothing cached: {r['ttft_cold_prefill_s']} s.",
        f"- Our streaming P50 at the lowest rate is {r['ttft_floor_multiple']}x the floor "
        f"(target <= {t['floor_multiple_max']}x): {yes(met['floor_multiple'])}",
        "",
        "![TTFT CCDF](ttft_ccdf.png)",
        "",
        "## Gateway overhead (no inference)",
        "",
        f"Floors in the same run: Redis PING P50 {r['redis_rtt_p50_ms']} ms, "
        f"bare ASGI app over HTTP P50 {r['bare_http_p50_ms']} ms.",
        "",
        "Each session appends once per 250 ms (offered load = sessions x 4/s) for the latency columns, "
        "then back to back for the flat-out columns.",
        "",
        "| sessions | offered /s | append P50 ms | append P99 ms | flat-out appends/s | flat-out P50 ms "
        "| flat-out P99 ms | gateway CPU ms/append | refused (paced / flat out) |",
        "|---|---|---|---|---|---|---|---|---|",
        *(f"| {o['concurrency']} | {o['paced_offered_per_s']} | {o['append_p50_ms']} | {o['append_p99_ms']} | "
          f"{o['appends_per_s']} | {o['flat_out_p50_ms']} | {o['flat_out_p99_ms']} | "
          f"{o['gateway_cpu_ms_per_append']} | {o['paced_refused'] or '-'} / {o['refused'] or '-'} |"
          for o in r["overhead"]),
        "",
        f"- One append (one session, back to back) at P50 costs {r['append_p50_over_bare_http']}x a bare "
        f"HTTP request and {r['append_p50_over_redis_rtt']}x a Redis round trip.",
        f"- Append P99 at 200 sessions <= {t['append_p99_ms_at_200_max']} ms: {yes(met['append_p99_at_200'])}; "
        f">= {t['appends_per_s_min']} appends/s: {yes(met['appends_per_s'])}",
        "",
        "| streaming sessions | relay P50 ms | relay P99 ms | max ms |",
        "|---|---|---|---|",
        *(f"| {x['sessions']} | {x['p50']} | {x['p99']} | {x['max']} |" for x in r["relay"]),
        "",
        f"- Relay P99 (1 session) <= {t['relay_p99_ms_max']} ms: {yes(met['relay_p99'])}",
        "",
        *(["Relay by token rate (every session streaming at once; delivered = tokens over the whole run, "
           "session set-up included; settled = from 1 s after every session streams, once the start's "
           "backlog has cleared):", "",
           "| sessions | tokens/s each | offered tokens/s | delivered tokens/s | relay P50 / P99 ms, every token "
           "| P50 / P99 ms while all stream | the same, settled | gateway CPU ms/token |",
           "|---|---|---|---|---|---|---|---|",
           *(f"| {x['sessions']} | {x['tokens_per_s_each']} | {x['offered_tokens_per_s']} | "
             f"{x['delivered_tokens_per_s']} | {x['p50']} / {x['p99']} | "
             f"{_p50_p99(x['all_streaming'])} | {_p50_p99(x.get('settled'))} | {x['gateway_cpu_ms_per_token']} |"
             for x in r["relay_rates"]), ""] if r["relay_rates"] else []),
        *(["The relay's floor: the same stamped tokens on the same clock, streamed as the same SSE frames "
           "to the same client by the smallest ASGI app under the same uvicorn (`bench.servers bare-relay`: "
           "no Redis, no runner, no framework):", "",
           "| sessions | tokens/s each | P50 / P99 ms, every token | the same, settled | server CPU ms/token |",
           "|---|---|---|---|---|",
           *(f"| {x['sessions']} | {x['tokens_per_s_each']} | {x['p50']} / {x['p99']} | "
             f"{_p50_p99(x.get('settled'))} | {x['gateway_cpu_ms_per_token']} |" for x in r["relay_floor"]),
           ""] if r.get("relay_floor") else []),
        "| sessions | kind | gateway bytes each | Redis bytes each (beyond payload) |",
        "|---|---|---|---|",
        *(f"| {m['sessions']} | {m['policy']} | {m['gateway_bytes']} | {m['redis_bytes']} |" for m in r["memory"]),
        "",
        f"- Idle session, gateway + Redis: {r['idle_session_bytes']} bytes (target <= "
        f"{t['idle_session_bytes_max']}): {yes(met['idle_session_bytes'])}; started, gateway + Redis: "
        f"{r['started_session_bytes']} bytes (issue #17 judges the gateway's part, in the table)",
    ]
    if r["workers"]:
        lines += ["", "## A replica's shapes: one process, API workers beside the engine process", "",
                  "API workers 0 = one process does everything. CPU is the whole process tree's.", "",
                  "| API workers | sessions | offered /s | append P50 ms | append P99 ms | flat-out appends/s "
                  "| CPU ms/append | refused (paced / flat out) |",
                  "|---|---|---|---|---|---|---|---|",
                  *(f"| {w['api_workers']} | {o['concurrency']} | {o['paced_offered_per_s']} | {o['append_p50_ms']} | "
                    f"{o['append_p99_ms']} | {o['appends_per_s']} | {o['gateway_cpu_ms_per_append']} | "
                    f"{o['paced_refused'] or '-'} / {o['refused'] or '-'} |"
                    for w in r["workers"] for o in w["levels"]),
                  "", "Overload: open-loop appends at twice each shape's own flat-out rate.", "",
                  "| API workers | offered /s | accepted /s | refused share | refused | accepted P50 ms "
                  "| accepted P99 ms | send -> first token P50 / P99 ms |",
                  "|---|---|---|---|---|---|---|---|",
                  *(f"| {w['api_workers']} | {w['overload']['offered_per_s']} | {w['overload']['accepted_per_s']} | "
                    f"{w['overload']['refused_share']} | {w['overload']['refused'] or '-'} | "
                    f"{w['overload']['accepted_p50_ms']} | {w['overload']['accepted_p99_ms']} | "
                    f"{w['handoff_ms']['p50']} / {w['handoff_ms']['p99']} |" for w in r["workers"]),
                  "", "The relay through each shape (100 tokens/s each; SSE served by the API workers):", "",
                  "| API workers | sessions | relay P50 ms | relay P99 ms | P50 / P99 ms while all stream "
                  "| the same, settled | CPU ms/token (process tree) |",
                  "|---|---|---|---|---|---|---|",
                  *(f"| {w['api_workers']} | {x['sessions']} | {x['p50']} | {x['p99']} | "
                    f"{_p50_p99(x['all_streaming'])} | {_p50_p99(x.get('settled'))} | "
                    f"{x['gateway_cpu_ms_per_token']} |"
                    for w in r["workers"] for x in w.get("relay", []))]
    if r["profile_top"]:
        lines += ["", "## Where the gateway's CPU goes (py-spy, flat-out appends, self time by package)", "",
                  "| package | % of samples |", "|---|---|",
                  *(f"| `{package}` | {pct} |" for package, pct in r["profile_top"])]
    return "\n".join(lines) + "\n"


def _p50_p99(stats: dict | None) -> str:
    return f"{stats['p50']} / {stats['p99']}" if stats else "-"


def write(results_dir: Path) -> dict:
    parts = {name: json.loads((results_dir / f"{name}.json").read_text()) for name in ("ttft", "floor", "overhead")}
    result = summarize(parts["ttft"], parts["floor"], parts["overhead"])
    plot_ccdf(parts["ttft"]["runs"], results_dir / "ttft_ccdf.png", result["ttft_floor_s"])
    (results_dir / "latest.json").write_text(json.dumps(result, indent=2) + "\n")
    (results_dir / "latest.md").write_text(markdown(result))
    return result
