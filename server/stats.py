"""Per model-version statistics, shaped like Triton's statistics extension.

Owned by the model's batcher and updated only on the event loop thread, so no locks.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def as_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class BatchStats:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


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
    failures: Counter[str] = field(default_factory=Counter)  # invalid, queue_full, deadline, cancelled, engine
    batch_profile: list[dict[str, float]] = field(default_factory=list)
    batch_cap: int = 0

    def count_failure(self, reason: str) -> None:
        self.failures[reason] += 1

    def record_batch(
        self, batch_size: int, requests: int, input_ns: int, infer_ns: int, output_ns: int
    ) -> None:
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
        }
