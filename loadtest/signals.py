"""The server's own view of a measurement window: queue, compute and busy time, from two snapshots.

An autoscaler cannot see client latency; it sees what the server exports. So each bench window
is bracketed by two reads of the server's counters, and the difference says what the queue
signal read while the load was on: that is what an HPA/KEDA target is set from.

Two sources, the first that answers:
  /metrics (Prometheus text, parsed with prometheus_client.parser): batchline_queue_duration_seconds
      and batchline_compute_duration_seconds (_sum, _count), batchline_queue_depth (a gauge,
      sampled during the window), batchline_instance_busy_seconds_total,
      batchline_device_price_per_hour;
  GET /v2/models/{m}/stats (the statistics extension, Triton's too): inference_stats.queue and
      .compute_infer {count, ns}, inference_count, execution_count.
Counters are summed over a model's versions. Mean queue depth is Little's law over the window
(queue-seconds accrued / seconds elapsed): exact, where a sampled gauge only estimates it.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Self

Samples = dict[str, list[tuple[dict[str, str], float]]]  # sample name -> (labels, value) pairs

QUEUE_SUM = "batchline_queue_duration_seconds_sum"
QUEUE_COUNT = "batchline_queue_duration_seconds_count"
COMPUTE_SUM = "batchline_compute_duration_seconds_sum"
COMPUTE_COUNT = "batchline_compute_duration_seconds_count"
BUSY = "batchline_instance_busy_seconds_total"
QUEUE_DEPTH = "batchline_queue_depth"
PRICE = "batchline_device_price_per_hour"


def _get(url: str, timeout: float) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.read() if reply.status == 200 else None
    except (OSError, urllib.error.URLError, ValueError):
        return None


def parse_metrics(text: str) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return samples


def read_metrics(url: str, timeout: float = 5.0) -> Samples | None:
    """/metrics as samples; None when the server has none (404, not Prometheus, no batchline_*)."""
    body = _get(url.rstrip("/") + "/metrics", timeout)
    if body is None:
        return None
    try:
        samples = parse_metrics(body.decode("utf-8", "replace"))
    except (ValueError, ImportError):
        return None
    return samples if any(name.startswith("batchline_") for name in samples) else None


def read_stats(url: str, model: str, timeout: float = 5.0) -> dict[str, float] | None:
    """The statistics extension's counters for `model`, summed over its versions."""
    body = _get(f"{url.rstrip('/')}/v2/models/{model}/stats", timeout)
    if body is None:
        return None
    try:
        entries = json.loads(body)["model_stats"]
        totals: dict[str, float] = {"inference_count": 0.0, "execution_count": 0.0}
        for entry in entries:
            totals["inference_count"] += entry.get("inference_count", 0)
            totals["execution_count"] += entry.get("execution_count", 0)
            for key in ("success", "queue", "compute_infer"):
                duration = entry["inference_stats"][key]
                totals[f"{key}_count"] = totals.get(f"{key}_count", 0.0) + duration["count"]
                totals[f"{key}_ns"] = totals.get(f"{key}_ns", 0.0) + duration["ns"]
        return totals if entries else None
    except (ValueError, KeyError, TypeError):
        return None


def model_total(samples: Samples, name: str, model: str) -> float | None:
    """Sum of `name` over the samples labelled model=`model`; None when there is none."""
    values = [value for labels, value in samples.get(name, []) if labels.get("model") == model]
    return sum(values) if values else None


@dataclass
class Snapshot:
    at: float  # time.monotonic() when read
    stats: dict[str, float] | None
    metrics: Samples | None


def snapshot(url: str, model: str, timeout: float = 5.0) -> Snapshot:
    metrics = read_metrics(url, timeout)
    stats = read_stats(url, model, timeout)
    return Snapshot(time.monotonic(), stats, metrics)


@dataclass
class GaugeSampler:
    """Reads one gauge of /metrics every `interval_s` on a thread while the load runs."""

    url: str
    model: str
    name: str = QUEUE_DEPTH
    interval_s: float = 0.5
    values: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Self:
        self._thread = threading.Thread(target=self._run, name="gauge-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            samples = read_metrics(self.url, timeout=min(2.0, self.interval_s * 4))
            value = model_total(samples, self.name, self.model) if samples else None
            if value is not None:
                self.values.append(value)

    def summary(self) -> dict[str, float | int] | None:
        if not self.values:
            return None
        return {"mean": round(sum(self.values) / len(self.values), 3), "max": max(self.values),
                "samples": len(self.values)}


def _ratio(numerator: float | None, denominator: float | None, digits: int = 4) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, digits)


def _delta(before: dict[str, float] | Samples | None, after: dict[str, float] | Samples | None,
           key: str, model: str | None = None) -> float | None:
    if before is None or after is None:
        return None
    if model is None:
        a, b = after.get(key), before.get(key)  # type: ignore[union-attr]
    else:
        a, b = model_total(after, key, model), model_total(before, key, model)  # type: ignore[arg-type]
        b = 0.0 if b is None and a is not None else b  # a model's first window: no sample before
    return None if a is None or b is None else float(a) - float(b)  # type: ignore[arg-type]


def window(before: Snapshot, after: Snapshot, model: str, gauge: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the server's signals read over the window between two snapshots.

    queue_depth_mean: mean requests waiting (Little's law); queue_per_compute: queue-seconds per
    compute-second (/metrics: compute is per batch, so this is waiting requests per busy
    instance; the statistics extension counts compute once per request, so there it is mean
    wait / mean compute per request); busy_fraction: share of the window each instance ran
    batches (/metrics only)."""
    seconds = max(after.at - before.at, 1e-9)
    out: dict[str, Any] = {"window_s": round(seconds, 3), "source": None}
    stats_queue_s = _delta(before.stats, after.stats, "queue_ns")
    if stats_queue_s is not None:
        stats_queue_s /= 1e9
        compute_s = (_delta(before.stats, after.stats, "compute_infer_ns") or 0.0) / 1e9
        queued = _delta(before.stats, after.stats, "queue_count") or 0.0
        computed = _delta(before.stats, after.stats, "compute_infer_count") or 0.0
        executions = _delta(before.stats, after.stats, "execution_count") or 0.0
        out["stats"] = {
            "requests": int(queued),
            "mean_queue_ms": _ratio(stats_queue_s * 1000, queued, 3),
            "mean_compute_infer_ms": _ratio(compute_s * 1000, computed, 3),
            "queue_per_compute": _ratio(stats_queue_s, compute_s),
            "queue_depth_mean": round(stats_queue_s / seconds, 4),
            "items_per_execution": _ratio(_delta(before.stats, after.stats, "inference_count"), executions, 2),
        }
        out["source"] = "stats"
    queue_s = _delta(before.metrics, after.metrics, QUEUE_SUM, model)
    if queue_s is not None and after.metrics is not None:
        metrics_compute_s = _delta(before.metrics, after.metrics, COMPUTE_SUM, model)
        busy_s = _delta(before.metrics, after.metrics, BUSY, model)
        instances = len({labels.get("model_instance") for labels, _ in after.metrics.get(BUSY, [])
                         if labels.get("model") == model})
        price = [value for _, value in after.metrics.get(PRICE, [])]
        out["metrics"] = {
            "requests": int(_delta(before.metrics, after.metrics, QUEUE_COUNT, model) or 0),
            "batches": int(_delta(before.metrics, after.metrics, COMPUTE_COUNT, model) or 0),
            "queue_per_compute": _ratio(queue_s, metrics_compute_s),
            "queue_depth_mean": round(queue_s / seconds, 4),
            "queue_depth_gauge": gauge,
            "instances": instances or None,
            "busy_fraction": _ratio(busy_s, seconds * instances, 4) if busy_s is not None and instances else None,
            "price_per_hour": price[0] if price else None,
        }
        out["source"] = "metrics"
    chosen = out.get(out["source"] or "", {})
    out["queue_per_compute"] = chosen.get("queue_per_compute")
    out["queue_depth_mean"] = chosen.get("queue_depth_mean")
    out["busy_fraction"] = out.get("metrics", {}).get("busy_fraction")
    return out
