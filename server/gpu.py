"""GPU counters through NVML (nvidia-ml-py), read at scrape time; nothing on machines without."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class GpuReading:
    index: int
    name: str
    utilization_ratio: float | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    power_watts: float | None
    temperature_celsius: float | None
    energy_joules: float | None  # since the driver loaded (Volta and newer)


@functools.cache
def _nvml():  # type: ignore[no-untyped-def]
    """The initialised pynvml module, or None where NVML cannot be used."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        logger.info("NVML is not available (%s): no GPU metrics", exc)
        return None
    return pynvml


def read_gpus() -> list[GpuReading]:
    nvml = _nvml()
    if nvml is None:
        return []
    readings = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)

        def read(call, scale: float = 1.0):  # type: ignore[no-untyped-def]
            try:
                value = call(handle)
            except nvml.NVMLError:
                return None  # not every counter exists on every GPU
            return value * scale if scale != 1.0 else value

        memory = read(nvml.nvmlDeviceGetMemoryInfo)
        utilization = read(nvml.nvmlDeviceGetUtilizationRates)
        name = read(nvml.nvmlDeviceGetName)
        readings.append(
            GpuReading(
                index=index,
                name=name.decode() if isinstance(name, bytes) else str(name),
                utilization_ratio=utilization.gpu / 100 if utilization is not None else None,
                memory_used_bytes=memory.used if memory is not None else None,
                memory_total_bytes=memory.total if memory is not None else None,
                power_watts=read(nvml.nvmlDeviceGetPowerUsage, 1e-3),
                temperature_celsius=read(lambda h: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
                energy_joules=read(nvml.nvmlDeviceGetTotalEnergyConsumption, 1e-3),
            )
        )
    return readings


def _query(cuda_index: int, read: Callable[[Any, Any], T]) -> T | None:
    """`read(nvml, handle)` for CUDA device `cuda_index` (`cuda:N` in this process); None without
    NVML, or when NVML refuses or does not know the device."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        return read(nvml, _cuda_handle(nvml, cuda_index))
    except (nvml.NVMLError, IndexError):
        return None


def _cuda_handle(nvml: Any, cuda_index: int) -> Any:
    """CUDA numbers the devices CUDA_VISIBLE_DEVICES lists (by index or UUID) from 0; NVML
    numbers every device on the host: `cuda:0` is NVML's device 3 under CUDA_VISIBLE_DEVICES=3.
    Indices agree only in PCI bus order, which `batchline` sets (CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return nvml.nvmlDeviceGetHandleByIndex(cuda_index)
    entry = visible_entries(visible)[cuda_index]
    if entry.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(entry))
    return nvml.nvmlDeviceGetHandleByUUID(entry)


def process_memory_bytes(index: int, pid: int) -> int | None:
    """GPU memory that process `pid` holds on CUDA device `index`, as NVML sees it (every engine's
    allocations, not only torch's); None without NVML, or when NVML cannot see the process
    (another PID namespace, or no rights to the counter)."""
    processes = _query(index, lambda nvml, handle: nvml.nvmlDeviceGetComputeRunningProcesses(handle))
    used = [p.usedGpuMemory for p in processes or [] if p.pid == pid and p.usedGpuMemory is not None]
    return sum(used) if used else None


def identity(index: int) -> str | None:
    """CUDA device `index`'s model and compute capability, e.g. "NVIDIA H200 sm90": what a build measured
    on it (and a TensorRT plan built on it) is valid for. None without NVML."""
    found = _query(index, lambda nvml, handle: (nvml.nvmlDeviceGetName(handle),
                                                 nvml.nvmlDeviceGetCudaComputeCapability(handle)))
    if found is None:
        return None
    name, (major, minor) = found
    return f"{name.decode() if isinstance(name, bytes) else name} sm{major}{minor}"


def cuda_device_count() -> int:
    """GPUs this process may use: those NVML sees, narrowed by CUDA_VISIBLE_DEVICES when set
    (CUDA renumbers the listed devices from 0; NVML always sees the whole host). 0 where NVML
    (nvidia-ml-py or the driver) is absent."""
    nvml = _nvml()
    if nvml is None:
        return 0
    try:
        present = int(nvml.nvmlDeviceGetCount())
    except nvml.NVMLError:
        return 0
    return cuda_visible(present, os.environ.get("CUDA_VISIBLE_DEVICES"))


def cuda_visible(present: int, listed: str | None) -> int:
    """How many of `present` GPUs CUDA_VISIBLE_DEVICES=`listed` leaves (None: all of them)."""
    if listed is None:
        return present
    return min(present, len(visible_entries(listed)))


def visible_entries(listed: str) -> list[str]:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: indices or GPU-/MIG- UUIDs, up to the first entry
    that is neither (so "-1", a common way to hide every GPU, leaves none)."""
    entries = []
    for entry in (e.strip() for e in listed.split(",")):
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        entries.append(entry)
    return entries
