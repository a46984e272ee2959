"""Which devices exist, and how an instance_group spreads instances over them."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from server.config import InstanceGroup
from server.errors import EngineError
from server.gpu import cuda_device_count


@dataclass(frozen=True)
class Device:
    kind: str  # "CPU" or "GPU"
    index: int = 0

    def __str__(self) -> str:
        return "cpu" if self.kind == "CPU" else f"cuda:{self.index}"


@functools.cache
def visible_gpu_count() -> int:
    """GPUs this process may use (NVML's, narrowed by CUDA_VISIBLE_DEVICES), read once."""
    return cuda_device_count()


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
