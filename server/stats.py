"""Per model-version statistics: the one record both the statistics extension and /metrics read.

Owned by the model's batcher and model, updated only on the event loop thread, so no locks.
Plain Python, no Prometheus: `server/metrics.py` turns it into metric families at scrape time,
so the hot path pays one bisect per histogram and the two views always agree.

A reload replaces a version with a new one of the same number: its counts go on from the old
one's (`carry_totals`), as the one series Prometheus scrapes under the same labels, and what the
old one answers while it drains after the swap is added when it is done.
"""

from __future__ import annotations

import copy
import time
from bisect import bisect_left
from collections import Counter, defaultdict
from dataclasses import dataclass, field

SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
OUTCOMES = ("success", "invalid", "queue_full", "deadline", "cancelled", "engine_error")


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def as_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


class Histogram:
    """Counts per upper bound (Prometheus' `le`, inclusive), plus sum and count."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last slot is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs, +Inf last, as the exposition format wants them."""
        running, pairs = 0, []
        for bound, count in zip([*map(_le, self.bounds), "+Inf"], self.counts):
            running += count
            pairs.append((bound, running))
        return pairs


def _le(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() and bound >= 1 else repr(float(bound))


@dataclass
class BatchStats:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


# What a version counts, as opposed to its state (batch cap and profile, instances now in
# service or stuck, their working caps): what a reload carries on.
_TOTALS = (
    "inference_count", "execution_count", "success", "fail", "queue", "compute_input", "compute_infer",
    "compute_output", "batches", "dispatch_reasons", "failures", "instance_busy_ns", "request_seconds",
    "queue_seconds", "compute_seconds", "batch_sizes", "instances_abandoned", "instances_replaced", "memory_splits",
)


@dataclass
class ModelStatistics:
    inference_count: int = 0  # items inferred (a request of batch 4 counts 4)
    execution_count: int = 0  # batches run
    last_inference_ms: int = 0
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    batches: dict[int, BatchStats] = field(default_factory=lambda: defaultdict(BatchStats))
    dispatch_reasons: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)  # keys: OUTCOMES but success
    batch_profile: list[dict[str, float]] = field(default_factory=list)
    batch_cap: int = 0
    instance_busy_ns: Counter[str] = field(default_factory=Counter)
    request_seconds: Histogram = field(default_factory=lambda: Histogram(SECONDS_BUCKETS))
    queue_seconds: Histogram = field(default_factory=lambda: Histogram(SECONDS_BUCKETS))
    compute_seconds: Histogram = field(default_factory=lambda: Histogram(SECONDS_BUCKETS))
    batch_sizes: Histogram = field(default_factory=lambda: Histogram(BATCH_SIZE_BUCKETS))
    # Faults: instances taken out of service by the watchdog, their replacements, and the
    # working batch caps that running out of memory lowered.
    instances_in_service: int = 0
    instances_abandoned: int = 0  # batches past execution_timeout_seconds: each retires its instance
    instances_replaced: int = 0  # fresh instances, warmed up, that took a stuck one's place
    instances_stuck: int = 0  # abandoned threads still inside their engine now
    memory_splits: int = 0  # batches halved after running out of memory
    instance_batch_caps: dict[str, int] = field(default_factory=dict)  # in-service instance -> working cap

    def count_failure(self, reason: str, ns: int = 0) -> None:
        """One request failed, for `reason`, `ns` after the model received it where that is
        known (0 for a refusal): `fail` counts them all (Triton's field), `failures` by kind."""
        assert reason in OUTCOMES and reason != "success", reason
        self.failures[reason] += 1
        self.fail.add(ns)

    def record_success(self, ns: int) -> None:
        """One request answered with results `ns` after the model received it: the statistics'
        success duration and the request histogram read the same clock at the same points."""
        self.success.add(ns)
        self.request_seconds.observe(ns / 1e9)

    def record_queued(self, ns: int) -> None:
        """One request left the queue for an instance after `ns`."""
        self.queue.add(ns)
        self.queue_seconds.observe(ns / 1e9)

    def record_batch(self, batch_size: int, requests: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        """One execution; request-level compute stats count each request once, as Triton does."""
        self.execution_count += 1
        self.inference_count += batch_size
        self.last_inference_ms = time.time_ns() // 1_000_000
        self.compute_input.add(input_ns * requests, requests)
        self.compute_infer.add(infer_ns * requests, requests)
        self.compute_output.add(output_ns * requests, requests)
        per_size = self.batches[batch_size]
        per_size.compute_input.add(input_ns)
        per_size.compute_infer.add(infer_ns)
        per_size.compute_output.add(output_ns)
        self.compute_seconds.observe((input_ns + infer_ns + output_ns) / 1e9)
        self.batch_sizes.observe(batch_size)

    def record_busy(self, instance: str, ns: int) -> None:
        self.instance_busy_ns[instance] += ns

    def totals(self) -> ModelStatistics:
        """A copy of what this has counted so far (its state, caps and instances left out)."""
        taken = ModelStatistics()
        for name in _TOTALS:
            setattr(taken, name, copy.deepcopy(getattr(self, name)))
        return taken

    def carry_totals(self, other: ModelStatistics, since: ModelStatistics | None = None) -> None:
        """Add what `other` counted (since `since`, a `totals()` of it taken earlier)."""
        before = since or ModelStatistics()
        for name in _TOTALS:
            mine, theirs, old = getattr(self, name), getattr(other, name), getattr(before, name)
            if isinstance(mine, int):
                setattr(self, name, mine + theirs - old)
            elif isinstance(mine, Duration):
                mine.add(theirs.ns - old.ns, theirs.count - old.count)
            elif isinstance(mine, Histogram):
                mine.counts = [a + b - c for a, b, c in zip(mine.counts, theirs.counts, old.counts, strict=True)]
                mine.sum += theirs.sum - old.sum
                mine.count += theirs.count - old.count
            elif isinstance(mine, Counter):
                mine.update(theirs)
                mine.subtract(old)
                for key in [k for k, v in mine.items() if not v]:
                    del mine[key]
            else:  # batches: batch size -> its three durations
                for size, batch in theirs.items():
                    earlier = old.get(size, BatchStats())
                    for part in ("compute_input", "compute_infer", "compute_output"):
                        now, then = getattr(batch, part), getattr(earlier, part)
                        getattr(mine[size], part).add(now.ns - then.ns, now.count - then.count)
        self.last_inference_ms = max(self.last_inference_ms, other.last_inference_ms)

    def as_dict(self, name: str, version: int) -> dict[str, object]:
        return {
            "name": name,
            "version": str(version),
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.as_dict(),
                "fail": self.fail.as_dict(),
                "queue": self.queue.as_dict(),
                "compute_input": self.compute_input.as_dict(),
                "compute_infer": self.compute_infer.as_dict(),
                "compute_output": self.compute_output.as_dict(),
                "cache_hit": Duration().as_dict(),
                "cache_miss": Duration().as_dict(),
            },
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": s.compute_input.as_dict(),
                    "compute_infer": s.compute_infer.as_dict(),
                    "compute_output": s.compute_output.as_dict(),
                }
                for size, s in sorted(self.batches.items())
            ],
            "memory_usage": [],
            # Batchline's additions; Triton clients ignore unknown fields.
            "dispatch_reasons": {str(k): v for k, v in self.dispatch_reasons.items()},
            "failures": dict(self.failures),
            "batch_cap": self.batch_cap,
            "batch_profile": self.batch_profile,
            "instances": {
                "in_service": self.instances_in_service,
                "stuck": self.instances_stuck,
                "timed_out": self.instances_abandoned,
                "replaced": self.instances_replaced,
                "batch_caps": dict(sorted(self.instance_batch_caps.items())),
            },
            "memory_splits": self.memory_splits,
        }
