"""Which devices exist, how an instance_group spreads instances over them, and what software
stack they run (named once in the start-up log)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from server.config import MAX_INSTANCES, InstanceGroup
from server.errors import ConfigMismatch, EngineError
from server.gpu import cuda_device_count, driver_versions, gpu_model, nvidia_driver_reachable, nvml_available
from server.versions import installed_versions, tensorrt_version


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
    if len(devices) > MAX_INSTANCES:  # a GPU group without `gpus` takes every GPU: known only here
        raise ConfigMismatch(f"instance_group places {len(devices)} instances on this machine's {gpus_visible} GPUs, "
                             f"over {MAX_INSTANCES} in all: lower count, or name the GPUs with gpus")
    return devices


STACK_LIBRARIES = ("torch", "onnxruntime", "onnxruntime-gpu")


def describe_stack() -> str:
    """One log line naming what this process computes on: each visible GPU (CUDA index, model,
    compute capability), the driver and CUDA versions, and the libraries in use (torch and the
    CUDA it was built for, onnxruntime and its providers, TensorRT where installed). Without a
    GPU, a short line that says so and why. Never raises: a library that fails to import is named
    as such. On a GPU machine it imports torch and onnxruntime (seconds): call it off the path
    to the port."""
    count = visible_gpu_count()
    if count == 0:
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        if hidden is not None:
            why = f"CUDA_VISIBLE_DEVICES={hidden!r}"
        elif nvml_available():
            why = "NVML finds none"
        else:
            why = "no NVML, and torch sees none" if nvidia_driver_reachable() else "no NVIDIA driver"
        return f"no GPU visible ({why}): models run on the CPU"
    gpus = []
    for index in range(count):
        model = gpu_model(index)
        gpus.append(f"cuda:{index} " + (f"{model[0]} (sm{model[1][0]}{model[1][1]})" if model else "unknown GPU"))
    driver, cuda = driver_versions()
    versions = installed_versions(STACK_LIBRARIES)
    return "; ".join([
        ", ".join(gpus),
        f"driver {driver or 'unknown'}, CUDA {cuda or 'unknown'} (driver)",
        _torch_stack(versions["torch"]),
        _onnxruntime_stack(versions["onnxruntime-gpu"] or versions["onnxruntime"]),
        _tensorrt_stack(),
    ])


def _torch_stack(version: str | None) -> str:
    if version is None:
        return "torch not installed"
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 (a broken install is worth a line, not a crash)
        return f"torch {version} (fails to import: {type(exc).__name__})"
    return f"torch {version} (CUDA {torch.version.cuda or 'none: a CPU build'})"


def _onnxruntime_stack(version: str | None) -> str:
    if version is None:
        return "onnxruntime not installed"
    try:
        import onnxruntime
    except Exception as exc:  # noqa: BLE001
        return f"onnxruntime {version} (fails to import: {type(exc).__name__})"
    return f"onnxruntime {version} [{', '.join(onnxruntime.get_available_providers())}]"


def _tensorrt_stack() -> str:
    version = tensorrt_version()
    return f"tensorrt {version}" if version else "tensorrt not installed"
