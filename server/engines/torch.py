"""PyTorch engine: programs saved with `torch.export`, run eagerly under inference mode.

Only `torch.export` archives are loaded, never plain pickles; an archive may still unpickle parts
of itself (constants, custom objects), so it is code like any artifact: `artifact_path` checks it
against its version folder's recorded digests before torch opens it (docs/operations.md, trust
boundary).
Inputs map to the program's positional arguments in config order (a tokenized text input as its
token tensors), outputs likewise; the program's own tensor names play no part.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import torch

from server.config import ModelConfig
from server.devices import Device
from server.engines.base import Engine, EngineDescription, artifact_path
from server.engines.signature import EngineSignature, TensorSignature, engine_inputs, engine_outputs
from server.errors import EngineError

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# torch dtypes -> v2 datatypes
_DATATYPES = {
    torch.bool: "BOOL",
    torch.uint8: "UINT8",
    torch.int8: "INT8",
    torch.int16: "INT16",
    torch.int32: "INT32",
    torch.int64: "INT64",
    torch.float16: "FP16",
    torch.bfloat16: "BF16",
    torch.float32: "FP32",
    torch.float64: "FP64",
}
# torch.export keeps global (de)serializer state: two loads at once (models load, and builds
# run, in parallel threads) fail with "_CURRENT_DESERIALIZER is already set". Every
# torch.export load, export and save in the process holds this lock.
EXPORT_LOCK = threading.RLock()


def load_program(path: Path) -> torch.export.ExportedProgram:
    """torch.export.load, one at a time in the process. INT8 programs (PT2E, `batchline build
    --engine torch --precision int8`) call the quantized_decomposed ops, which torch registers
    only when their module is imported."""
    with EXPORT_LOCK:
        import torch.ao.quantization.fx._decomposed

        return torch.export.load(str(path))


def _compiled(module: torch.nn.Module, config: ModelConfig) -> torch.nn.Module:
    """torch.compile with static shapes: each batch bucket (and sequence bucket) compiles once,
    at warm-up, which runs them all; the pipeline pads every batch to a bucket, so serving never
    meets a new shape. The recompile limit is raised to cover the ladder, no further."""
    sequences = config.tokenize.sequence_buckets if config.tokenize and config.tokenize.sequence_buckets else [1]
    shapes = len(config.batch_buckets or [1]) * len(sequences)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, shapes + 1)
    return torch.compile(module, dynamic=False)


class TorchEngine(Engine):
    def __init__(self, config: ModelConfig, version_dir: Path, device: Device) -> None:
        if config.precision not in _DTYPES:
            raise EngineError(f"the torch engine serves fp32, fp16 or bf16, not {config.precision}")
        if device.kind == "GPU" and not torch.cuda.is_available():
            raise EngineError("the torch engine was placed on a GPU, but torch sees no CUDA device")
        self._path = artifact_path(config, version_dir, "model.pt2")
        self._device = torch.device(str(device))
        self._dtype = _DTYPES[config.precision]
        self._precision = config.precision
        if config.torch.num_threads:
            torch.set_num_threads(config.torch.num_threads)
        try:
            program = load_program(self._path)
        except Exception as exc:  # torch raises many types for a bad archive
            raise EngineError(f"torch cannot load {self._path}: {exc}") from exc
        self._signature = program_signature(program)
        with EXPORT_LOCK:  # .module() may import torch.export internals on first use
            self._module = program.module().to(self._device)
        if self._dtype != torch.float32:
            self._module = self._module.to(self._dtype)
        self._compiled = config.torch.compile
        if self._compiled:
            self._module = _compiled(self._module, config)
        self._input_names = [t.engine_name for t in engine_inputs(config)]
        self._output_names = [t.engine_name for t in engine_outputs(config)]

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        if not array.flags.writeable:  # torch wants writable memory; request buffers are not
            array = array.copy()
        tensor = torch.from_numpy(array).to(self._device)
        return tensor.to(self._dtype) if tensor.is_floating_point() else tensor

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            with torch.inference_mode():
                result = self._module(*(self._tensor(inputs[n]) for n in self._input_names))
        except Exception as exc:
            raise EngineError(f"torch failed: {exc}") from exc
        results = result if isinstance(result, (tuple, list)) else (result,)
        if len(results) != len(self._output_names):
            raise EngineError(
                f"the program returned {len(results)} outputs, the config declares {len(self._output_names)}"
            )
        return {
            name: (t.float() if t.dtype in (torch.float16, torch.bfloat16) else t).cpu().numpy()
            for name, t in zip(self._output_names, results)
        }

    def signature(self) -> EngineSignature:
        return self._signature

    def describe(self) -> EngineDescription:
        return EngineDescription(
            engine="torch",
            device=str(self._device),
            precision=self._precision,
            providers=[f"torch {torch.__version__}" + (" compiled" if self._compiled else "")],
            artifact=str(self._path),
        )


def program_signature(program: torch.export.ExportedProgram) -> EngineSignature:
    """The program's user inputs and outputs from their fake-tensor metadata; symbolic sizes
    are variable. Matched by position, and floating inputs are cast to the engine's precision."""
    nodes = {node.name: node for node in program.graph.nodes}

    def tensor(name: str) -> TensorSignature:
        node = nodes.get(name)
        value = node.meta.get("val") if node is not None else None
        if not isinstance(value, torch.Tensor):  # a constant or non-tensor argument
            return TensorSignature(name, None, None, type(value).__name__)
        shape = tuple(d if isinstance(d, int) else None for d in value.shape)  # SymInt: symbolic
        return TensorSignature(name, _DATATYPES.get(value.dtype), shape, str(value.dtype))

    return EngineSignature(
        inputs=tuple(tensor(n) for n in program.graph_signature.user_inputs),
        outputs=tuple(tensor(str(n)) for n in program.graph_signature.user_outputs),
        positional=True,
        casts_float_inputs=True,
    )
