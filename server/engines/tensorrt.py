"""TensorRT engine: serves a plan built by `batchline build --engine tensorrt`, on a GPU.

TensorRT 10 only: the major ONNX Runtime's TensorRT provider links, and the last with
BuilderFlag.FP16/BF16/INT8 (TensorRT 11 builds strongly typed networks only). A plan runs only
under the TensorRT version that built it, so the engine refuses another major at load.

The plan holds one optimization profile per batch bucket (server/engines/profiles.py); each
batch runs under the profile whose batch range holds it. Device buffers are torch CUDA tensors,
so no extra CUDA binding is needed; run() reaches CUDA only through `CudaPlace`. Inputs must come
in the plan's own types (a float64 batch for a float32 plan is refused, not reinterpreted);
outputs come back in numpy's types, BF16 and FP8 (which numpy lacks) as float32. Profile choice,
type mapping, guards, run() and close() are unit-tested with a fake plan on CPU tensors; the run
on a GPU has not been executed on the machines this was written on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from server.devices import Device
from server.engines.base import Engine, EngineDescription
from server.engines.signature import EngineSignature, TensorSignature
from server.engines.spec import EngineSpec
from server.errors import EngineError, InvalidInput
from server.protocol.datatypes import v2_datatype

NOT_INSTALLED = "TensorRT is not installed on this machine (it needs an NVIDIA GPU machine: pip install tensorrt)"
TENSORRT_MAJOR = 10
INSTALL_TENSORRT = "pip install 'tensorrt>=10,<11'"

# TensorRT DataType names -> the numpy dtypes inputs are fed in (by name, so this module
# imports without TensorRT). numpy has no BF16 or FP8: plans taking them are refused at load.
DTYPES: dict[str, np.dtype[Any]] = {
    "FLOAT": np.dtype(np.float32),
    "HALF": np.dtype(np.float16),
    "INT8": np.dtype(np.int8),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
}
# TensorRT DataType names -> (the torch dtype of the device buffer TensorRT writes, the numpy
# dtype run() returns). FP8 is TensorRT's E4M3.
OUTPUT_TYPES: dict[str, tuple[str, np.dtype[Any]]] = {
    **{name: (dtype.name, dtype) for name, dtype in DTYPES.items()},
    "BF16": ("bfloat16", np.dtype(np.float32)),
    "FP8": ("float8_e4m3fn", np.dtype(np.float32)),
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


def unsupported_tensorrt(version: str) -> str | None:
    """Why this TensorRT version will not do, or None for a 10.x."""
    major = version.split(".", 1)[0]
    if major.isdigit() and int(major) == TENSORRT_MAJOR:
        return None
    return (
        f"TensorRT {version} is installed, but Batchline builds and serves plans with TensorRT {TENSORRT_MAJOR}"
        " (the major ONNX Runtime's TensorRT provider links; TensorRT 11 removed BuilderFlag.FP16/BF16/INT8"
        f" for strongly typed networks): {INSTALL_TENSORRT}"
    )


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
    (dynamic, bounded by the optimization profiles) are variable. Outputs carry the datatype
    run() returns them in (a BF16 or FP8 output: FP32). Reads enum names only, so it runs, and
    is tested, without TensorRT."""
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]

    def tensor(name: str, output: bool) -> TensorSignature:
        dtype = engine.get_tensor_dtype(name).name
        shape = tuple(int(d) if d >= 0 else None for d in engine.get_tensor_shape(name))
        if output:
            datatype = v2_datatype(OUTPUT_TYPES[dtype][1]) if dtype in OUTPUT_TYPES else None
        else:
            datatype = DATATYPES.get(dtype)
        return TensorSignature(name, datatype, shape, dtype)

    is_input = {n: engine.get_tensor_mode(n).name == "INPUT" for n in names}
    return EngineSignature(
        inputs=tuple(tensor(n, False) for n in names if is_input[n]),
        outputs=tuple(tensor(n, True) for n in names if not is_input[n]),
    )


def numpy_dtype(trt_dtype_name: str) -> np.dtype[Any]:
    """The numpy dtype an input of this TensorRT type is fed in."""
    if trt_dtype_name not in DTYPES:
        raise EngineError(f"TensorRT tensor type {trt_dtype_name} is not supported by this engine")
    return DTYPES[trt_dtype_name]


class CudaPlace:
    """The GPU an engine runs on and a stream of its own: the engine reaches CUDA only through
    this (the unit tests put a stand-in on the CPU in its place)."""

    def __init__(self, torch: Any, device: Device) -> None:
        self._torch = torch
        self.device = torch.device(str(device))
        self.stream = torch.cuda.Stream(self.device)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """This device current, and this stream current on it (entered inside the `with`, so
        neither leaks when the other fails)."""
        with self._torch.cuda.device(self.device), self._torch.cuda.stream(self.stream):
            yield

    @property
    def stream_handle(self) -> int:
        return int(self.stream.cuda_stream)

    def synchronize(self) -> None:
        self.stream.synchronize()


class TensorRTEngine(Engine):
    def __init__(self, spec: EngineSpec[None], device: Device) -> None:
        # released in the reverse order by close(); None until made
        self._runtime: Any = None
        self._engine: Any = None
        self._context: Any = None
        self._place: CudaPlace | None = None
        if device.kind != "GPU":
            raise EngineError("the tensorrt engine runs on a GPU: give the model an instance_group of kind GPU")
        try:
            import tensorrt as trt
        except ImportError as exc:
            raise EngineError(NOT_INSTALLED) from exc
        if (problem := unsupported_tensorrt(trt.__version__)) is not None:
            raise EngineError(problem)
        import torch

        if not torch.cuda.is_available():
            raise EngineError("the tensorrt engine was placed on a GPU, but torch sees no CUDA device")
        self._torch = torch
        self._version = trt.__version__
        self._precision = spec.precision
        self._path = spec.artifact  # checked against its digest
        try:
            self._load(trt, device)
        except BaseException:
            self.close()  # a half-made engine is released in order too, not by the garbage collector
            raise

    def _load(self, trt: Any, device: Device) -> None:
        self._place = CudaPlace(self._torch, device)
        with self._place.active():
            # Kept for the engine's lifetime: the engine a runtime deserialized must not outlive it.
            self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
            self._engine = self._runtime.deserialize_cuda_engine(self._path.read_bytes())
            if self._engine is None:
                raise EngineError(
                    f"TensorRT cannot load {self._path}: plans are valid only for the GPU model and "
                    "TensorRT version they were built with (rebuild it on this machine)"
                )
            self._context = self._engine.create_execution_context()
            if self._context is None:
                raise EngineError(f"TensorRT cannot make an execution context for {self._path} (out of GPU memory?)")
        self._signature = plan_signature(self._engine)
        self._input_dtypes = {t.name: self._input_dtype(t) for t in self._signature.inputs}
        self._output_types = {t.name: self._output_type(t) for t in self._signature.outputs}
        self._profiles = [
            ProfileRange(i, *self._batch_range(i)) for i in range(self._engine.num_optimization_profiles)
        ]

    @staticmethod
    def _input_dtype(tensor: TensorSignature) -> np.dtype[Any]:
        if tensor.native_type not in DTYPES:
            raise EngineError(
                f"the plan's input '{tensor.name}' is {tensor.native_type}, which this engine cannot feed"
                f" (it takes {', '.join(DTYPES)}): build the plan with FP32 or FP16 inputs"
            )
        return DTYPES[tensor.native_type]

    @staticmethod
    def _output_type(tensor: TensorSignature) -> tuple[str, np.dtype[Any]]:
        if tensor.native_type not in OUTPUT_TYPES:
            raise EngineError(
                f"the plan's output '{tensor.name}' is {tensor.native_type}, which this engine cannot return"
                f" (it returns {', '.join(OUTPUT_TYPES)})"
            )
        return OUTPUT_TYPES[tensor.native_type]

    def _batch_range(self, profile: int) -> tuple[int, int]:
        low, _, high = self._engine.get_tensor_profile_shape(next(iter(self._input_dtypes)), profile)
        return int(low[0]), int(high[0])

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._context is None or self._place is None:
            raise EngineError("the TensorRT engine is closed")
        torch, place, context = self._torch, self._place, self._context
        arrays = self._feed(inputs)
        profile = choose_profile(self._profiles, len(next(iter(arrays.values()))))
        keep = []  # device tensors must live until the stream is done
        with place.active():
            context.set_optimization_profile_async(profile, place.stream_handle)
            for name, array in arrays.items():
                tensor = torch.from_numpy(array).to(place.device, non_blocking=True)
                context.set_input_shape(name, tuple(tensor.shape))
                context.set_tensor_address(name, tensor.data_ptr())
                keep.append(tensor)
            outputs = {}
            for name, (device_type, _) in self._output_types.items():
                shape = tuple(int(d) for d in context.get_tensor_shape(name))
                if any(d < 0 for d in shape):
                    raise EngineError(f"output '{name}' has a shape TensorRT knows only after the run: not supported")
                outputs[name] = torch.empty(shape, dtype=getattr(torch, device_type), device=place.device)
                context.set_tensor_address(name, outputs[name].data_ptr())
            if not context.execute_async_v3(place.stream_handle):
                raise EngineError("TensorRT failed to run the batch")
            place.synchronize()
            return {name: self._to_host(name, tensor) for name, tensor in outputs.items()}

    def _feed(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every input the plan takes, in its own type and contiguous: TensorRT reads raw memory,
        so a batch of another type would be read as garbage, not converted."""
        arrays = {}
        for name, dtype in self._input_dtypes.items():
            if name not in inputs:
                raise InvalidInput(f"the TensorRT plan takes input '{name}', which the batch lacks")
            array = inputs[name]
            if array.dtype != dtype:
                raise InvalidInput(f"input '{name}': the TensorRT plan takes {dtype}, the batch is {array.dtype}")
            array = np.ascontiguousarray(array)
            if not array.flags.writeable:  # torch wants writable memory; request buffers are not
                array = array.copy()
            arrays[name] = array
        return arrays

    def _to_host(self, name: str, tensor: Any) -> np.ndarray:
        """The output as numpy holds it: BF16 and FP8 are widened to float32 on the device first."""
        host = self._output_types[name][1]
        if tensor.dtype != getattr(self._torch, host.name):
            tensor = tensor.to(getattr(self._torch, host.name))
        return tensor.cpu().numpy()

    @property
    def compiles_per_shape(self) -> bool:
        """A plan's first run in an optimization profile, or at a new input shape, does work later
        runs skip (the profile switched to, shapes inferred, kernels loaded on first use under
        CUDA's lazy loading): warm-up meets it at every shape, not a client."""
        return True

    def signature(self) -> EngineSignature:
        return self._signature

    def describe(self) -> EngineDescription:
        return EngineDescription(
            engine="tensorrt",
            device=str(self._place.device if self._place else "closed"),
            precision=self._precision,
            providers=[f"TensorRT {self._version}", f"{len(self._profiles)} profiles"],
            artifact=str(self._path),
        )

    def close(self) -> None:
        """Release the execution context, then the engine, then the runtime that deserialized it
        (each needs the next alive), once the stream's work is done and with the engine's device
        current, so the device memory is freed there. Safe to call twice, and on a half-made engine."""
        place = self._place
        try:
            if place is not None and self._runtime is not None:
                with place.active():
                    place.synchronize()
                    self._release()
        finally:
            self._release()  # the device failed above: released all the same, in the same order

    def _release(self) -> None:
        self._context = None
        self._engine = None
        self._runtime = None
