"""PyTorch builds: FP16/BF16 by cast at load, INT8 by torchao.

- FP16/BF16: the torch engine already casts the program and its floating inputs to the config's
  precision at load, so the build is the same program under a variant config, plus the gate.
- INT8, option `scheme`:
  - `dynamic` (default): torchao `Int8DynamicActivationInt8WeightConfig`: INT8 per-channel
    weights; activations quantized per row at run time; INT8 matmul (`_int_mm`).
  - `weight_only`: torchao `Int8WeightOnlyConfig`: INT8 weights, FP32 compute (memory, not speed).
  - `static`: PT2E (torchao's prepare_pt2e/convert_pt2e, X86 Inductor quantizer) calibrated on
    the training split; it also quantizes convolutions. Run eagerly its Q/DQ operators are
    *simulated* in FP32, so it is slower than FP32 until Inductor (`torch: {compile: true}`)
    lowers the pattern to INT8 kernels.
  Every INT8 program is saved again with torch.export (never a pickle). Its config says precision
  fp32 (inputs stay FP32; the engine must not cast), and the build block records int8. The
  deprecated `torch.ao.quantization` flow is not used.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from server.config import ModelConfig
from server.engines.registry import ENGINES
from server.quantize.builders import BuildContext, BuildOutput, Options
from server.quantize.data import EvalData, TensorData
from server.quantize.errors import BuildError

if TYPE_CHECKING:
    import torch

ARTIFACT = ENGINES["torch"].artifact  # what every torch build writes
MAX_BATCH = 4096


def cast_defaults(source: ModelConfig, data: EvalData) -> Options:
    return {}


def cast(ctx: BuildContext) -> BuildOutput:
    """Same program; the engine casts it to the variant's precision at load."""
    target = ctx.precision
    shutil.copyfile(ctx.source_artifact, ctx.stage / ARTIFACT)
    return BuildOutput(
        ARTIFACT,
        "torch",
        target,
        f"the FP32 program, cast to {target} by the torch engine at load (weights and floating inputs)",
        [f"the artifact is the source's; the config's precision {target} makes the engine cast it"],
    )


SCHEMES = ("dynamic", "weight_only", "static")


def int8_defaults(source: ModelConfig, data: EvalData) -> Options:
    return {"scheme": "dynamic"}


def int8(ctx: BuildContext) -> BuildOutput:
    """INT8 by torchao: `dynamic` (INT8 weights, activations quantized per row at run time),
    `weight_only` (INT8 weights, FP32 compute), or `static` (PT2E, calibrated Q/DQ)."""
    scheme = ctx.options["scheme"]
    if scheme not in SCHEMES:
        raise BuildError(f"scheme must be one of {list(SCHEMES)}, got {scheme!r}")
    if scheme == "dynamic" and ctx.device == "gpu":
        raise BuildError(
            "the dynamic scheme's program calls aten._int_mm, which on CUDA wants more than 16 rows and"
            " layer sizes divisible by 8 (small batches and a 10-class head fail); use scheme=weight_only on GPUs"
        )
    from server.engines.torch import EXPORT_LOCK

    # torchao's first import pulls in torch._dynamo and torch.export: under the lock, so a model
    # loading in another thread never meets those modules half-initialized.
    with EXPORT_LOCK, warnings.catch_warnings():
        try:
            import torchao  # noqa: F401
        except ImportError as exc:
            raise BuildError(f"torch INT8 builds need torchao (pip install torchao==0.18.0): {exc}") from exc
        warnings.simplefilter("ignore")
        logging.getLogger("torch").setLevel(logging.ERROR)
        return _static(ctx) if scheme == "static" else _module_swap(ctx, scheme)


def _module_swap(ctx: BuildContext, scheme: str) -> BuildOutput:
    """torchao `quantize_` on the program's linear layers (lifted back into modules first)."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

    from server.engines.torch import load_program
    from server.quantize.torch_graph import lift_linear_layers

    program = load_program(ctx.source_artifact)
    module = program.module()
    lifted = lift_linear_layers(module)
    if not lifted:
        raise BuildError(
            f"the program has no linear layers on constant weights for torchao's {scheme} INT8; "
            "try scheme=static (PT2E also quantizes convolutions)"
        )
    ctx.progress(f"torchao {scheme} INT8 on {lifted} linear layer(s)")
    # set_inductor_config=False: a build at model load must not retune the serving process's Inductor
    config = (Int8DynamicActivationInt8WeightConfig(set_inductor_config=False) if scheme == "dynamic"
              else Int8WeightOnlyConfig(set_inductor_config=False))
    quantize_(module, config)
    _export(module, ctx, _batch_limit(program))
    kinds = {
        "dynamic": "INT8 per-channel weights, activations quantized per row at run time, INT8 matmul",
        "weight_only": "INT8 per-channel weights, dequantized into the FP32 matmul",
    }
    return BuildOutput(
        ARTIFACT,
        "torch",
        "fp32",
        f"torchao {type(config).__name__} on {lifted} linear layer(s): {kinds[scheme]};"
        " other layers stay FP32; re-exported with torch.export",
        ["torchao swaps nn.Linear weights only: convolutions stay FP32 (scheme=static quantizes them too)"],
    )


def _static(ctx: BuildContext) -> BuildOutput:
    import torch
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    from server.engines.torch import load_program

    data = ctx.data
    if not isinstance(data, TensorData):
        raise BuildError("static torch INT8 calibrates on numeric inputs (eval/inputs.npz); this model has none")
    ctx.progress(f"PT2E INT8 quantization, calibrated on {data.calibration_count} items")
    program = load_program(ctx.source_artifact)
    quantizer = X86InductorQuantizer()
    quantizer.set_global(get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(program.module(), quantizer)
    step = 32 if ctx.source_config.batched else 1  # a model that does not batch takes one item, whole
    with torch.no_grad():
        for start in ctx.track(range(0, data.calibration_count, step), "calibrating"):
            prepared(*(torch.from_numpy(_items(data.calibration[t.name], start, step, ctx.source_config.batched))
                       for t in ctx.source_config.inputs))
    _export(convert_pt2e(prepared), ctx, _batch_limit(program))
    notes = [
        "eager PyTorch simulates Q/DQ in FP32: slower than FP32 until torch.compile (Inductor) lowers it",
    ]
    return BuildOutput(
        ARTIFACT,
        "torch",
        "fp32",
        "PT2E static INT8 (torchao X86InductorQuantizer: per-channel INT8 weights, INT8 activations),"
        " re-exported with torch.export",
        notes,
    )


def _export(module: torch.nn.Module, ctx: BuildContext, max_batch: int) -> None:
    """torch.export with a dynamic batch up to `max_batch` (none for a model that does not
    batch), and every dim the config leaves variable (-1: a sequence's) left so, saved into the
    stage (an archive, never a pickle)."""
    import torch

    config = ctx.source_config
    examples = _examples(ctx)
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    shapes = []
    for tensor in config.inputs:
        first = 1 if config.batched else 0
        dynamic: dict[int, Any] = {0: batch} if config.batched else {}
        dynamic.update({first + i: torch.export.Dim.AUTO for i, d in enumerate(tensor.dims) if d == -1})
        shapes.append(dynamic or None)
    exported = torch.export.export(module, examples, dynamic_shapes=tuple(shapes))
    torch.export.save(exported, str(ctx.stage / ARTIFACT))


def _batch_limit(program: torch.export.ExportedProgram) -> int:
    """The largest batch the source program was exported for (the upper bound of its first
    input's batch dim; other dynamic dims, a sequence's, do not bound it), at most MAX_BATCH:
    the build cannot take more than its source did."""
    from server.engines.torch import batch_range

    limits = batch_range(program)
    if limits is None or limits[1] is None:
        return MAX_BATCH
    return max(1, min(MAX_BATCH, limits[1]))


def _examples(ctx: BuildContext) -> tuple[torch.Tensor, ...]:
    """One example batch of 8 items per input, in the config's order, from the evaluation data."""
    import torch

    data = ctx.data
    batched = ctx.source_config.batched
    if isinstance(data, TensorData):
        return tuple(torch.from_numpy(_items(data.inputs[t.name], 0, 8, batched)) for t in ctx.source_config.inputs)
    raise BuildError("torch builds export with example inputs; this model's evaluation data has none")


def _items(array: np.ndarray, start: int, count: int, batched: bool) -> np.ndarray:
    """`count` items from `start` as one batch, or for a model that does not batch the item at
    `start` alone: its inputs are one item, whole, with no batch dim."""
    return np.ascontiguousarray(array[start : start + count] if batched else array[start])
