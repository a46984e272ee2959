"""PyTorch engine: programs saved with `torch.export`, run under inference mode, eagerly or
compiled once per bucket (`torch: {compile: true}`).

Only `torch.export` archives are loaded, never plain pickles; an archive may still unpickle parts
of itself (constants, custom objects), so it is code like any artifact: `EngineSpec.from_config`
checks it against its version folder's recorded digests before torch opens it (docs/operations.md,
trust boundary).
Inputs map to the program's positional arguments in config order (a tokenized text input as its
token tensors), outputs likewise; the program's own tensor names play no part.

On a GPU, torch.export's device pass moves the whole program (weights, buffers, the constants
lifted into its graph, device arguments burnt into its nodes), and each instance owns a CUDA
stream: a batch's inputs are staged in pinned host memory and copied without blocking, the
program runs, and its outputs are copied back into pinned memory, all enqueued on that stream;
the thread then waits once, for the whole batch. Instances on one GPU wait on their own streams,
so their batches overlap. On the CPU none of that applies: the program reads the request's own
memory and its outputs are returned as they are.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.export.passes import move_to_device_pass

from server.config import TorchOptions
from server.devices import Device
from server.engines.base import Engine, EngineDescription
from server.engines.signature import EngineSignature, TensorSignature, engine_inputs, engine_outputs
from server.engines.spec import EngineIO, EngineSpec
from server.errors import ConfigMismatch, EngineError

logger = logging.getLogger(__name__)

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

        try:
            return torch.export.load(str(path))
        except ModuleNotFoundError as exc:  # a torchao INT8 build: its weights are torchao tensors
            if (exc.name or "").partition(".")[0] != "torchao":
                raise
            raise ModuleNotFoundError(
                "torchao is not installed: pip install torchao==0.18.0 (batchline's `torchao` extra);"
                " this program is a torch INT8 build, whose weights are torchao tensors",
                name=exc.name,
            ) from exc


# torch.compile is lazy: a program compiles for a shape the first time it runs at it. Dynamo and
# Inductor are not safe to run in two threads at once, and a compile takes seconds of every core:
# models loading in parallel compile one bucket at a time, process-wide.
COMPILE_LOCK = threading.Lock()


def program_module(program: torch.export.ExportedProgram, device: torch.device) -> torch.nn.Module:
    """The program as a module on `device`. Off the CPU, torch.export's device pass moves it
    first, graph and all: `program.module().to(device)` would move parameters and buffers only,
    leaving the constants lifted into the graph, and device arguments burnt into its nodes, on
    the CPU."""
    with EXPORT_LOCK:  # .module() may import torch.export internals on first use
        if device.type != "cpu":
            program = move_to_device_pass(program, device)
        return program.module()


def cast_module(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The module's floating parameters, buffers and constants in `dtype`. `Module.to` leaves
    constants (plain tensor attributes, where an exported program keeps its lifted constants)
    alone, and one left in FP32 would promote the half-precision activations it meets."""
    module = module.to(dtype)
    for submodule in module.modules():
        for name, value in list(vars(submodule).items()):
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
                setattr(submodule, name, value.to(dtype))
    return module


def compile_options(mode: str) -> dict[str, Any]:
    """Inductor's options for a torch.compile mode. Modes that record CUDA graphs (reduce-overhead,
    max-autotune) record them without CUDA graph trees: a tree belongs to the thread that first
    runs a graph and keeps the graphs of every program it runs in one memory pool, which instances
    replaying on their own threads and streams would overwrite under one another. Each bucket's
    graph gets a pool of its own instead: more device memory, nothing shared."""
    options = dict(torch._inductor.list_mode_options(mode, dynamic=False))
    if options.get("triton.cudagraphs"):
        options["triton.cudagraph_trees"] = False
    return options


def _compiled(module: torch.nn.Module, io: EngineIO, mode: str) -> torch.nn.Module:
    """torch.compile with static shapes: each batch bucket, times each sequence bucket of a text
    model, compiles once, the first time it runs. Model warm-up (server/model.py) runs every one
    of them and the pipeline pads every batch to a bucket, so serving never meets a new shape.
    The recompile limit is raised to cover the buckets, no further."""
    sequences = io.tokens.sequence_buckets if io.tokens and io.tokens.sequence_buckets else (1,)
    shapes = len(io.batch_buckets or (1,)) * len(sequences)
    with COMPILE_LOCK:  # process-wide settings
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, shapes + 1)
    options = compile_options(mode)
    compiled = torch.compile(module, dynamic=False, options=options or None)
    assert isinstance(compiled, torch.nn.Module)  # a compiled module is a module (OptimizedModule)
    return compiled


class TorchEngine(Engine):
    def __init__(self, spec: EngineSpec[TorchOptions], device: Device) -> None:
        if spec.precision not in _DTYPES:
            raise EngineError(f"the torch engine serves fp32, fp16 or bf16, not {spec.precision}")
        if device.kind == "GPU" and not torch.cuda.is_available():
            raise EngineError("the torch engine was placed on a GPU, but torch sees no CUDA device")
        self._path = spec.artifact
        self._device = torch.device(str(device))
        self._dtype = _DTYPES[spec.precision]
        self._precision = spec.precision
        self._name = spec.io.model
        self._batched = spec.io.batched
        if spec.options.num_threads:
            torch.set_num_threads(spec.options.num_threads)
        try:
            program = load_program(self._path)
        except Exception as exc:  # torch raises many types for a bad archive
            raise EngineError(f"torch cannot load {self._path}: {exc}") from exc
        problem = structure_problem(program)
        if problem is not None:
            raise EngineError(f"{self._path}: {problem}")
        limits = batch_range(program) if self._batched else None
        if limits is not None and limits[1] is not None and spec.io.max_batch_size > limits[1]:
            raise ConfigMismatch(f"max_batch_size {spec.io.max_batch_size} is over the {limits[1]} the program was "
                                 "exported for (its batch dim's max): lower it, or export with a larger max")
        self._signature = program_signature(program)
        self._module = program_module(program, self._device)
        if self._dtype != torch.float32:
            self._module = cast_module(self._module, self._dtype)
        self._stream: torch.cuda.Stream | None = None
        if self._device.type == "cuda":
            # the weights were copied on the default stream, which the instance's does not wait for
            torch.cuda.synchronize(self._device)
            self._stream = torch.cuda.Stream(self._device)
        self._compiled = spec.options.compile
        self._compile_mode = spec.options.compile_mode
        # torch keeps the CUDA graphs it records per thread: one thread runs this engine, warm-up
        # included (its instance's), so each shape is compiled and recorded once, here
        self._shapes_compiled: set[tuple[torch.Size, ...]] = set()
        if self._compiled:
            self._module = _compiled(self._module, spec.io, self._compile_mode)
        self._input_names = [t.engine_name for t in engine_inputs(spec.io)]
        self._output_names = [t.engine_name for t in engine_outputs(spec.io)]
        tokens = spec.io.tokens.input_ids if spec.io.tokens else None
        self._sequence_index = self._input_names.index(tokens) if tokens in self._input_names else None

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            with torch.inference_mode():
                if self._stream is not None:
                    return self._run_on_stream(self._stream, inputs)
                results = self._results(self._forward([self._tensor(inputs[n]) for n in self._input_names]))
                return {name: _widened(t).cpu().numpy() for name, t in zip(self._output_names, results)}
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(f"torch failed: {exc}") from exc

    def _run_on_stream(self, stream: torch.cuda.Stream, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One batch enqueued on the instance's stream, waited for once: inputs staged in pinned
        memory and copied without blocking, the program, outputs copied back into pinned memory."""
        staged = [_pinned(inputs[n]) for n in self._input_names]  # host work, before anything is enqueued
        with torch.cuda.stream(stream):
            tensors = [self._cast(t.to(self._device, non_blocking=True)) for t in staged]
            results = self._results(self._forward(tensors))
            host = []
            for tensor in results:
                tensor = _widened(tensor)
                copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host.append(copy.copy_(tensor, non_blocking=True))
        stream.synchronize()  # the batch's one wait
        # Out of the pinned buffers, which go back to torch's cache for the next batch: pinned
        # memory stays bounded by the batches running, not by the responses still held.
        return {name: t.numpy().copy() for name, t in zip(self._output_names, host)}

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        if not array.flags.writeable:  # torch wants writable memory; request buffers are not
            array = array.copy()
        return self._cast(torch.from_numpy(array))

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self._dtype) if tensor.is_floating_point() else tensor

    @property
    def compiles_per_shape(self) -> bool:
        """torch.compile with static shapes compiles each shape at its first run (and records
        its CUDA graph, where the mode does); an eager program prepares nothing per shape."""
        return self._compiled

    def _forward(self, tensors: list[torch.Tensor]) -> Any:
        if self._compiled:
            shapes = tuple(t.shape for t in tensors)
            if shapes not in self._shapes_compiled:
                return self._first_run(tensors, shapes)
        return self._module(*tensors)

    def _first_run(self, tensors: list[torch.Tensor], shapes: tuple[torch.Size, ...]) -> Any:
        """The first run at a shape compiles it (and records its CUDA graph, where the mode
        does): one at a time in the process, timed and logged. Warm-up runs every bucket on the
        instance's thread, so compiles and graphs are load-time lines, and made once."""
        with COMPILE_LOCK:
            start = time.perf_counter()
            result = self._module(*tensors)
            if self._stream is not None:  # kernels tuned and graphs recorded on the device count too
                self._stream.synchronize()
            seconds = time.perf_counter() - start
        self._shapes_compiled.add(shapes)
        logger.info("compiled %s %s in %.2f s", self._name, self._shape_label(shapes), seconds)
        return result

    def _shape_label(self, shapes: tuple[torch.Size, ...]) -> str:
        """`batch 8`, `batch 8 sequence 128`, or the shapes of an unbatched model's inputs."""
        if not self._batched or not shapes or not shapes[0]:
            return "shapes " + ", ".join("x".join(map(str, s)) or "scalar" for s in shapes)
        label = f"batch {shapes[0][0]}"
        if self._sequence_index is not None:
            label += f" sequence {shapes[self._sequence_index][-1]}"
        return label

    def _results(self, result: Any) -> tuple[torch.Tensor, ...] | list[torch.Tensor]:
        results = result if isinstance(result, (tuple, list)) else (result,)
        if len(results) != len(self._output_names):
            raise EngineError(
                f"the program returned {len(results)} outputs, the config declares {len(self._output_names)}"
            )
        return results

    def signature(self) -> EngineSignature:
        return self._signature

    def describe(self) -> EngineDescription:
        compiled = ""
        if self._compiled:
            compiled = " compiled" if self._compile_mode == "default" else f" compiled {self._compile_mode}"
        return EngineDescription(
            engine="torch",
            device=str(self._device),
            precision=self._precision,
            providers=[f"torch {torch.__version__}{compiled}"],
            artifact=str(self._path),
        )


def _widened(tensor: torch.Tensor) -> torch.Tensor:
    """Half-precision outputs leave as FP32 (numpy has no BF16), cast where they were computed."""
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def _pinned(array: np.ndarray) -> torch.Tensor:
    """`array` copied into pinned host memory, from which a copy to the device need not block
    (a read-only request buffer needs no copy of its own first)."""
    pinned = torch.empty(array.shape, dtype=_torch_dtype(array.dtype), pin_memory=True)
    pinned.numpy()[...] = array
    return pinned


@functools.cache
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def structure_problem(program: torch.export.ExportedProgram) -> str | None:
    """Why the server cannot call `program` as it calls one (tensors in by position, tensors out
    by position), or None when it can: a dict or nested output, a keyword or list argument."""
    from torch.utils._pytree import LeafSpec

    def children(spec: Any) -> list[Any]:  # children() from torch 2.13 on, children_specs before
        return spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs

    def flat(spec: Any) -> bool:
        return isinstance(spec, LeafSpec) or (
            spec.type in (tuple, list) and all(isinstance(c, LeafSpec) for c in children(spec)))

    args, kwargs = children(program.call_spec.in_spec)
    if kwargs.num_leaves or not flat(args):
        return ("its forward takes keyword, list or dict arguments: the server passes tensors by position; export "
                "a wrapper whose forward takes each tensor as an argument of its own")
    if not flat(program.call_spec.out_spec):
        return ("its forward returns a dict or a nested structure: the server reads a tensor or a tuple of tensors; "
                "export a wrapper that returns a tuple")
    return None


def batch_range(program: torch.export.ExportedProgram) -> tuple[int, int | None] | None:
    """The batch sizes `program` was exported for (the bounds of its first input's first dim;
    None for no upper bound), or None when that dim is not variable."""
    first = program.graph_signature.user_inputs[0] if program.graph_signature.user_inputs else None
    node = next((n for n in program.graph.nodes if n.op == "placeholder" and n.name == first), None)
    value = node.meta.get("val") if node is not None else None
    if not isinstance(value, torch.Tensor) or not value.ndim or not hasattr(value.shape[0], "node"):
        return None
    bound = program.range_constraints.get(value.shape[0].node.expr)
    if bound is None:
        return None
    upper = float(bound.upper)  # torch's int_oo says it is finite (an integer); as a float it is inf
    return int(bound.lower), int(upper) if math.isfinite(upper) else None


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
