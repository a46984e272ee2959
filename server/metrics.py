"""Prometheus metrics: the only module that knows Prometheus.

A custom collector reads each model version's statistics (server/stats.py) at scrape time, so
the hot path never touches prometheus-client and /metrics always agrees with the statistics
extension. The GPUs are not read at scrape time: NVML calls block, and the scrape runs on the
event loop, so a `GpuSampler` reads them on its own thread and the scrape shows its last reading
and that reading's age. Names follow Prometheus conventions: base units, `_total` counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from server.gpu import GpuReading, GpuSampler
from server.heap import HeapPolicy
from server.repository import ModelRepository
from server.stats import OUTCOMES, Histogram

MODEL_LABELS = ["model", "version"]
CONTENT_TYPE = CONTENT_TYPE_LATEST


class BatchlineCollector(Collector):
    """Model statistics, GPU counters, the device price and garbage-collector pauses, at scrape time.

    The GPUs come from `sampler` (its last reading, never a blocking NVML call), or from `gpus`,
    a callable that must answer at once (fixed readings in tests); neither: no GPU metrics.
    """

    def __init__(
        self,
        repository: ModelRepository,
        price_per_hour: float | None = None,
        gpus: Callable[[], list[GpuReading]] | None = None,
        sampler: GpuSampler | None = None,
        heap: HeapPolicy | None = None,
    ) -> None:
        self._repository = repository
        self._price = price_per_hour
        self._gpus = gpus
        self._sampler = sampler
        self._heap = heap

    def collect(self) -> Iterator[Metric]:
        yield from self._model_metrics()
        gpus = self._gpus() if self._gpus is not None else []
        on_gpu = bool(gpus)
        if self._sampler is not None and (sample := self._sampler.sample()) is not None:
            gpus, on_gpu = sample.readings, True  # a GPU was seen, even if its reading is stale now
            age = GaugeMetricFamily(
                "batchline_gpu_reading_age_seconds",
                "Seconds since the GPU counters were read; past the sampler's max age (a hung NVML call),"
                " the counters are left out.",
            )
            age.add_metric([], sample.age_s)
            yield age
        yield from _gpu_metrics(gpus)
        if self._price is not None:
            price = GaugeMetricFamily(
                "batchline_device_price_per_hour", "Configured price of this replica's device per hour.", labels=["device"]
            )
            price.add_metric(["gpu" if on_gpu else "cpu"], self._price)
            yield price
        if self._heap is not None:
            pauses = HistogramMetricFamily(
                "batchline_gc_pause_seconds",
                "Garbage-collector pauses by generation; each stops the thread that triggered it, often the event loop.",
                labels=["generation"],
            )
            for generation, histogram in self._heap.pauses.items():
                _add(pauses, [str(generation)], histogram)
            yield pauses

    def _model_metrics(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("batchline_requests", "Requests by outcome.", labels=[*MODEL_LABELS, "outcome"])
        inferences = CounterMetricFamily("batchline_inferences", "Items inferred (batch rows).", labels=MODEL_LABELS)
        batches = CounterMetricFamily("batchline_batches", "Batches executed.", labels=MODEL_LABELS)
        dispatch = CounterMetricFamily("batchline_dispatch", "Batches by dispatch reason.", labels=[*MODEL_LABELS, "reason"])
        busy = CounterMetricFamily(
            "batchline_instance_busy_seconds", "Time each instance spent running batches.", labels=[*MODEL_LABELS, "model_instance"]
        )
        histograms = {
            "request": _histogram(
                "batchline_request_duration_seconds", "Successful requests, receipt to results (the statistics' success)."
            ),
            "queue": _histogram("batchline_queue_duration_seconds", "Time waiting for an instance, per request."),
            "compute": _histogram("batchline_compute_duration_seconds", "Batch assembly, engine and split, per batch."),
            "batch": _histogram("batchline_batch_size", "Items per executed batch."),
        }
        queue_depth = GaugeMetricFamily("batchline_queue_depth", "Requests waiting for an instance.", labels=MODEL_LABELS)
        pending = GaugeMetricFamily("batchline_pending_requests", "Requests taken in and not yet answered: in admission off the event loop, queued, computing, or held for ordering.", labels=MODEL_LABELS)
        in_flight = GaugeMetricFamily("batchline_batches_in_flight", "Batches running now.", labels=MODEL_LABELS)
        ready = GaugeMetricFamily("batchline_model_ready", "1 when the version serves.", labels=MODEL_LABELS)
        in_service = GaugeMetricFamily(
            "batchline_instances_in_service", "Instances taking batches (stuck ones retired are not).", labels=MODEL_LABELS
        )
        stuck = GaugeMetricFamily(
            "batchline_instances_stuck", "Instances abandoned by the watchdog whose thread is still in the engine.",
            labels=MODEL_LABELS,
        )
        timeouts = CounterMetricFamily(
            "batchline_execution_timeouts",
            "Batches past execution_timeout_seconds; each took its instance out of service.", labels=MODEL_LABELS,
        )
        replaced = CounterMetricFamily(
            "batchline_instances_replaced", "Fresh instances, warmed up, that took a stuck one's place.", labels=MODEL_LABELS
        )
        splits = CounterMetricFamily(
            "batchline_memory_splits", "Batches halved and retried after the engine ran out of memory.", labels=MODEL_LABELS
        )
        caps = GaugeMetricFamily(
            "batchline_instance_batch_cap", "Most items an instance takes in one batch (lowered when memory ran out).",
            labels=[*MODEL_LABELS, "model_instance"],
        )
        for model in self._repository.loaded():
            labels = [model.config.name, str(model.version)]
            stats = model.stats
            for outcome in OUTCOMES:
                count = stats.success.count if outcome == "success" else stats.failures.get(outcome, 0)
                requests.add_metric([*labels, outcome], count)
            inferences.add_metric(labels, stats.inference_count)
            batches.add_metric(labels, stats.execution_count)
            for reason, count in sorted(stats.dispatch_reasons.items()):
                dispatch.add_metric([*labels, str(reason)], count)
            for instance, ns in sorted(stats.instance_busy_ns.items()):
                busy.add_metric([*labels, instance], ns / 1e9)
            _add(histograms["request"], labels, stats.request_seconds)
            _add(histograms["queue"], labels, stats.queue_seconds)
            _add(histograms["compute"], labels, stats.compute_seconds)
            _add(histograms["batch"], labels, stats.batch_sizes)
            queue_depth.add_metric(labels, model.queue_depth)
            pending.add_metric(labels, model.pending_requests)
            in_flight.add_metric(labels, model.batches_in_flight)
            ready.add_metric(labels, 1.0 if model.ready else 0.0)
            in_service.add_metric(labels, stats.instances_in_service)
            stuck.add_metric(labels, stats.instances_stuck)
            timeouts.add_metric(labels, stats.instances_abandoned)
            replaced.add_metric(labels, stats.instances_replaced)
            splits.add_metric(labels, stats.memory_splits)
            for instance, cap in sorted(stats.instance_batch_caps.items()):
                caps.add_metric([*labels, instance], cap)
        yield from (requests, inferences, batches, dispatch, busy, *histograms.values(), queue_depth, pending, in_flight, ready)
        yield from (in_service, stuck, timeouts, replaced, splits, caps)


def _histogram(name: str, documentation: str) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, documentation, labels=MODEL_LABELS)


def _add(family: HistogramMetricFamily, labels: list[str], histogram: Histogram) -> None:
    family.add_metric(labels, histogram.cumulative(), histogram.sum)


def _gpu_metrics(gpus: list[GpuReading]) -> Iterator[Metric]:
    """The counters of the GPUs this process may use, labelled `gpu` by CUDA index (`gpu="N"` for
    `cuda:N`, as instance groups and engines name them; server/gpu.py maps it to NVML's host-wide index)."""
    if not gpus:
        return
    fields: list[tuple[str, str, str, bool]] = [
        ("batchline_gpu_utilization_ratio", "utilization_ratio", "Share of time a kernel ran.", False),
        ("batchline_gpu_memory_used_bytes", "memory_used_bytes", "Device memory in use.", False),
        ("batchline_gpu_memory_total_bytes", "memory_total_bytes", "Device memory in all.", False),
        ("batchline_gpu_power_watts", "power_watts", "Power draw.", False),
        ("batchline_gpu_temperature_celsius", "temperature_celsius", "Core temperature.", False),
        ("batchline_gpu_energy_joules", "energy_joules", "Energy used since the driver loaded.", True),
    ]
    for name, attribute, documentation, counter in fields:
        family_type = CounterMetricFamily if counter else GaugeMetricFamily
        family = family_type(name.removesuffix("_total"), documentation, labels=["gpu", "name"])
        for gpu in gpus:
            value = getattr(gpu, attribute)
            if value is not None:
                family.add_metric([str(gpu.index), gpu.name], value)
        yield family


def build_registry(
    repository: ModelRepository,
    price_per_hour: float | None = None,
    sampler: GpuSampler | None = None,
    heap: HeapPolicy | None = None,
) -> CollectorRegistry:
    """The server's registry; the GPUs are read by `sampler`, by default one started here (its
    thread ends at once where there is no NVML)."""
    registry = CollectorRegistry()
    gpus = sampler if sampler is not None else GpuSampler().start()
    registry.register(BatchlineCollector(repository, price_per_hour, sampler=gpus, heap=heap))
    ProcessCollector(registry=registry)
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
