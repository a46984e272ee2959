"""Builds for the GPU: refused clearly where there is none; the GPU memory a build holds is read
from NVML for its own process only (tested with a fake NVML: no GPU here)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from server import devices, gpu
from server.devices import Device, visible_gpu_count
from server.quantize import BuildError, build
from server.quantize.bench import _gpu_memory_mb
from server.quantize.runner import build_device


def test_build_device_follows_the_request_and_tensorrt_always_wants_a_gpu() -> None:
    assert build_device("onnxruntime", "cpu") == Device("CPU")
    assert build_device("torch", "gpu") == Device("GPU", 0)
    assert build_device("tensorrt", "cpu") == Device("GPU", 0)


def test_a_gpu_build_without_a_gpu_is_refused_before_building(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked on every machine: where a GPU is visible, this test hides it (the count NVML gives)."""
    if visible_gpu_count():
        monkeypatch.setattr(devices, "visible_gpu_count", lambda: 0)
    with pytest.raises(BuildError, match="no GPU is visible"):
        build(repository, "digits", "torch", "fp16", device="gpu", progress=lambda _: None)
    with pytest.raises(BuildError, match="device must be cpu or gpu"):
        build(repository, "digits", "torch", "fp16", device="tpu", progress=lambda _: None)
    assert not (repository / "digits-torch-fp16").exists()


class FakeNvml:
    class NVMLError(Exception):
        pass

    def __init__(self, processes: list[SimpleNamespace] | None) -> None:
        self.processes = processes

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        return {"GPU-abc": 7}[uuid]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        if self.processes is None:
            raise self.NVMLError("no permission")
        return self.processes


def test_process_gpu_memory_counts_only_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    mine, other = SimpleNamespace(pid=10, usedGpuMemory=300 << 20), SimpleNamespace(pid=11, usedGpuMemory=5 << 30)
    monkeypatch.setattr(gpu, "_nvml", lambda: FakeNvml([mine, other]))
    assert gpu.process_memory_bytes(0, 10) == 300 << 20
    assert gpu.process_memory_bytes(0, 12) is None  # not visible (another PID namespace)
    monkeypatch.setattr(gpu, "_nvml", lambda: FakeNvml([SimpleNamespace(pid=10, usedGpuMemory=None)]))
    assert gpu.process_memory_bytes(0, 10) is None  # NVML without the rights to the counter
    monkeypatch.setattr(gpu, "_nvml", lambda: FakeNvml(None))
    assert gpu.process_memory_bytes(0, 10) is None
    monkeypatch.setattr(gpu, "_nvml", lambda: None)
    assert gpu.process_memory_bytes(0, 10) is None


def test_the_bench_reads_gpu_memory_on_the_gpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setattr(gpu, "_nvml", lambda: FakeNvml([SimpleNamespace(pid=os.getpid(), usedGpuMemory=512 << 20)]))
    assert _gpu_memory_mb(Device("GPU", 0)) == 512.0
    assert _gpu_memory_mb(Device("CPU")) is None


def test_gpu_identity_names_the_model_and_compute_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    class Named(FakeNvml):
        def nvmlDeviceGetName(self, handle: int) -> bytes:
            return b"NVIDIA H200"

        def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
            return (9, 0)

    monkeypatch.setattr(gpu, "_nvml", lambda: Named([]))
    assert gpu.identity(0) == "NVIDIA H200 sm90"
    monkeypatch.setattr(gpu, "_nvml", lambda: None)
    assert gpu.identity(0) is None


def test_cuda_devices_map_to_nvml_through_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    class Indexed(FakeNvml):
        def nvmlDeviceGetName(self, handle: int) -> str:
            return f"GPU{handle}"

        def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
            return (8, 0)

    monkeypatch.setattr(gpu, "_nvml", lambda: Indexed([]))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu.identity(0) == "GPU0 sm80"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert (gpu.identity(0), gpu.identity(1)) == ("GPU3 sm80", "GPU1 sm80")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc")
    assert gpu.identity(0) == "GPU7 sm80"
    assert gpu.identity(1) is None  # not visible to this process


def test_torchao_dynamic_is_refused_for_the_gpu() -> None:
    """Its program calls aten._int_mm, whose CUDA kernel rejects small batches and odd sizes."""
    from server.quantize import torch_builds

    context = SimpleNamespace(options={"scheme": "dynamic", "calibration": "train"}, device="gpu")
    with pytest.raises(BuildError, match="weight_only on GPUs"):
        torch_builds.int8(context)  # type: ignore[arg-type]


def test_the_gpu_count_is_nvmls_narrowed_by_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    class Four(FakeNvml):
        def nvmlDeviceGetCount(self) -> int:
            return 4

    monkeypatch.setattr(gpu, "_nvml", lambda: Four([]))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu.cuda_device_count() == 4
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")
    assert gpu.cuda_device_count() == 2
    monkeypatch.setattr(gpu, "_nvml", lambda: None)
    assert gpu.cuda_device_count() == 0
