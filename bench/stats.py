"""Percentiles and CCDFs: the few statistics every benchmark reports."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile by linear interpolation (numpy's default method)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary(values: Sequence[float], digits: int = 3) -> dict[str, float]:
    """p50 / p95 / p99 / max / mean of a sample, rounded for reports."""
    def r(x: float) -> float:
        return round(x, digits)

    return {"n": len(values), "p50": r(percentile(values, 50)), "p95": r(percentile(values, 95)),
            "p99": r(percentile(values, 99)), "max": r(max(values)) if values else math.nan,
            "mean": r(statistics.fmean(values)) if values else math.nan}


def ccdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """Points (x, P[X > x]) of the empirical complementary CDF, for log-scale plots."""
    ordered = sorted(values)
    n = len(ordered)
    return ordered, [(n - i - 1) / n if i < n - 1 else 1 / (2 * n) for i in range(n)]
