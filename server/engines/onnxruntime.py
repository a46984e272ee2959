"""ONNX Runtime engine: CPU, CUDA or TensorRT execution providers, verified after loading.

`onnxruntime-gpu` lists CUDA as *available* on machines without a GPU and then silently runs on
the CPU, so the providers that took are read back from the session and checked against the ask.
Graphs with string tensors (`tensor(string)`) take and give Python `str`, where BYTES tensors
hold `bytes`: the engine converts both ways, so the v2 codec stays one for every engine.
On a GPU, a batch runs through ORT's I/O binding: inputs copied to the device once, outputs left
there and copied back together; graphs with tensors that cannot live on a device keep `run`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from server.config import OnnxRuntimeOptions
from server.devices import Device
from server.engines.base import Engine, EngineDescription
from server.engines.digests import file_digest
from server.engines.profiles import cache_root, provider_shapes
from server.engines.signature import EngineSignature, TensorSignature
from server.engines.spec import EngineSpec
from server.errors import EngineError
from server.versions import tensorrt_version

_OPTIMIZATION_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
_GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")
logger = logging.getLogger(__name__)
# ONNX Runtime's type names -> v2 datatypes
_DATATYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(bfloat16)": "BF16",
    "tensor(string)": "BYTES",
}
_STRING = "tensor(string)"


def requested_providers(spec: EngineSpec[OnnxRuntimeOptions], device: Device) -> list[str | tuple[str, dict]]:
    """The provider list for a session on `device`, GPU providers pinned to its index, the
    TensorRT provider with the options of `onnxruntime.tensorrt`."""
    names = list(spec.options.execution_providers)
    if device.kind == "GPU":
        if not any(n in _GPU_PROVIDERS for n in names):
            names = ["CUDAExecutionProvider", *names]
    else:
        names = [n for n in names if n not in _GPU_PROVIDERS] or ["CPUExecutionProvider"]
    if "CPUExecutionProvider" not in names:
        names.append("CPUExecutionProvider")
    return [
        (n, tensorrt_provider_options(spec, device) if n == "TensorrtExecutionProvider"
         else cuda_provider_options(spec.options, device))
        if n in _GPU_PROVIDERS else n
        for n in names
    ]


def cuda_provider_options(options: OnnxRuntimeOptions, device: Device) -> dict[str, Any]:
    """ORT's CUDA EP options: the device, and how cuDNN picks convolution algorithms. HEURISTIC
    by default, where ORT's own default, EXHAUSTIVE, times every algorithm at each new input
    shape and so stalls the first batch of a size that warm-up did not run."""
    return {"device_id": device.index, "cudnn_conv_algo_search": options.cudnn_conv_algo_search}


@functools.cache
def preload_cuda_libraries() -> str:
    """Make the CUDA and cuDNN libraries loadable before the first CUDA session, once a process.

    PyPI's onnxruntime-gpu has no RUNPATH to the nvidia-* wheels' libraries: they resolve only
    after `onnxruntime.preload_dlls()` (1.21+) or an `import torch` that loaded them. Returns
    which ran ("preload_dlls", "torch" or "none"). A failure is only logged: the session then
    fails, or falls back to the CPU, and check_providers refuses it with the reason.
    preload_dlls prints what it failed to load instead of raising: that goes to the log."""
    try:
        if hasattr(ort, "preload_dlls"):
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                ort.preload_dlls()
            if printed.getvalue().strip():
                logger.warning("ONNX Runtime's preload of the CUDA libraries said: %s", printed.getvalue().strip())
            return "preload_dlls"
        import torch  # noqa: F401  (its import loads the CUDA libraries it was built with)

        return "torch"
    except (ImportError, OSError, RuntimeError) as exc:  # no torch, a library that will not load
        logger.warning("CUDA libraries not preloaded for ONNX Runtime: %s", exc)
        return "none"


def tensorrt_provider_options(spec: EngineSpec[OnnxRuntimeOptions], device: Device) -> dict[str, Any]:
    """ORT's TensorRT EP options: precision flags, workspace, engine and timing caches, and one
    profile spanning the batch buckets.

    ORT names its cached engines after the graph's file, node and tensor names, not its weights,
    and asks users to clear the cache when the model, the profiles or TensorRT change: so the
    cache folder is keyed by everything that makes an engine stale (ort_cache_folder)."""
    trt = spec.options.tensorrt
    shapes = provider_shapes(spec.io) if trt.explicit_profiles else {}
    options: dict[str, Any] = {
        "device_id": device.index,
        "trt_fp16_enable": trt.fp16,
        "trt_int8_enable": trt.int8,
        "trt_max_workspace_size": trt.workspace_mb << 20,
        "trt_engine_cache_enable": trt.engine_cache,
        "trt_timing_cache_enable": trt.timing_cache,
    }
    if trt.engine_cache or trt.timing_cache:
        try:
            folder = ort_cache_folder(spec.artifact, device, {**options, **shapes})
            folder.mkdir(parents=True, exist_ok=True)  # ORT creates one level only
        except OSError as exc:
            raise EngineError(f"the TensorRT cache folder for {spec.artifact} cannot be made: {exc}") from exc
        if trt.engine_cache:
            options["trt_engine_cache_path"] = str(folder)
        if trt.timing_cache:
            options["trt_timing_cache_path"] = str(folder)
    return {**options, **shapes}


def ort_cache_folder(artifact: Path, device: Device, options: dict[str, Any]) -> Path:
    """$BATCHLINE_TENSORRT_CACHE/ort/<key>: the artifact's bytes, the options that shape an engine
    (precision flags, workspace, profiles), the GPU model, and the ORT and TensorRT versions."""
    from server.gpu import identity

    material = {
        "artifact": file_digest(artifact),
        "options": {k: v for k, v in options.items() if k != "device_id"},
        "gpu": identity(device.index),
        "onnxruntime": ort.__version__,
        "tensorrt": tensorrt_version() or "system",  # "system": libraries ORT finds on its own
    }
    key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root() / "ort" / key


def check_providers(requested: list[str | tuple[str, dict]], taken: list[str]) -> None:
    """Refuse a session that fell back to the CPU when an accelerator was asked for."""
    first = requested[0] if isinstance(requested[0], str) else requested[0][0]
    if first not in taken:
        raise EngineError(
            f"ONNX Runtime was asked for {first} but the session runs on {', '.join(taken)}"
            " (is a GPU present and onnxruntime-gpu installed?)"
        )


def binding_device(session: ort.InferenceSession, device: Device) -> tuple[str, int] | None:
    """Where a batch's outputs are bound: the GPU of a session that really runs there (read
    back, not asked for); None, the plain `run`, on the CPU, where binding gains nothing, and for
    graphs with tensors that cannot live on a device (strings, sequences, maps)."""
    if device.kind != "GPU" or not any(p in _GPU_PROVIDERS for p in session.get_providers()):
        return None
    nodes = [*session.get_inputs(), *session.get_outputs()]
    if any(node.type == _STRING or not node.type.startswith("tensor(") for node in nodes):
        return None
    return ("cuda", device.index)


def run_bound(
    session: ort.InferenceSession, inputs: dict[str, np.ndarray], output_names: list[str], device: tuple[str, int]
) -> list[np.ndarray]:
    """One batch through I/O binding: each input copied from host memory to the device once,
    each output allocated on `device` by ORT and all copied back together after the run, in
    the order of `output_names`. A fresh binding per batch holds no batch past its run."""
    binding = session.io_binding()
    for name, array in inputs.items():
        binding.bind_cpu_input(name, array)
    for name in output_names:
        binding.bind_output(name, *device)
    session.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()


def _kernel_hint(exc: Exception, providers: list[Any]) -> str:
    """What to do about ONNX Runtime's "Could not find an implementation for Add(14)", which
    names neither the datatype nor the provider: most often a BF16 (or FP16) model on the CPU."""
    if "Could not find an implementation" not in str(exc):
        return ""
    names = ", ".join(p if isinstance(p, str) else p[0] for p in providers)
    return (f" (no kernel of {names} runs that operator at the datatypes it is given here: the CPU provider "
            "lacks most BF16 and some FP16 kernels; export the model in FP32 for the CPU, or serve it on a GPU)")


class OnnxRuntimeEngine(Engine):
    def __init__(self, spec: EngineSpec[OnnxRuntimeOptions], device: Device) -> None:
        self._path = spec.artifact
        self._precision = spec.precision
        self._device = device
        options = ort.SessionOptions()
        options.intra_op_num_threads = spec.options.intra_op_num_threads
        options.inter_op_num_threads = spec.options.inter_op_num_threads
        options.graph_optimization_level = _OPTIMIZATION_LEVELS[spec.options.graph_optimization_level]
        providers = requested_providers(spec, device)
        if device.kind == "GPU":
            preload_cuda_libraries()
        try:
            self._session = ort.InferenceSession(str(self._path), options, providers=providers)
        except Exception as exc:  # ORT raises its own untyped errors (Fail, InvalidGraph, ...)
            raise EngineError(f"ONNX Runtime cannot load {self._path}: {exc}{_kernel_hint(exc, providers)}") from exc
        self._providers = list(self._session.get_providers())
        check_providers(providers, self._providers)
        self._output_names = [o.name for o in self._session.get_outputs()]
        self._string_inputs = {i.name for i in self._session.get_inputs() if i.type == _STRING}
        self._string_outputs = {o.name for o in self._session.get_outputs() if o.type == _STRING}
        self._binding_device = binding_device(self._session, device)

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._binding_device is not None:
            try:
                results = run_bound(self._session, inputs, self._output_names, self._binding_device)
            except Exception as exc:
                raise EngineError(f"ONNX Runtime failed: {exc}") from exc
            return dict(zip(self._output_names, results))
        feed = {
            name: as_text(array, name) if name in self._string_inputs else array for name, array in inputs.items()
        }
        try:
            results = self._session.run(self._output_names, feed)
        except Exception as exc:
            raise EngineError(f"ONNX Runtime failed: {exc}") from exc
        return {
            name: as_bytes(result) if name in self._string_outputs else result
            for name, result in zip(self._output_names, results)
        }

    @property
    def compiles_per_shape(self) -> bool:
        """The TensorRT provider builds engines for the shapes it meets, and the CUDA provider
        with cuDNN's EXHAUSTIVE search times every convolution algorithm at each new shape; the
        CPU, and CUDA with HEURISTIC or DEFAULT, prepare nothing per shape. Read from the
        session (the providers that took, and their options), not from what was asked."""
        if "TensorrtExecutionProvider" in self._providers:
            return True
        if "CUDAExecutionProvider" not in self._providers:
            return False
        cuda = self._session.get_provider_options().get("CUDAExecutionProvider", {})
        return cuda.get("cudnn_conv_algo_search") == "EXHAUSTIVE"

    def signature(self) -> EngineSignature:
        return EngineSignature(
            inputs=tuple(tensor_signature(i) for i in self._session.get_inputs()),
            outputs=tuple(tensor_signature(o) for o in self._session.get_outputs()),
        )

    def describe(self) -> EngineDescription:
        return EngineDescription(
            engine="onnxruntime",
            device=str(self._device),
            precision=self._precision,
            providers=self._providers,
            artifact=str(self._path),
        )


def tensor_signature(node: ort.NodeArg) -> TensorSignature:
    """Symbolic and unknown dims are variable. ORT reports an empty shape both for scalars and
    for tensors of unknown rank; it is read as unknown, and warm-up checks what comes back."""
    dims = node.shape
    shape = tuple(d if isinstance(d, int) and d >= 0 else None for d in dims) if dims else None
    return TensorSignature(node.name, _DATATYPES.get(node.type), shape, node.type)


def as_text(array: np.ndarray, name: str) -> np.ndarray:
    """A BYTES tensor (bytes items) as ONNX Runtime's string tensors need it: `str` items."""
    text = np.empty(array.shape, dtype=object)
    flat = text.reshape(-1)
    for index, item in enumerate(array.reshape(-1)):
        try:
            flat[index] = item.decode() if isinstance(item, bytes) else item
        except UnicodeDecodeError as exc:
            raise EngineError(
                f"input '{name}' item {index} is not UTF-8 text, which a string tensor needs") from exc
    return text


def as_bytes(array: np.ndarray) -> np.ndarray:
    """An ONNX Runtime string tensor (str items) as a BYTES tensor: UTF-8 `bytes` items."""
    encoded = np.empty(array.shape, dtype=object)
    flat = encoded.reshape(-1)
    # item by item: from a list, numpy would make an 'S' array, which strips trailing NULs
    for index, item in enumerate(array.reshape(-1)):
        flat[index] = item.encode() if isinstance(item, str) else item
    return encoded
