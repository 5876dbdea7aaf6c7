"""Percentiles for the benchmarks: one definition of each method, so figures compare across benches.

- `nearest_rank`: the sorted sample at rank round(q% of n-1) (gateway, cache and pipeline benches:
  latency samples in milliseconds, p100 is the maximum);
- `inclusive`: `statistics.quantiles(..., method="inclusive")`, interpolated (worker and engine
  benches: TTFT and inter-token latency in seconds).
"""

from __future__ import annotations

import statistics


def nearest_rank(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def inclusive(xs: list[float], p: int) -> float | None:
    """The p-th percentile (1-99), interpolated, to 4 decimals; None for fewer than two values."""
    return round(statistics.quantiles(xs, n=100, method="inclusive")[p - 1], 4) if len(xs) > 1 else None
