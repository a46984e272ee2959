"""GPU counters through NVML (nvidia-ml-py), read at scrape time; nothing on machines without."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


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


def process_memory_bytes(index: int, pid: int) -> int | None:
    """GPU memory that process `pid` holds on GPU `index`, as NVML sees it (every engine's
    allocations, not only torch's); None without NVML, or when NVML cannot see the process
    (another PID namespace, or no rights to the counter)."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        processes = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except nvml.NVMLError:
        return None
    used = [p.usedGpuMemory for p in processes if p.pid == pid and p.usedGpuMemory is not None]
    return sum(used) if used else None


def identity(index: int) -> str | None:
    """GPU `index`'s model and compute capability, e.g. "NVIDIA H200 sm90": what a build measured
    on it (and a TensorRT plan built on it) is valid for. None without NVML."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        name = nvml.nvmlDeviceGetName(handle)
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    except nvml.NVMLError:
        return None
    return f"{name.decode() if isinstance(name, bytes) else name} sm{major}{minor}"
