"""An append-mode (crawler-like) workload, as in Stream2LLM (seed 002).

A query is K pages of real English text that arrive one by one, like a
retriever or crawler appending documents to the context while the user
waits. The text is CPython's own documentation (``pydoc_data/topics.py``,
shipped with every Python: no downloads). Gaps between pages are lognormal
(heavy-tailed) with a 700 ms median, like the paper's crawler traces; queries
arrive as a Poisson process.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

#: The paper's median gap between appended pages.
MEDIAN_GAP_SEC = 0.7
#: Spread of the lognormal: p90 ~2.5 s, p99 ~7 s before the cap.
GAP_SIGMA = 1.0
#: Cap one gap so a run stays a few minutes long.
MAX_GAP_SEC = 4.0


@dataclass(frozen=True)
class Query:
    #: When the query starts, in seconds after the run starts.
    arrival_sec: float
    pages: tuple[str, ...]
    #: Wait before each page (the first one is sent at arrival).
    gaps_sec: tuple[float, ...]


def english_pages(page_chars: int) -> list[str]:
    """CPython's topic docs cut into pages of about ``page_chars`` characters, on word boundaries."""
    from pydoc_data.topics import topics

    pages: list[str] = []
    for text in topics.values():
        words = text.split()
        page: list[str] = []
        size = 0
        for word in words:
            page.append(word)
            size += len(word) + 1
            if size >= page_chars:
                pages.append(" ".join(page) + " ")
                page, size = [], 0
    return pages


class PageSource:
    """Hands out pages without repeats, so no query hits another one's prefix cache."""

    def __init__(self, page_chars: int, seed: int) -> None:
        self._pages = english_pages(page_chars)
        random.Random(seed).shuffle(self._pages)
        self._next = 0

    def take(self, count: int, label: str) -> tuple[str, ...]:
        if self._next + count > len(self._pages):
            self._next = 0  # reused text: the label below still makes the prompt unique
        pages = self._pages[self._next:self._next + count]
        self._next += count
        # A unique opening makes every cache block of this query unique too
        # (vLLM chains block hashes), even when pages repeat.
        return (f"[{label}] {pages[0]}", *pages[1:])


def make_trace(source: PageSource, *, queries: int, pages_per_query: int, rate_per_sec: float,
               seed: int, label: str) -> list[Query]:
    """``queries`` Poisson arrivals at ``rate_per_sec`` with heavy-tailed page gaps."""
    rng = random.Random(seed)
    trace: list[Query] = []
    clock = 0.0
    for n in range(queries):
        gaps = (0.0, *(min(MAX_GAP_SEC, rng.lognormvariate(0.0, GAP_SIGMA) * MEDIAN_GAP_SEC)
                       for _ in range(pages_per_query - 1)))
        trace.append(Query(clock, source.take(pages_per_query, f"{label}-{n}"), gaps))
        clock += rng.expovariate(rate_per_sec)
    return trace
