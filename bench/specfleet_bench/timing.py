"""Timing side by side: variants run interleaved, rep after rep, so that a burst of load on a
shared machine slows them alike; medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved_medians(variants: dict[str, Callable[[], object]], reps: int, warmup: int = 2) -> dict[str, float]:
    """{name: median milliseconds of one call} over `reps` rounds, each calling every variant once
    in turn, after `warmup` rounds that are not counted."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    for rep in range(reps + warmup):
        for k, fn in variants.items():
            t = time.perf_counter()
            fn()
            if rep >= warmup:
                times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1000 for k, v in times.items()}
