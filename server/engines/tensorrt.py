"""TensorRT engine: serves a plan built by `batchline build --engine tensorrt`, on a GPU.

The plan holds one optimization profile per batch bucket (server/engines/profiles.py); each
batch runs under the profile whose batch range holds it. Device buffers are torch CUDA tensors,
so no extra CUDA binding is needed. What can be checked without a GPU (profile choice, datatype
mapping, the guards) is pure and unit-tested; the run itself needs TensorRT and a GPU and has not
been executed on the machines this was written on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from server.config import ModelConfig
from server.devices import Device
from server.engines.base import Engine, EngineDescription, artifact_path
from server.engines.signature import EngineSignature, TensorSignature
from server.errors import EngineError

NOT_INSTALLED = "TensorRT is not installed on this machine (it needs an NVIDIA GPU machine: pip install tensorrt)"

# TensorRT DataType names -> numpy dtypes (by name, so this module imports without TensorRT).
DTYPES: dict[str, np.dtype[Any]] = {
    "FLOAT": np.dtype(np.float32),
    "HALF": np.dtype(np.float16),
    "INT8": np.dtype(np.int8),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
}
# TensorRT DataType names -> v2 datatypes (FP8, INT4, ... have none)
DATATYPES: dict[str, str] = {
    "FLOAT": "FP32",
    "HALF": "FP16",
    "BF16": "BF16",
    "INT8": "INT8",
    "INT32": "INT32",
    "INT64": "INT64",
    "BOOL": "BOOL",
    "UINT8": "UINT8",
}


@dataclass(frozen=True)
class ProfileRange:
    """The batch sizes one optimization profile accepts."""

    index: int
    min_batch: int
    max_batch: int


def choose_profile(profiles: list[ProfileRange], batch: int) -> int:
    """The profile whose batch range holds `batch`, the narrowest if several do."""
    fitting = [p for p in profiles if p.min_batch <= batch <= p.max_batch]
    if not fitting:
        ranges = ", ".join(f"{p.min_batch}..{p.max_batch}" for p in profiles)
        raise EngineError(f"no TensorRT profile takes a batch of {batch} (profiles: {ranges})")
    return min(fitting, key=lambda p: p.max_batch - p.min_batch).index


def plan_signature(engine: Any) -> EngineSignature:
    """The I/O tensors of a deserialized plan (an ICudaEngine), in the plan's order; dims of -1
    (dynamic, bounded by the optimization profiles) are variable. Reads enum names only, so it
    runs, and is tested, without TensorRT."""
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]

    def tensor(name: str) -> TensorSignature:
        dtype = engine.get_tensor_dtype(name).name
        shape = tuple(int(d) if d >= 0 else None for d in engine.get_tensor_shape(name))
        return TensorSignature(name, DATATYPES.get(dtype), shape, dtype)

    is_input = {n: engine.get_tensor_mode(n).name == "INPUT" for n in names}
    return EngineSignature(
        inputs=tuple(tensor(n) for n in names if is_input[n]),
        outputs=tuple(tensor(n) for n in names if not is_input[n]),
    )


def numpy_dtype(trt_dtype_name: str) -> np.dtype[Any]:
    if trt_dtype_name not in DTYPES:
        raise EngineError(f"TensorRT tensor type {trt_dtype_name} is not supported by this engine")
    return DTYPES[trt_dtype_name]


class TensorRTEngine(Engine):
    def __init__(self, config: ModelConfig, version_dir: Path, device: Device) -> None:
        if device.kind != "GPU":
            raise EngineError("the tensorrt engine runs on a GPU: give the model an instance_group of kind GPU")
        try:
            import tensorrt as trt
        except ImportError as exc:
            raise EngineError(NOT_INSTALLED) from exc
        import torch

        if not torch.cuda.is_available():
            raise EngineError("the tensorrt engine was placed on a GPU, but torch sees no CUDA device")
        self._torch = torch
        self._device = torch.device(str(device))
        self._precision = config.precision
        self._path = artifact_path(config, version_dir, "model.plan")
        with torch.cuda.device(self._device):
            runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
            self._engine = runtime.deserialize_cuda_engine(self._path.read_bytes())
            if self._engine is None:
                raise EngineError(
                    f"TensorRT cannot load {self._path}: plans are valid only for the GPU model and "
                    "TensorRT version they were built with (rebuild it on this machine)"
                )
            self._context = self._engine.create_execution_context()
            self._stream = torch.cuda.Stream(self._device)
        self._signature = plan_signature(self._engine)
        self._inputs = [t.name for t in self._signature.inputs]
        self._outputs = [t.name for t in self._signature.outputs]
        self._output_dtypes = {n: numpy_dtype(self._engine.get_tensor_dtype(n).name) for n in self._outputs}
        self._profiles = [
            ProfileRange(i, *self._batch_range(i)) for i in range(self._engine.num_optimization_profiles)
        ]

    def _batch_range(self, profile: int) -> tuple[int, int]:
        low, _, high = self._engine.get_tensor_profile_shape(self._inputs[0], profile)
        return int(low[0]), int(high[0])

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self._torch
        batch = len(next(iter(inputs.values())))
        profile = choose_profile(self._profiles, batch)
        keep = []  # device tensors must live until the stream is done
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            self._context.set_optimization_profile_async(profile, self._stream.cuda_stream)
            for name in self._inputs:
                array = np.ascontiguousarray(inputs[name])
                if not array.flags.writeable:  # torch wants writable memory; request buffers are not
                    array = array.copy()
                tensor = torch.from_numpy(array).to(self._device, non_blocking=True)
                self._context.set_input_shape(name, tuple(tensor.shape))
                self._context.set_tensor_address(name, tensor.data_ptr())
                keep.append(tensor)
            outputs = {}
            for name in self._outputs:
                shape = tuple(self._context.get_tensor_shape(name))
                dtype = getattr(torch, self._output_dtypes[name].name)
                outputs[name] = torch.empty(shape, dtype=dtype, device=self._device)
                self._context.set_tensor_address(name, outputs[name].data_ptr())
            if not self._context.execute_async_v3(self._stream.cuda_stream):
                raise EngineError("TensorRT failed to run the batch")
            self._stream.synchronize()
        return {name: tensor.cpu().numpy() for name, tensor in outputs.items()}

    def signature(self) -> EngineSignature:
        return self._signature

    def describe(self) -> EngineDescription:
        import tensorrt as trt

        return EngineDescription(
            engine="tensorrt",
            device=str(self._device),
            precision=self._precision,
            providers=[f"TensorRT {trt.__version__}", f"{len(self._profiles)} profiles"],
            artifact=str(self._path),
        )
