"""Which devices exist, and how an instance_group spreads instances over them."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from server.config import InstanceGroup
from server.errors import EngineError


@dataclass(frozen=True)
class Device:
    kind: str  # "CPU" or "GPU"
    index: int = 0

    def __str__(self) -> str:
        return "cpu" if self.kind == "CPU" else f"cuda:{self.index}"


@functools.cache
def visible_gpu_count() -> int:
    """GPUs this process may use: those NVML sees, narrowed by CUDA_VISIBLE_DEVICES when set
    (CUDA renumbers the listed devices from 0; NVML always sees the whole host). 0 where NVML
    (nvidia-ml-py or the driver) is absent."""
    try:
        import pynvml
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
        present = int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError:
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


def placements(groups: list[InstanceGroup], gpu_count: int | None = None) -> list[Device]:
    """One Device per instance: `count` on the CPU, or `count` on each listed (or every) GPU."""
    gpus_visible = visible_gpu_count() if gpu_count is None else gpu_count
    devices: list[Device] = []
    for group in groups:
        if group.kind == "CPU":
            devices.extend(Device("CPU") for _ in range(group.count))
            continue
        if gpus_visible == 0:
            raise EngineError("instance_group asks for a GPU, but no GPU is visible on this machine")
        indices = group.gpus if group.gpus is not None else list(range(gpus_visible))
        missing = [i for i in indices if i >= gpus_visible]
        if missing:
            raise EngineError(f"instance_group names GPUs {missing}, but only {gpus_visible} are visible")
        devices.extend(Device("GPU", i) for i in indices for _ in range(group.count))
    return devices
