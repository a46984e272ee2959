"""What the GPU check covers beyond the plain precisions, and what it cannot cover on its host.

Beyond them: a variant torch.compiled once per batch bucket (on a GPU in reduce-overhead mode, a
CUDA graph per bucket), so that the warm-up over every bucket, the compile lock and the CUDA-graph
path run on the device; and a variant with two instances on the one GPU, each on its CUDA stream,
read against one instance. The server's log says how long each bucket took to compile
(`compiled <model> batch <n> in <s> s`, server/engines/torch.py) and when warm-up began and the
model was ready; `server_compiles` reads them into the record.

What the host cannot run (`not_covered`) is listed in the report with the reason, so that a
complete run is never read as covering more than it did.

Kept free of torch at import, like gpucheck_measure.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Extra:
    """A variant built from a plain one (`role`, `precision`): torch.compiled over batch buckets
    in `compile_mode`, or served by `instances` instances on the one device."""

    role: str
    precision: str
    suffix: str  # the variant is `<precision>-<suffix>` in the record, `<model>-<precision>-<suffix>` served
    compile_mode: str | None = None
    buckets: tuple[int, ...] | None = None  # compiled: its batch_buckets (None: the role's engine buckets)
    instances: int = 1

    @property
    def key(self) -> str:
        return f"{self.precision}-{self.suffix}"

    def method(self, buckets: list[int]) -> str:
        if self.compile_mode:
            return (f"the {self.precision} program, torch.compile mode {self.compile_mode} once per batch bucket"
                    f" {buckets}, batches padded up to a bucket")
        return (f"the {self.precision} variant, {self.instances} instances on the one device, each on a thread of its"
                " own (on a GPU, each on its own CUDA stream)")


def compiler_problem(device_type: str) -> str | None:
    """Why torch.compile cannot run here, or None: Inductor builds C++ kernels on the CPU, and
    Triton builds its launchers with a C compiler on a GPU."""
    if device_type == "cuda":
        names, variable, what = ("cc", "gcc", "clang"), "CC", "Triton builds its CUDA launchers with a C compiler"
    else:
        names, variable, what = ("c++", "g++", "clang++"), "CXX", "Inductor builds its CPU kernels with a C++ compiler"
    if os.environ.get(variable) or any(shutil.which(name) for name in names):
        return None
    return f"{what}, and there is none here (${variable} unset, none of {', '.join(names)} on PATH)"


def not_covered(mode: str, providers: list[str] | None) -> list[dict[str, str]]:
    """What the check cannot exercise on this host, each with the reason. `providers`: ONNX
    Runtime's available providers (None: onnxruntime is not installed)."""
    cuda_provider = providers is not None and "CUDAExecutionProvider" in providers
    trt_provider = providers is not None and "TensorrtExecutionProvider" in providers
    if providers is None:
        ort = "onnxruntime is not installed"
    elif cuda_provider:
        ort = "onnxruntime-gpu is installed, but this check builds torch.export programs only"
    else:
        ort = ("the host's onnxruntime is the CPU build, and onnxruntime-gpu is too big to carry (its wheel is"
               " over the wheels' budget, loadtest/gpucheck_wheels.py)")
    tensorrt = ("tensorrt is installed, but this check builds no TensorRT plans" if importlib.util.find_spec("tensorrt")
                else "tensorrt is not installed on the host")
    items = [
        {"what": "ONNX Runtime's CUDA execution provider, and its I/O binding (device-resident inputs and outputs)",
         "why": ort},
        {"what": "TensorRT plans (the tensorrt engine, `batchline build --engine tensorrt`)", "why": tensorrt},
        {"what": "ONNX Runtime's TensorRT execution provider (and its engine cache)",
         "why": "it needs onnxruntime-gpu with TensorRT's libraries: "
                + ("both are here, but this check builds torch.export programs only" if trt_provider
                   else f"{ort}; {tensorrt}")},
        {"what": "instances spread over more than one GPU", "why": "the check places every instance on GPU 0"
                " (the device machine has one)"},
    ]
    if mode != "gpu":
        items.insert(0, {"what": "anything on a GPU: CUDA streams per instance, CUDA graphs, pinned copies, NVML",
                         "why": "the dry run runs on the CPU"})
    return items


# ---- the server's log ----------------------------------------------------------------------------
_STAMP = r"(?m)^(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ \S+: "
_COMPILED = re.compile(_STAMP + r"compiled (?P<model>\S+) (?P<shape>.+?) in (?P<seconds>[0-9.]+) s\s*$")
_GRAPH = re.compile(_STAMP + r"recorded the CUDA graph of (?P<model>\S+) (?P<shape>.+?) for thread \S+"
                    r" in (?P<seconds>[0-9.]+) s\s*$")
_WARMUP = re.compile(_STAMP + r"model (?P<model>[^/\s]+)/\S+: warm-up at batch sizes \[(?P<sizes>[0-9, ]*)\]")
_READY = re.compile(_STAMP + r"model (?P<model>[^/\s]+)/\S+ ready: ")


def _at(match: re.Match[str]) -> dt.datetime:
    return dt.datetime.strptime(match["at"], "%Y-%m-%d %H:%M:%S,%f")


def server_compiles(log: str, model: str) -> dict[str, Any]:
    """What the server's log says of `model`'s load: each bucket's compile (and any CUDA graph
    recorded again for another thread) in seconds, the warm-up's batch sizes, and the time from
    the first warm-up to the last instance ready (compiles, graphs and warm-up runs together)."""
    compiles: list[dict[str, Any]] = [{"shape": m["shape"], "seconds": float(m["seconds"])} for m in _COMPILED.finditer(log)
                if m["model"] == model]
    graphs = [{"shape": m["shape"], "seconds": float(m["seconds"])} for m in _GRAPH.finditer(log)
              if m["model"] == model]
    warmups = [m for m in _WARMUP.finditer(log) if m["model"] == model]
    readies = [m for m in _READY.finditer(log) if m["model"] == model]
    record: dict[str, Any] = {
        "compiles": compiles,
        "compile_s": round(sum(c["seconds"] for c in compiles), 2),
        "warmup_batch_sizes": [int(s) for s in warmups[0]["sizes"].split(",") if s.strip()] if warmups else None,
        "warmup_to_ready_s": round((_at(readies[-1]) - _at(warmups[0])).total_seconds(), 2)
        if warmups and readies else None,
    }
    if graphs:
        record["graphs_recorded_again"] = graphs
    if not compiles:
        record["note"] = f"no `compiled {model} ...` line in the server's log"
    return record


def instance_comparison(one: dict[str, Any] | None, many: dict[str, Any] | None, instances: int) -> dict[str, Any]:
    """Served items/s of `instances` instances against one (the plain variant's, same load)."""
    if not one or not many or one.get("items_s") is None or many.get("items_s") is None:
        return {"instances": instances, "one_instance_items_s": None, "speedup": None}
    return {"instances": instances, "one_instance_items_s": one["items_s"],
            "speedup": round(many["items_s"] / one["items_s"], 3) if one["items_s"] else None}
