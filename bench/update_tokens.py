"""Update mode's token count per PUT: the whole input (before issue 29) vs from the chunk's mark.

SmolLM2's tokenizer (the engine's, without the engine), one process, no
Redis: only the counting a PUT does. A session of ``N`` text chunks (each a
sentence of ~55 characters) has its last chunk replaced; before issue 29 a
PUT tokenized the whole old and new input (``common_prefix_tokens``), now it
tokenizes the mark's pending bytes and the chunks from the replaced one on
(``token_marks.count_update``), and each append marks the next chunk
(``token_marks.advance``). Both counts are checked equal.

    python -m bench.update_tokens        # writes results/update_tokens.{json,md}
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median

from bench.procs import write_results
from gateway.service.token_marks import START, count_update, marks_along
from gateway.store.records import ChunkRecord
from omni_adapter.model_bootstrap import ensure_default_model
from omni_adapter.scripted import text_capabilities
from omni_adapter.vllm_engine import load_tokenizer_checks

RESULTS = Path(__file__).parent / "results"
LENGTHS = (10, 100, 1_000, 5_000)
REPEATS = 15


def sentence(i: int) -> str:
    return f"Retrieved passage {i} says the answer may be {i * 7}; "


def main() -> None:
    checks = load_tokenizer_checks(str(ensure_default_model()), 1 << 20, text_capabilities())
    rows = []
    for n in LENGTHS:
        chunks = [sentence(i).encode() for i in range(n)]
        stored = [ChunkRecord(i, "text", c) for i, c in enumerate(chunks)]
        new = ChunkRecord(n - 1, "text", b"Retrieved passage revised; ")
        old_text = b"".join(chunks).decode()
        new_text = b"".join([*chunks[:-1], new.payload]).decode()
        marks = [START, *marks_along(checks, START, chunks)]

        calls: dict[str, Callable[[], object]] = {
            "whole": functools.partial(checks.common_prefix_tokens, old_text, new_text),
            "mark": functools.partial(count_update, checks, marks[n - 1], stored[n - 1:], new),
            "append": functools.partial(marks_along, checks, marks[n - 1], chunks[n - 1:]),
        }
        assert calls["whole"]() == count_update(checks, marks[n - 1], stored[n - 1:], new)[:2], "counts differ"
        timings = {}
        for name, call in calls.items():
            samples = []
            for _ in range(REPEATS):
                started = time.perf_counter()
                call()
                samples.append((time.perf_counter() - started) * 1000)
            timings[name] = round(median(samples), 3)
        total = checks.common_prefix_tokens(old_text, new_text)[1]
        rows.append({"chunks": n, "chars": len(old_text), "tokens": total,
                     "put_whole_ms": timings["whole"], "put_from_mark_ms": timings["mark"],
                     "append_mark_ms": timings["append"],
                     "ratio": round(timings["whole"] / timings["mark"], 1)})
    lines = ["| chunks | characters | tokens | PUT, whole input (ms) | PUT, from the mark (ms) | ratio "
             "| append: next mark (ms) |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['chunks']:,} | {r['chars']:,} | {r['tokens']:,} | {r['put_whole_ms']} | "
              f"{r['put_from_mark_ms']} | {r['ratio']}x | {r['append_mark_ms']} |" for r in rows]
    write_results(RESULTS, "update_tokens", {"repeats": REPEATS, "rows": rows},
                  f"Median of {REPEATS} runs per cell, one process.\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
