"""The Prometheus view of the statistics: exact values, parsed back from the exposition."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from server.config import ModelConfig
from server.gpu import GpuReading
from server.metrics import BatchlineCollector, exposition
from server.stats import Histogram, ModelStatistics


def test_histogram_buckets_are_inclusive_upper_bounds() -> None:
    histogram = Histogram((1, 2, 4))
    for value in (1, 1.5, 2, 3, 9):
        histogram.observe(value)
    assert histogram.cumulative() == [("1", 1), ("2", 3), ("4", 4), ("+Inf", 5)]
    assert histogram.sum == 16.5 and histogram.count == 5


CONFIG = ModelConfig.model_validate(
    {
        "name": "toy",
        "engine": "onnxruntime",
        "max_batch_size": 8,
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [1]}],
    }
)


@dataclass
class StubVersion:
    version: int = 1
    config: ModelConfig = CONFIG
    stats: ModelStatistics = field(default_factory=ModelStatistics)
    queue_depth: int = 3
    pending_requests: int = 4
    batches_in_flight: int = 1
    ready: bool = True


class StubRepository:
    def __init__(self, *versions: StubVersion) -> None:
        self._versions = list(versions)

    def loaded(self) -> list[StubVersion]:
        return self._versions


def scrape(collector: BatchlineCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(collector)
    samples = {}
    for family in text_string_to_metric_families(exposition(registry).decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def labels(**extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"model": "toy", "version": "1", **extra}.items()))


def test_every_model_metric_moves_exactly_with_the_statistics() -> None:
    version = StubVersion()
    stats = version.stats
    stats.success.add(5_000_000, 2)
    stats.count_failure("deadline")
    stats.count_failure("invalid")
    stats.count_failure("invalid")
    stats.record_queued(2_000_000)
    stats.record_queued(30_000_000)
    stats.record_batch(3, 2, 1_000_000, 8_000_000, 1_000_000)
    stats.record_busy("toy-1-0", 10_000_000)
    stats.dispatch_reasons["idle"] += 1
    stats.request_seconds.observe(0.004)
    samples = scrape(BatchlineCollector(StubRepository(version), gpus=list))

    assert samples[("batchline_requests_total", labels(outcome="success"))] == 2
    assert samples[("batchline_requests_total", labels(outcome="invalid"))] == 2
    assert samples[("batchline_requests_total", labels(outcome="deadline"))] == 1
    assert samples[("batchline_requests_total", labels(outcome="queue_full"))] == 0
    assert samples[("batchline_inferences_total", labels())] == 3
    assert samples[("batchline_batches_total", labels())] == 1
    assert samples[("batchline_dispatch_total", labels(reason="idle"))] == 1
    assert samples[("batchline_instance_busy_seconds_total", labels(model_instance="toy-1-0"))] == pytest.approx(0.01)
    assert samples[("batchline_queue_duration_seconds_count", labels())] == 2
    assert samples[("batchline_queue_duration_seconds_sum", labels())] == pytest.approx(0.032)
    assert samples[("batchline_queue_duration_seconds_bucket", labels(le="0.0025"))] == 1
    assert samples[("batchline_queue_duration_seconds_bucket", labels(le="0.05"))] == 2
    assert samples[("batchline_compute_duration_seconds_sum", labels())] == pytest.approx(0.01)
    assert samples[("batchline_batch_size_bucket", labels(le="2"))] == 0
    assert samples[("batchline_batch_size_bucket", labels(le="4"))] == 1
    assert samples[("batchline_request_duration_seconds_count", labels())] == 1
    assert samples[("batchline_queue_depth", labels())] == 3
    assert samples[("batchline_pending_requests", labels())] == 4
    assert samples[("batchline_batches_in_flight", labels())] == 1
    assert samples[("batchline_model_ready", labels())] == 1


def test_gpu_counters_and_price_appear_only_when_present() -> None:
    without = scrape(BatchlineCollector(StubRepository(), gpus=list))
    assert not any(name.startswith("batchline_gpu") for name, _ in without)
    assert not any(name == "batchline_device_price_per_hour" for name, _ in without)
    gpu = GpuReading(0, "H200", 0.75, 10 << 30, 141 << 30, 300.5, 55.0, 1234.5)
    partial = GpuReading(1, "H200", None, 1, 2, None, None, None)
    samples = scrape(BatchlineCollector(StubRepository(), 2.5, gpus=lambda: [gpu, partial]))
    first = (("gpu", "0"), ("name", "H200"))
    assert samples[("batchline_gpu_utilization_ratio", first)] == 0.75
    assert samples[("batchline_gpu_memory_total_bytes", first)] == 141 << 30
    assert samples[("batchline_gpu_energy_joules_total", first)] == 1234.5
    assert ("batchline_gpu_power_watts", (("gpu", "1"), ("name", "H200"))) not in samples
    assert samples[("batchline_device_price_per_hour", (("device", "gpu"),))] == 2.5


def test_a_reload_carries_every_total_and_adds_what_the_old_version_counted_after_the_swap() -> None:
    def busy(stats: ModelStatistics, size: int) -> None:
        stats.record_queued(1_000)
        stats.record_batch(size, 1, 10, 20, 30)
        stats.record_success(2_000)
        stats.record_busy("m-1-0", 500)
        stats.count_failure("deadline", 300)
        stats.dispatch_reasons["full"] += 1
        stats.memory_splits += 1

    old = ModelStatistics(batch_cap=8, instances_in_service=1)
    busy(old, 4)
    fresh = ModelStatistics(batch_cap=16, instances_in_service=2)
    fresh.carry_totals(old)
    at_swap = old.totals()
    busy(old, 2)  # drained after the swap
    busy(fresh, 4)
    fresh.carry_totals(old, since=at_swap)
    whole = ModelStatistics()
    for size in (4, 2, 4):
        busy(whole, size)
    dropped = ("last_inference", "batch_cap", "batch_profile", "instances")
    assert {k: v for k, v in fresh.as_dict("m", 1).items() if k not in dropped} == \
        {k: v for k, v in whole.as_dict("m", 1).items() if k not in dropped}
    assert (fresh.batch_cap, fresh.instances_in_service) == (16, 2)  # its own state, not carried
    for name in ("request_seconds", "queue_seconds", "compute_seconds", "batch_sizes"):
        assert vars(getattr(fresh, name)) == vars(getattr(whole, name)), name
    assert fresh.instance_busy_ns == whole.instance_busy_ns and fresh.memory_splits == 3
