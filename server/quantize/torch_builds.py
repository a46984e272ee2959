"""PyTorch builds: FP16/BF16 by cast at load, INT8 by PT2E static quantization (torchao).

- FP16/BF16: the torch engine already casts the program and its floating inputs to the config's
  precision at load, so the build is the same program under a variant config, plus the gate.
- INT8: the exported program is quantized with PT2E (torchao's prepare_pt2e/convert_pt2e and
  the X86 Inductor quantizer: INT8 per-channel weights, INT8 activations), calibrated on the
  training split, and saved again with torch.export (never a pickle). Run eagerly, its Q/DQ
  operators are *simulated* in FP32, so it is slower than FP32; the speed comes only when
  Inductor (`torch.compile`) lowers the Q/DQ pattern to INT8 kernels, which the server's
  eager engine does not do. Its config says precision fp32 (inputs stay FP32; the engine must
  not cast), and the build block records int8.
"""

from __future__ import annotations

import logging
import shutil
import warnings

import numpy as np

from server.config import ModelConfig
from server.quantize.builders import BuildContext, BuildOutput, Options
from server.quantize.data import ClassificationData, EvalData
from server.quantize.errors import BuildError

ARTIFACT = "model.pt2"
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


def int8_defaults(source: ModelConfig, data: EvalData) -> Options:
    return {"calibration": "train"}


def int8(ctx: BuildContext) -> BuildOutput:
    try:
        import torch
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
        from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
            X86InductorQuantizer,
            get_default_x86_inductor_quantization_config,
        )
    except ImportError as exc:
        raise BuildError(f"torch INT8 builds need torchao (pip install torchao==0.18.0): {exc}") from exc
    data = ctx.data
    if not isinstance(data, ClassificationData):
        raise BuildError("torch INT8 builds are supported for image classifiers (calibration images) only")
    ctx.progress(f"PT2E INT8 quantization, calibrated on {len(data.calibration)} training images")
    from server.engines.torch import EXPORT_LOCK, load_program

    with EXPORT_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("torch").setLevel(logging.ERROR)
        program = load_program(ctx.source_artifact)
        quantizer = X86InductorQuantizer()
        quantizer.set_global(get_default_x86_inductor_quantization_config())
        prepared = prepare_pt2e(program.module(), quantizer)
        with torch.no_grad():
            for start in range(0, len(data.calibration), 32):
                prepared(torch.from_numpy(np.ascontiguousarray(data.calibration[start : start + 32])))
        converted = convert_pt2e(prepared)
        example = torch.from_numpy(np.ascontiguousarray(data.images[:8]))
        batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
        exported = torch.export.export(converted, (example,), dynamic_shapes=({0: batch},))
        torch.export.save(exported, str(ctx.stage / ARTIFACT))
    notes = [
        "eager PyTorch simulates Q/DQ in FP32: slower than FP32 until torch.compile (Inductor) lowers it",
    ]
    if ctx.options["calibration"] != "train":
        notes.append(f"DELIBERATELY BROKEN calibration {ctx.options['calibration']!r} (gate test)")
    return BuildOutput(
        ARTIFACT,
        "torch",
        "fp32",
        "PT2E static INT8 (torchao X86InductorQuantizer: per-channel INT8 weights, INT8 activations),"
        " re-exported with torch.export",
        notes,
    )
