"""GPU counters through NVML (nvidia-ml-py); nothing on machines without.

NVML calls block, and a GPU that fell off the bus can make one fail or hang. So the counters are
read by `GpuSampler` on a thread of its own at a fixed interval, each call guarded on its own,
and a scrape (on the event loop every request shares) serves the last reading with its age.

GPUs are numbered as CUDA numbers them in this process (`cuda:N`, the index instance groups,
engines and metrics use): the devices CUDA_VISIBLE_DEVICES leaves, from 0. NVML numbers every GPU
on the host, so each CUDA index is mapped to its NVML handle (`_cuda_handle`). Where NVML is
absent (nvidia-ml-py not installed), the count and the model of each GPU come from torch instead.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class GpuReading:
    index: int  # the CUDA index in this process (`cuda:N`), not NVML's host-wide one
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


def nvml_available() -> bool:
    """Whether NVML is installed and initialised (the first call initialises it, and may block)."""
    return _nvml() is not None


def read_gpus() -> list[GpuReading]:
    """The counters of every GPU this process may use (CUDA_VISIBLE_DEVICES), by CUDA index; never
    raises. Each NVML call is guarded on its own: a counter that fails (not on this GPU, or the
    GPU is lost: NVMLError_GpuIsLost) drops that reading only, a GPU whose handle fails is left
    out, and a failing count means no GPUs this time."""
    nvml = _nvml()
    if nvml is None:
        return []
    count = _guarded("nvmlDeviceGetCount", nvml.nvmlDeviceGetCount)
    if not isinstance(count, int):
        return []
    readings = []
    for index in range(cuda_visible(count, os.environ.get("CUDA_VISIBLE_DEVICES"))):
        handle = _guarded("nvmlDeviceGetHandle", _cuda_handle, nvml, index)
        if handle is not None:
            readings.append(_reading(nvml, index, handle))
    return readings


def _reading(nvml: Any, index: int, handle: Any) -> GpuReading:
    def read(call: str, *args: Any) -> Any:
        return _guarded(call, getattr(nvml, call), handle, *args)

    memory = read("nvmlDeviceGetMemoryInfo")
    utilization = read("nvmlDeviceGetUtilizationRates")
    name = read("nvmlDeviceGetName")
    power_mw = read("nvmlDeviceGetPowerUsage")
    energy_mj = read("nvmlDeviceGetTotalEnergyConsumption")
    return GpuReading(
        index=index,
        name=_text(name) if name else f"GPU {index}",
        utilization_ratio=_number(utilization, "gpu", 100),
        memory_used_bytes=_whole(memory, "used"),
        memory_total_bytes=_whole(memory, "total"),
        power_watts=_number(power_mw, None, 1000),
        temperature_celsius=_number(read("nvmlDeviceGetTemperature", getattr(nvml, "NVML_TEMPERATURE_GPU", 0)), None),
        energy_joules=_number(energy_mj, None, 1000),
    )


def _number(value: Any, attribute: str | None, divisor: float = 1) -> float | None:
    """value (or its attribute) as a float over divisor (NVML counts %, mW, mJ); None where NVML
    gave nothing usable."""
    try:
        raw = getattr(value, attribute) if attribute is not None else value
        return None if raw is None else float(raw) / divisor
    except (AttributeError, TypeError, ValueError):
        return None


def _whole(value: Any, attribute: str) -> int | None:
    try:
        raw = getattr(value, attribute)
        return None if raw is None else int(raw)
    except (AttributeError, TypeError, ValueError):
        return None


_reported: set[str] = set()  # NVML calls whose failure was logged: once each, not every interval


def _guarded(call: str, function: Callable[..., T], *args: Any) -> T | None:
    """function(*args), or None when it raises anything: one failing reading must not cost the
    others (a metrics reader is no place to crash)."""
    try:
        return function(*args)
    except Exception as exc:  # noqa: BLE001 (NVMLError and its many subclasses, or a broken binding)
        if call not in _reported:
            _reported.add(call)
            logger.warning("NVML %s failed (%s: %s); that GPU reading is left out", call, type(exc).__name__, exc)
        return None


@dataclass(frozen=True)
class GpuSample:
    """The GPU readings a scrape may show, and how old they are."""

    readings: list[GpuReading]
    age_s: float


class GpuSampler:
    """Reads the GPUs on a daemon thread every `interval_s` and keeps the last reading.

    A slow or hung NVML call stalls this thread only: scrapes keep answering with the last
    reading and its age, and once that is older than `max_age_s` (the thread is stuck) with no
    readings at all, rather than stale ones passed off as current.
    """

    def __init__(
        self,
        read: Callable[[], list[GpuReading]] = read_gpus,
        interval_s: float = 5.0,
        max_age_s: float | None = None,
        available: Callable[[], bool] = nvml_available,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._interval_s = interval_s
        self.max_age_s = max_age_s if max_age_s is not None else 3 * interval_s
        self._available = available
        self._clock = clock
        self._lock = threading.Lock()
        self._readings: list[GpuReading] = []
        self._taken_at: float | None = None  # when the last reading completed
        self._reading_since: float | None = None  # when the read in progress began
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Self:
        """Start the thread (once); it ends by itself where there is no NVML."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="batchline-gpu-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Ask the thread to end after its current read (a hung read keeps it, as a daemon)."""
        self._stop.set()

    def sample(self) -> GpuSample | None:
        """The readings to show and their age; None where there is nothing to say: no GPU seen,
        and no read overdue."""
        now = self._clock()
        with self._lock:
            readings, taken_at, since = self._readings, self._taken_at, self._reading_since
        if taken_at is not None:
            age = now - taken_at
        elif since is not None:
            age = now - since  # the first read has not finished: as old as its wait
        else:
            return None
        stale = age > self.max_age_s
        if not readings and not stale:
            return None
        return GpuSample([] if stale else readings, age)

    def read_now(self) -> None:
        """One read, on the calling thread (the thread's loop; tests)."""
        with self._lock:
            self._reading_since = self._clock()
        try:
            readings = self._read()
        except Exception:  # read_gpus never raises; another reader might
            logger.exception("reading the GPUs failed")
            readings = []
        with self._lock:
            self._readings, self._taken_at, self._reading_since = readings, self._clock(), None

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._available():
                return  # no NVML on this machine: nothing to read, ever
            self.read_now()
            self._stop.wait(self._interval_s)


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
    on it (and a TensorRT plan built on it) is valid for. None where neither NVML nor torch knows it."""
    model = gpu_model(index)
    if model is None:
        return None
    name, (major, minor) = model
    return f"{name} sm{major}{minor}"


def gpu_model(index: int) -> tuple[str, tuple[int, int]] | None:
    """CUDA device `index`'s name and compute capability, from NVML; where NVML is absent, from
    torch. None where the device is unknown (not visible to this process, or no GPU at all)."""
    if _nvml() is None:
        return _torch_model(index)
    found = _query(index, lambda nvml, handle: (nvml.nvmlDeviceGetName(handle),
                                                 nvml.nvmlDeviceGetCudaComputeCapability(handle)))
    if found is None:
        return None
    name, (major, minor) = found
    return _text(name), (int(major), int(minor))


def driver_versions() -> tuple[str | None, str | None]:
    """The NVIDIA driver's version and the newest CUDA it runs, e.g. ("550.54.15", "12.4"); None
    for what NVML cannot say, and both without NVML (torch knows the CUDA it was built for only)."""
    nvml = _nvml()
    if nvml is None:
        return None, None
    driver = _guarded("nvmlSystemGetDriverVersion", nvml.nvmlSystemGetDriverVersion)
    cuda = _guarded("nvmlSystemGetCudaDriverVersion", nvml.nvmlSystemGetCudaDriverVersion)
    return (
        None if driver is None else _text(driver),
        f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else None,  # NVML says 12040
    )


def cuda_device_count() -> int:
    """GPUs this process may use: those NVML sees, narrowed by CUDA_VISIBLE_DEVICES when set
    (CUDA renumbers the listed devices from 0; NVML always sees the whole host). Where NVML is
    absent (nvidia-ml-py not installed, or no driver), torch's count; 0 without either."""
    nvml = _nvml()
    if nvml is None:
        return _torch_device_count()
    try:
        present = int(nvml.nvmlDeviceGetCount())
    except nvml.NVMLError:
        return 0
    return cuda_visible(present, os.environ.get("CUDA_VISIBLE_DEVICES"))


def _torch_cuda():  # type: ignore[no-untyped-def]
    """torch, to ask about GPUs where NVML is absent; None where it is not installed, or where it
    is not imported yet and no NVIDIA driver is reachable: a CPU machine serving ONNX models
    does not pay torch's slow import (seconds, 200 MB) to learn that it has no GPU."""
    if "torch" not in sys.modules and not nvidia_driver_reachable():
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch


def nvidia_driver_reachable() -> bool:
    """Whether CUDA could find a GPU at all: on Linux it needs the driver's control device
    (/dev/nvidiactl, or /dev/dxg under WSL2), which containers get only with GPU access."""
    if not sys.platform.startswith("linux"):
        return True  # no cheap test: torch is asked
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/dxg")


def _torch_device_count() -> int:
    """What torch.cuda counts (it applies CUDA_VISIBLE_DEVICES itself); 0 without torch, and for
    a CUDA install that fails to initialise."""
    torch = _torch_cuda()
    if torch is None:
        return 0
    try:
        return int(torch.cuda.device_count())
    except Exception:  # noqa: BLE001 (a broken CUDA install: no GPU, as without NVML)
        return 0


def _torch_model(index: int) -> tuple[str, tuple[int, int]] | None:
    if not 0 <= index < _torch_device_count():
        return None
    try:
        properties = _torch_cuda().cuda.get_device_properties(index)
        return str(properties.name), (int(properties.major), int(properties.minor))
    except Exception:  # noqa: BLE001 (CUDA that fails to initialise: the device is unknown)
        return None


def _text(value: Any) -> str:
    """NVML strings: bytes from older bindings, str from newer."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


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
