"""Builds for the GPU: refused clearly where there is none; the GPU memory a build holds is read
from NVML for its own process only. Device truth: the GPUs counted and named (NVML, else torch),
and the stack the startup log names (tested with a fake NVML and torch: no GPU here)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from server import devices, gpu
from server.devices import Device, visible_gpu_count
from server.quantize.api import build
from server.quantize.bench import _gpu_memory_mb
from server.quantize.errors import BuildError
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
    monkeypatch.setattr(gpu, "_torch_cuda", lambda: pytest.fail("torch asked although NVML answers"))
    assert gpu.cuda_device_count() == 2


class FakeTorch:
    """torch.cuda as seen by the fallback: `count` GPUs (already narrowed, as torch does)."""

    def __init__(self, count: int, broken: bool = False) -> None:
        self.cuda = self
        self.count = count
        self.broken = broken

    def device_count(self) -> int:
        if self.broken:
            raise RuntimeError("CUDA driver initialization failed")
        return self.count

    def get_device_properties(self, index: int) -> SimpleNamespace:
        assert 0 <= index < self.count
        return SimpleNamespace(name=f"NVIDIA H200 #{index}", major=9, minor=0)


def test_without_nvml_the_gpus_are_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia-ml-py not installed on a GPU machine: torch's count and models, not 0 GPUs."""
    monkeypatch.setattr(gpu, "_nvml", lambda: None)
    monkeypatch.setattr(gpu, "_torch_cuda", lambda: FakeTorch(2))
    assert gpu.cuda_device_count() == 2
    assert (gpu.identity(1), gpu.identity(2)) == ("NVIDIA H200 #1 sm90", None)
    monkeypatch.setattr(gpu, "_torch_cuda", lambda: FakeTorch(2, broken=True))
    assert gpu.cuda_device_count() == 0 and gpu.identity(0) is None
    monkeypatch.setattr(gpu, "_torch_cuda", lambda: None)  # no torch either
    assert gpu.cuda_device_count() == 0 and gpu.identity(0) is None


def test_a_cpu_machine_does_not_import_torch_to_count_no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch takes seconds to import: without NVML it is imported only where an NVIDIA driver is
    reachable, or where it was imported already; not installed, it counts no GPUs."""
    import sys

    monkeypatch.setattr(gpu, "_nvml", lambda: None)
    monkeypatch.setattr(gpu, "nvidia_driver_reachable", lambda: False)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert gpu._torch_cuda() is None and gpu.cuda_device_count() == 0
    assert "torch" not in sys.modules
    monkeypatch.setattr(gpu, "nvidia_driver_reachable", lambda: True)
    monkeypatch.setitem(sys.modules, "torch", None)  # reachable driver, torch not installed
    assert gpu._torch_cuda() is None and gpu.cuda_device_count() == 0


class Stack(FakeNvml):
    """NVML on a host of three H200s (names by NVML index) with driver 550.54.15 for CUDA 12.4."""

    def __init__(self) -> None:
        super().__init__([])

    def nvmlDeviceGetCount(self) -> int:
        return 3

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return f"NVIDIA H200 #{handle}".encode()

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
        return (9, 0)

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return b"550.54.15"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 12040


def test_driver_versions_come_from_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "_nvml", lambda: Stack())
    assert gpu.driver_versions() == ("550.54.15", "12.4")
    monkeypatch.setattr(gpu, "_nvml", lambda: None)
    assert gpu.driver_versions() == (None, None)


def test_the_startup_line_names_the_gpu_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each visible GPU by CUDA index (NVML's 2 is cuda:0 here), driver and CUDA, and the
    libraries in use: torch with the CUDA it was built for, onnxruntime with its providers,
    TensorRT where installed."""
    from importlib import metadata

    import onnxruntime
    import torch

    monkeypatch.setattr(gpu, "_nvml", lambda: Stack())
    monkeypatch.setattr(devices, "visible_gpu_count", gpu.cuda_device_count)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    monkeypatch.setattr(devices, "tensorrt_version", lambda: "10.9.0.34")
    line = devices.describe_stack()
    parts = line.split("; ")
    assert parts[:2] == ["cuda:0 NVIDIA H200 #2 (sm90), cuda:1 NVIDIA H200 #0 (sm90)",
                         "driver 550.54.15, CUDA 12.4 (driver)"]
    assert parts[2] == f"torch {metadata.version('torch')} (CUDA {torch.version.cuda or 'none: a CPU build'})"
    assert parts[3].startswith("onnxruntime ") and parts[3].endswith(f"[{', '.join(onnxruntime.get_available_providers())}]")
    assert parts[4] == "tensorrt 10.9.0.34"
    monkeypatch.setattr(devices, "tensorrt_version", lambda: None)
    assert devices.describe_stack().endswith("; tensorrt not installed")


def test_without_a_gpu_the_startup_line_is_short_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 0)
    monkeypatch.setattr(devices, "nvml_available", lambda: False)
    monkeypatch.setattr(devices, "nvidia_driver_reachable", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.describe_stack() == "no GPU visible (no NVIDIA driver): models run on the CPU"
    monkeypatch.setattr(devices, "nvidia_driver_reachable", lambda: True)
    assert devices.describe_stack() == "no GPU visible (no NVML, and torch sees none): models run on the CPU"
    monkeypatch.setattr(devices, "nvml_available", lambda: True)
    assert devices.describe_stack() == "no GPU visible (NVML finds none): models run on the CPU"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert devices.describe_stack() == "no GPU visible (CUDA_VISIBLE_DEVICES='-1'): models run on the CPU"


def test_library_versions_are_read_once_for_the_server_and_the_benchmarks() -> None:
    from importlib import metadata

    from loadtest import machine
    from server import versions

    assert versions.installed_versions(("numpy", "no-such-distribution")) == {
        "numpy": metadata.version("numpy"), "no-such-distribution": None}
    assert machine.library_versions() == versions.installed_versions(machine.LIBRARIES)


def test_the_ready_log_names_the_model_of_each_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from server import model

    monkeypatch.setattr(model, "identity", {0: "NVIDIA H200 sm90"}.get)
    monkeypatch.setattr(model, "driver_versions", lambda: ("580.65.06", "13.0"))
    instances = [SimpleNamespace(device=d) for d in (Device("GPU", 0), Device("GPU", 0), Device("GPU", 1), Device("CPU"))]
    assert model._gpu_identities(instances) == (  # type: ignore[arg-type]
        {0: "NVIDIA H200 sm90", 1: "unknown GPU"}, "driver 580.65.06, CUDA 13.0")
    assert model._gpu_identities(instances[3:]) == ({}, "")  # type: ignore[arg-type]


def test_the_model_config_names_where_a_version_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Devices with their GPU model (counted), driver and CUDA, the engine's library and the
    providers that took; torch names itself in its providers, so once."""
    from importlib import metadata

    from server import model
    from server.engines.base import EngineDescription

    def instance(device: Device, engine: str, providers: list[str]) -> SimpleNamespace:
        described = EngineDescription(engine, str(device), "fp16", providers)
        return SimpleNamespace(device=device, pipeline=SimpleNamespace(engine=SimpleNamespace(describe=lambda: described)))

    ort = [instance(Device("GPU", 0), "onnxruntime", ["CUDAExecutionProvider", "CPUExecutionProvider"])] * 2
    ort.append(instance(Device("GPU", 1), "onnxruntime", ["CUDAExecutionProvider", "CPUExecutionProvider"]))
    gpus = {0: "NVIDIA H200 sm90", 1: "NVIDIA H200 sm90"}
    assert model._placement(ort, gpus, "driver 580.65.06, CUDA 13.0") == (  # type: ignore[arg-type]
        "cuda:0 NVIDIA H200 sm90 x2, cuda:1 NVIDIA H200 sm90; driver 580.65.06, CUDA 13.0; "
        f"onnxruntime {metadata.version('onnxruntime')} [CUDAExecutionProvider, CPUExecutionProvider]")
    torch = [instance(Device("CPU"), "torch", [f"torch {metadata.version('torch')}"])]
    assert model._placement(torch, {}, "") == f"cpu; torch {metadata.version('torch')}"  # type: ignore[arg-type]
    # TensorRT's wheel installed under one of its names: that name and its version
    monkeypatch.setattr(model, "installed_versions",
                        lambda names: {n: "10.9.0.34" if n == "tensorrt-cu13" else None for n in names})
    trt = [instance(Device("GPU", 0), "tensorrt", [])]
    assert model._placement(trt, gpus, "driver 580.65.06, CUDA 13.0") == (  # type: ignore[arg-type]
        "cuda:0 NVIDIA H200 sm90; driver 580.65.06, CUDA 13.0; tensorrt-cu13 10.9.0.34")
