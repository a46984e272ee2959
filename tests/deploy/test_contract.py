"""The metric contract (tests/deploy/contract.py) against the server's own collector, GPU
metrics included, without a GPU: what deploy/ reads is what server/metrics.py writes. (The
end-to-end test checks the rest on a running server: test_prometheus_e2e.py.)"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from server.gpu import GpuReading
from server.heap import HeapPolicy
from server.metrics import BatchlineCollector, exposition
from tests.deploy.contract import CONTRACT, GPU_ONLY


class _NoModels:
    def loaded(self) -> list[object]:
        return []


def scrape(gpus: list[GpuReading], price: float | None, heap: HeapPolicy | None = None) -> dict[str, tuple[str, set[str]]]:
    registry = CollectorRegistry()
    registry.register(BatchlineCollector(_NoModels(), price, gpus=lambda: gpus, heap=heap))  # type: ignore[arg-type]
    found: dict[str, tuple[str, set[str]]] = {}
    for family in text_string_to_metric_families(exposition(registry).decode()):
        for sample in family.samples:
            found[sample.name] = (family.type, set(sample.labels))
    return found


def test_gpu_and_price_metrics_are_the_contracts() -> None:
    reading = GpuReading(index=0, name="NVIDIA H100", utilization_ratio=0.5, memory_used_bytes=1 << 30,
                         memory_total_bytes=80 << 30, power_watts=300.0, temperature_celsius=60.0,
                         energy_joules=1.5e6)
    found = scrape([reading], 2.5)
    for name in [*GPU_ONLY, "batchline_device_price_per_hour"]:
        kind, labels = CONTRACT[name]
        assert name in found, f"{name} is not exported"
        assert found[name][0] == kind, f"{name} is a {found[name][0]}, the contract says {kind}"
        # the server may add labels (the GPUs carry their `name` too); it must keep the contract's
        assert labels <= found[name][1], f"{name}: labels {found[name][1]}, contract {labels}"
    assert scrape([reading], 2.5)["batchline_device_price_per_hour"][1] == {"device"}


def test_no_gpu_metrics_without_a_gpu_and_no_price_without_one() -> None:
    found = scrape([], None)
    assert not set(found) & (set(GPU_ONLY) | {"batchline_device_price_per_hour"})


def test_gc_pauses_are_the_contracts() -> None:
    name = "batchline_gc_pause_seconds"
    kind, labels = CONTRACT[name]
    found = scrape([], None, HeapPolicy())
    for sample in ("_bucket", "_sum", "_count"):
        assert found[name + sample] == (kind, labels | ({"le"} if sample == "_bucket" else set()))
    assert name + "_count" not in scrape([], None), "no policy, no pauses to show"
