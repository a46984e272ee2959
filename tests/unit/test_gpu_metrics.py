"""GPU metrics survive a lost GPU and a hung NVML: each NVML call is guarded on its own (a
failing one drops its reading, never the scrape), and NVML is read on a thread of its own, so a
hung call stalls neither /metrics nor the event loop every request shares. NVML is faked (no
GPU here), in the manner of the fake in tests/unit/quantize/test_quantize_device.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from server import gpu
from server.dataplane import DataPlane
from server.gpu import GpuReading, GpuSampler, read_gpus
from server.http.app import create_app
from server.metrics import BatchlineCollector, build_registry, exposition
from server.repository import ModelRepository

T = TypeVar("T")
HANG_LIMIT_S = 5.0  # a hung call returns after this, so a regression fails instead of hanging the suite
BOUND_S = 1.0  # what a scrape may take, and the event loop may stall, on a busy 2-core machine


class NVMLError(Exception):
    """pynvml's base error."""


class NVMLError_GpuIsLost(NVMLError):  # pynvml's name
    """What NVML raises for a GPU that fell off the bus."""


class FakeNvml:
    """The part of pynvml that read_gpus uses, for `count` GPUs. `failing` names calls that raise
    on some GPUs (call -> GPU indices, any exception type), `lost` GPUs whose handle cannot be
    had, and `hang` one (call, GPU) that blocks until `release` is set."""

    NVMLError = NVMLError
    NVML_TEMPERATURE_GPU = 0

    def __init__(
        self,
        count: int = 3,
        failing: dict[str, dict[int, Exception]] | None = None,
        lost: set[int] | None = None,
        hang: tuple[str, int] | None = None,
        names: dict[int, bytes] | None = None,
    ) -> None:
        self.count = count
        self.names = names or {}
        self.failing = failing or {}
        self.lost = lost or set()
        self.hang = hang
        self.hanging = threading.Event()
        self.release = threading.Event()

    def _call(self, call: str, handle: int, value: T) -> T:
        error = self.failing.get(call, {}).get(handle)
        if error is not None:
            raise error
        if self.hang == (call, handle) and not self.release.is_set():
            self.hanging.set()
            self.release.wait(HANG_LIMIT_S)
        return value

    def nvmlDeviceGetCount(self) -> int:
        return self._call("nvmlDeviceGetCount", -1, self.count)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if index in self.lost or index >= self.count:
            raise NVMLError_GpuIsLost("GPU is lost")
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:  # GPU-<index> here
        return self.nvmlDeviceGetHandleByIndex(int(uuid.removeprefix("GPU-")))

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return self._call("nvmlDeviceGetName", handle, self.names.get(handle, b"NVIDIA H200"))

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return self._call("nvmlDeviceGetMemoryInfo", handle, SimpleNamespace(used=1 << 30, total=141 << 30))

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return self._call("nvmlDeviceGetUtilizationRates", handle, SimpleNamespace(gpu=75, memory=10))

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return self._call("nvmlDeviceGetPowerUsage", handle, 300_500)  # milliwatts

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return self._call("nvmlDeviceGetTemperature", handle, 55)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        return self._call("nvmlDeviceGetTotalEnergyConsumption", handle, 1_234_500)  # millijoules


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[FakeNvml]]:
    """Install a fake: append one to the list. Whatever hangs is released at the end, and the
    samplers' threads, finding no NVML after the test, end by themselves. Every GPU is visible
    unless a test sets CUDA_VISIBLE_DEVICES."""
    installed: list[FakeNvml] = []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(gpu, "_nvml", lambda: installed[-1] if installed else None)
    yield installed
    for fake in installed:
        fake.release.set()


class NoModels:
    def loaded(self) -> list[object]:
        return []


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(exposition(registry).decode()):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def gpu_label(index: int) -> tuple[tuple[str, str], ...]:
    return (("gpu", str(index)), ("name", "NVIDIA H200"))


def wait_until(condition: Any, what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.01)


# --- each NVML call on its own ---------------------------------------------------------------------


def test_a_failing_nvml_call_drops_that_reading_only(nvml: list[FakeNvml]) -> None:
    nvml.append(FakeNvml(
        failing={
            "nvmlDeviceGetPowerUsage": {1: NVMLError_GpuIsLost("GPU is lost")},
            "nvmlDeviceGetTemperature": {0: RuntimeError("a binding that broke")},
            "nvmlDeviceGetName": {1: NVMLError("unknown")},
        },
        lost={2},
    ))
    first, second = read_gpus()  # GPU 2 is lost: left out
    assert first == GpuReading(0, "NVIDIA H200", 0.75, 1 << 30, 141 << 30, 300.5, None, 1234.5)
    assert second == GpuReading(1, "GPU 1", 0.75, 1 << 30, 141 << 30, None, 55.0, 1234.5)


def test_a_failing_count_is_no_gpus_not_an_error(nvml: list[FakeNvml]) -> None:
    nvml.append(FakeNvml(failing={"nvmlDeviceGetCount": {-1: NVMLError_GpuIsLost("GPU is lost")}}))
    assert read_gpus() == []


def test_a_lost_gpu_does_not_break_the_scrape(nvml: list[FakeNvml]) -> None:
    """The server's own registry: the models' metrics and the GPUs that still answer."""
    nvml.append(FakeNvml(failing={"nvmlDeviceGetPowerUsage": {0: NVMLError_GpuIsLost("GPU is lost")}}, lost={1}))
    registry = build_registry(NoModels(), price_per_hour=2.5)  # type: ignore[arg-type]
    wait_until(lambda: ("batchline_gpu_memory_used_bytes", gpu_label(0)) in samples(registry), "a GPU reading")
    found = samples(registry)
    assert found[("batchline_gpu_memory_used_bytes", gpu_label(2))] == 1 << 30
    assert ("batchline_gpu_power_watts", gpu_label(0)) not in found
    assert found[("batchline_gpu_power_watts", gpu_label(2))] == 300.5
    assert not any(labels == gpu_label(1) for _, labels in found)
    assert found[("batchline_device_price_per_hour", (("device", "gpu"),))] == 2.5


# --- the GPUs this process may use, as CUDA numbers them ------------------------------------------


def named(count: int) -> FakeNvml:
    return FakeNvml(count=count, names={i: f"NVML GPU {i}".encode() for i in range(count)})


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        ("2,0", [(0, "NVML GPU 2"), (1, "NVML GPU 0")]),  # CUDA renumbers the listed GPUs from 0
        ("GPU-3", [(0, "NVML GPU 3")]),  # by UUID
        ("1,-1,2", [(0, "NVML GPU 1")]),  # CUDA stops at the first entry that is no device
        ("-1", []),  # every GPU hidden
        ("", []),
    ],
)
def test_only_the_visible_gpus_are_read_under_their_cuda_index(
    nvml: list[FakeNvml], monkeypatch: pytest.MonkeyPatch, visible: str, expected: list[tuple[int, str]]
) -> None:
    nvml.append(named(4))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert [(r.index, r.name) for r in read_gpus()] == expected


def test_the_gpu_label_is_the_cuda_index_the_rest_of_the_server_uses(
    nvml: list[FakeNvml], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under CUDA_VISIBLE_DEVICES=3,1 the model on cuda:0 runs on NVML's GPU 3: its counters are
    labelled gpu="0", and GPUs 0 and 2, which this process cannot use, are not exported."""
    nvml.append(FakeNvml(count=4, names={3: b"NVML GPU 3", 1: b"NVML GPU 1"},
                         failing={"nvmlDeviceGetPowerUsage": {1: NVMLError("not supported")}}))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    registry = CollectorRegistry()
    registry.register(BatchlineCollector(NoModels(), gpus=read_gpus))  # type: ignore[arg-type]
    power = {labels: value for (name, labels), value in samples(registry).items() if name == "batchline_gpu_power_watts"}
    assert power == {(("gpu", "0"), ("name", "NVML GPU 3")): 300.5}  # NVML's GPU 1 (cuda:1) has no power reading
    memory = [labels for (name, labels) in samples(registry) if name == "batchline_gpu_memory_used_bytes"]
    assert sorted(memory) == [(("gpu", "0"), ("name", "NVML GPU 3")), (("gpu", "1"), ("name", "NVML GPU 1"))]


def test_a_listed_gpu_the_host_lacks_is_left_out(nvml: list[FakeNvml], monkeypatch: pytest.MonkeyPatch) -> None:
    nvml.append(named(2))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,GPU-7")
    assert [(r.index, r.name) for r in read_gpus()] == [(0, "NVML GPU 1")]


# --- NVML off the event loop ---------------------------------------------------------------------


async def timed_with_loop_lag(awaitable: Awaitable[T]) -> tuple[T, float, float]:
    """The result, how long it took, and the longest the event loop was held meanwhile."""
    lags: list[float] = []
    done = False

    async def tick() -> None:
        while not done:
            before = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - before - 0.005)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)
    started = time.perf_counter()
    try:
        result = await awaitable
    finally:
        elapsed = time.perf_counter() - started
        done = True
        await ticker
    return result, elapsed, max(lags, default=0.0)


async def test_a_hung_nvml_call_stalls_neither_metrics_nor_the_event_loop(nvml: list[FakeNvml], tmp_path: Path) -> None:
    """/metrics on the real app, while GPU 0's power reading hangs: it answers at once, with
    everything but the GPUs (not read yet), and the loop stays free; once NVML answers again,
    the GPUs are back."""
    fake = FakeNvml(count=2, hang=("nvmlDeviceGetPowerUsage", 0))
    nvml.append(fake)
    repository = ModelRepository(tmp_path)
    app = create_app(DataPlane(repository), metrics=build_registry(repository))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://batchline.test") as client:
        await asyncio.to_thread(fake.hanging.wait, BOUND_S * 5)  # the sampler's first read is stuck
        response, elapsed, lag = await timed_with_loop_lag(client.get("/metrics"))
        assert response.status_code == 200
        assert elapsed < BOUND_S and lag < BOUND_S, (elapsed, lag)
        assert "process_cpu_seconds_total" in response.text
        assert "batchline_gpu_memory_used_bytes" not in response.text

        fake.release.set()
        deadline = time.monotonic() + 10
        while "batchline_gpu_power_watts" not in (await client.get("/metrics")).text:
            assert time.monotonic() < deadline, "the GPUs did not come back once NVML answered"
            await asyncio.sleep(0.02)
        assert 'batchline_gpu_power_watts{gpu="0",name="NVIDIA H200"} 300.5' in (await client.get("/metrics")).text


# --- the sampler ---------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


READING = GpuReading(0, "H200", 0.5, 1, 2, 3.0, 4.0, 5.0)


def test_the_sampler_serves_its_last_reading_with_its_age_and_drops_stale_ones() -> None:
    clock = Clock()
    sampler = GpuSampler(read=lambda: [READING], interval_s=5, available=lambda: True, clock=clock)
    assert sampler.max_age_s == 15
    assert sampler.sample() is None  # nothing read yet
    sampler.read_now()
    clock.now += 4
    sample = sampler.sample()
    assert sample is not None and sample.readings == [READING] and sample.age_s == 4
    clock.now += 12  # the thread is stuck: 16 s since the last reading, past 15
    stale = sampler.sample()
    assert stale is not None and stale.readings == [] and stale.age_s == 16


def test_a_first_read_that_hangs_shows_as_an_age_once_overdue() -> None:
    clock = Clock()
    entered, release = threading.Event(), threading.Event()

    def hung() -> list[GpuReading]:
        entered.set()
        release.wait(HANG_LIMIT_S)
        return [READING]

    sampler = GpuSampler(read=hung, interval_s=1, available=lambda: True, clock=clock).start()
    try:
        assert entered.wait(HANG_LIMIT_S)
        assert sampler.sample() is None  # not overdue yet
        clock.now += 4
        overdue = sampler.sample()
        assert overdue is not None and overdue.readings == [] and overdue.age_s == 4
        registry = CollectorRegistry()
        registry.register(BatchlineCollector(NoModels(), sampler=sampler))  # type: ignore[arg-type]
        found = samples(registry)
        assert found[("batchline_gpu_reading_age_seconds", ())] == 4
        assert not any(name.startswith("batchline_gpu_memory") for name, _ in found)
    finally:
        sampler.stop()
        release.set()


def test_the_sampler_thread_ends_where_there_is_no_nvml() -> None:
    sampler = GpuSampler(read=lambda: pytest.fail("read without NVML"), available=lambda: False).start()
    assert sampler._thread is not None
    sampler._thread.join(BOUND_S * 5)
    assert not sampler._thread.is_alive()
    assert sampler.sample() is None


def test_a_reader_that_raises_leaves_no_readings_and_the_thread_alive() -> None:
    calls: list[int] = []

    def broken() -> list[GpuReading]:
        calls.append(1)
        raise RuntimeError("boom")

    sampler = GpuSampler(read=broken, interval_s=0.01, available=lambda: True).start()
    try:
        wait_until(lambda: len(calls) >= 3, "three reads")
        assert sampler.sample() is None
    finally:
        sampler.stop()
