"""Timing an engine alone, one way for every figure of it: the build reports' speed against FP32
and the benchmarks' engine ceiling both come from `time_runs`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

WARMUP_RUNS = 3  # first runs pay for allocations and lazy initialisation: not timed
MIN_RUNS = 5  # at least this many, so a slow batch still has a median and a p99


@dataclass
class Timed:
    """Each timed run's latency, the wall time of them all, and (when kept) what each run returned."""

    latencies_s: list[float]
    elapsed_s: float
    returned: list[Any] = field(default_factory=list)


def time_runs(run: Callable[[int], Any], seconds: float, *, min_runs: int = MIN_RUNS, max_runs: int | None = None,
              warmup: int = WARMUP_RUNS, keep: bool = False) -> Timed:
    """`run(i)` back to back after `warmup` untimed runs, until `seconds` have passed and at
    least `min_runs` ran, or `max_runs` did, whichever comes first. `keep`: hold what each run
    returns (a few figures); off, an engine's outputs are dropped as they come, so timing holds
    one batch's outputs at a time, as serving does."""
    for i in range(warmup):
        run(i)
    latencies: list[float] = []
    returned: list[Any] = []
    start = time.perf_counter()
    while max_runs is None or len(latencies) < max_runs:
        before = time.perf_counter()
        result = run(len(latencies))
        after = time.perf_counter()
        if keep:
            returned.append(result)
        del result
        latencies.append(after - before)
        if after - start >= seconds and len(latencies) >= min_runs:
            break
    return Timed(latencies, time.perf_counter() - start, returned)
