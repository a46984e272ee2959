"""ONNX Runtime builds: FP32 export, FP16 conversion, INT8 dynamic (text) or static QDQ (images).

Choices, measured on this project's models (see docs/quantization.md):
- minilm INT8: dynamic quantization (weights INT8 per channel, activations scaled at run time);
  per-channel keeps mean cosine ~0.99 vs FP32 where per-tensor falls to ~0.96. The transformer
  optimizer fuses no attention in this dynamo-exported graph and ran slower, so it is off by
  default (`optimize: true` turns it on).
- digits INT8: static quantization in QDQ format, calibrated on the training split; QDQ is also
  what TensorRT takes for explicit INT8.
- FP16: float16 weights and compute with float32 inputs/outputs by default (`keep_io_types`).
  ONNX Runtime's CPU provider has few FP16 kernels, so on CPU it is slower (casts, emulation):
  it is meant for GPU providers.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np

from server.config import ModelConfig
from server.engines.registry import ENGINES
from server.quantize.builders import BuildContext, BuildOutput, Options
from server.quantize.data import EvalData, TensorData
from server.quantize.errors import BuildError
from server.quantize.progress import Track

ARTIFACT = ENGINES["onnxruntime"].artifact  # what every onnxruntime build writes


def source_onnx(ctx: BuildContext) -> Path:
    """The FP32 ONNX graph to start from: the source's own, or the torch program exported."""
    if ctx.source_config.engine == "onnxruntime":
        return ctx.source_artifact
    path = ctx.work / "fp32.onnx"
    if not path.exists():
        ctx.progress("exporting the torch program to ONNX (dynamic batch)")
        export_program(ctx.source_artifact, path, ctx.source_config, ctx.data)
    return path


def export_program(program_path: Path, out: Path, config: ModelConfig, data: EvalData) -> None:
    """torch.export archive -> ONNX with the config's tensor names, so the ORT engine finds them."""
    import onnx
    import torch

    if config.tokenize is not None:
        raise BuildError("exporting a text model's torch program to ONNX is not supported; import its ONNX graph")
    from server.engines.torch import EXPORT_LOCK, load_program

    program = load_program(program_path)
    examples = tuple(torch.from_numpy(example) for example in _examples(config, data))
    with EXPORT_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("torch").setLevel(logging.ERROR)
        torch.onnx.export(
            program,
            examples,
            str(out),
            input_names=[t.source_name for t in config.inputs],
            output_names=[t.source_name for t in config.outputs],
            dynamo=True,
            external_data=False,
            verbose=False,
        )
    model = onnx.load(str(out))
    for value in [*model.graph.input, *model.graph.output]:  # name the batch dim for readers
        dim = value.type.tensor_type.shape.dim[0]
        if dim.dim_param:
            dim.dim_param = "batch"
    onnx.save(model, str(out))


def _examples(config: ModelConfig, data: EvalData) -> list[np.ndarray]:
    """One example batch per input, in the config's order (8 items: a batch > 1 keeps the batch
    dim dynamic): evaluation items where there are some, else zeros."""
    if isinstance(data, TensorData):
        return [np.ascontiguousarray(data.inputs[t.name][:8]) for t in config.inputs]
    return [np.zeros([8, *(d if d > 0 else 1 for d in t.dims)], dtype=np.float32) for t in config.inputs]


# --- FP32 --------------------------------------------------------------------------------------


def fp32_defaults(source: ModelConfig, data: EvalData) -> Options:
    return {}


def fp32(ctx: BuildContext) -> BuildOutput:
    """The FP32 graph as is (an export when the source is a torch program): the baseline."""
    shutil.copyfile(source_onnx(ctx), ctx.stage / ARTIFACT)
    return BuildOutput(ARTIFACT, "onnxruntime", "fp32", "FP32 ONNX graph (exported from torch when needed)")


# --- FP16 --------------------------------------------------------------------------------------


def fp16_defaults(source: ModelConfig, data: EvalData) -> Options:
    return {"keep_io_types": True}


def fp16(ctx: BuildContext) -> BuildOutput:
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    keep_io = bool(ctx.options["keep_io_types"])
    io = "FP32 inputs/outputs" if keep_io else "FP16 inputs/outputs: clients send and receive FP16"
    graph = source_onnx(ctx)
    ctx.progress(f"converting weights and compute to FP16 ({io})")
    model = onnx.load(str(graph))
    converted = convert_float_to_float16(model, keep_io_types=keep_io)
    onnx.save(converted, str(ctx.stage / ARTIFACT))
    source = ctx.source_config
    tokenized = source.tokenize.input if source.tokenize else None
    halved = {} if keep_io else {
        t.name: "FP16" for t in (*source.inputs, *source.outputs) if t.datatype == "FP32" and t.name != tokenized
    }
    return BuildOutput(
        ARTIFACT,
        "onnxruntime",
        "fp16",
        f"FP16 weights and compute (onnxruntime.transformers.float16), {io}",
        ["FP16 on ONNX Runtime's CPU provider is emulated and slower than FP32; it is for GPU providers."],
        halved,
    )


# --- INT8 --------------------------------------------------------------------------------------


def int8_defaults(source: ModelConfig, data: EvalData) -> Options:
    static = isinstance(data, TensorData) and source.tokenize is None  # text: no calibration to draw
    options: Options = {
        "mode": "static" if static else "dynamic",
        "per_channel": True,
        "reduce_range": False,
        "optimize": False,
    }
    if static:
        options |= {"calibrate_method": "minmax"}
    return options


def int8(ctx: BuildContext) -> BuildOutput:
    mode = ctx.options["mode"]
    graph = source_onnx(ctx)
    notes: list[str] = []
    if ctx.options["optimize"]:
        graph = _optimize(graph, ctx, notes)
    prepared = _pre_process(graph, ctx, notes)
    if mode == "dynamic":
        return _dynamic(prepared, ctx, notes)
    if mode == "static":
        return _static(prepared, ctx, notes)
    raise BuildError(f"build option mode must be 'dynamic' or 'static', got {mode!r}")


def _optimize(graph: Path, ctx: BuildContext, notes: list[str]) -> Path:
    """ORT's transformer optimizer (attention/LayerNorm fusion); BERT-like text models only."""
    from onnxruntime.transformers import optimizer

    if ctx.source_config.tokenize is None:
        raise BuildError("optimize: true applies to transformer (text) models only")
    ctx.progress("fusing the transformer graph (onnxruntime.transformers.optimizer, model_type bert)")
    out = ctx.work / "optimized.onnx"
    model = optimizer.optimize_model(str(graph), model_type="bert", num_heads=0, hidden_size=0, opt_level=1)
    model.save_model_to_file(str(out))
    fused = {k: v for k, v in model.get_fused_operator_statistics().items() if v}
    notes.append(f"transformer optimizer fused: {fused or 'nothing'}")
    return out


def _pre_process(graph: Path, ctx: BuildContext, notes: list[str]) -> Path:
    """quant_pre_process: symbolic shape inference + ORT graph optimization before quantizing.

    Symbolic shape inference fails on the dynamo-exported transformer graph ("Incomplete
    symbolic shape inference"); then ONNX shape inference alone is used, which suffices there.
    It runs in a child process whose working folder is the build's scratch folder: on failure
    ORT dumps the whole graph (90 MB for minilm) into the *current* folder under a random name.
    """
    out = ctx.work / "prepared.onnx"
    ctx.progress("pre-processing the graph for quantization (shape inference, optimization)")
    error = _run_pre_process(graph, out, skip_symbolic_shape=False, cwd=ctx.work)
    if error is not None:
        notes.append(f"symbolic shape inference failed ({error}); used ONNX shape inference only")
        error = _run_pre_process(graph, out, skip_symbolic_shape=True, cwd=ctx.work)
        if error is not None:
            raise BuildError(f"quant_pre_process failed: {error}")
    return out


_PRE_PROCESS = (
    "import sys\n"
    "from onnxruntime.quantization.shape_inference import quant_pre_process\n"
    "quant_pre_process(sys.argv[1], sys.argv[2], skip_symbolic_shape=sys.argv[3] == '1')\n"
)


def _run_pre_process(graph: Path, out: Path, *, skip_symbolic_shape: bool, cwd: Path) -> str | None:
    """Run quant_pre_process in a child; None on success, else the last line of its error."""
    done = subprocess.run(
        [sys.executable, "-c", _PRE_PROCESS, str(graph), str(out), "1" if skip_symbolic_shape else "0"],
        cwd=cwd, capture_output=True, text=True, check=False,
    )
    if done.returncode == 0:
        return None
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit code {done.returncode}"


def _dynamic(prepared: Path, ctx: BuildContext, notes: list[str]) -> BuildOutput:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    per_channel = bool(ctx.options["per_channel"])
    ctx.progress(f"dynamic INT8 quantization ({'per-channel' if per_channel else 'per-tensor'} QInt8 weights)")
    quantize_dynamic(
        str(prepared),
        str(ctx.stage / ARTIFACT),
        per_channel=per_channel,
        reduce_range=bool(ctx.options["reduce_range"]),
        weight_type=QuantType.QInt8,
    )
    granularity = "per-channel" if per_channel else "per-tensor"
    return BuildOutput(
        ARTIFACT,
        "onnxruntime",
        "int8",
        f"ONNX Runtime dynamic quantization: QInt8 {granularity} weights, activations quantized at run time",
        notes,
    )


class _Calibration:
    """onnxruntime's CalibrationDataReader over the calibration items, in small batches; one
    item at a time for a model that does not batch (each item is a whole input)."""

    def __init__(self, config: ModelConfig, items: dict[str, np.ndarray], track: Track, batch: int = 32) -> None:
        count = len(next(iter(items.values())))
        names = {t.name: t.source_name for t in config.inputs}
        if config.batched:
            batches = [{names[name]: array[i : i + batch] for name, array in items.items()}
                       for i in range(0, count, batch)]
        else:
            batches = [{names[name]: array[i] for name, array in items.items()} for i in range(count)]
        self._batches = iter(track(batches, "calibrating", len(batches)))

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._batches, None)


def _static(prepared: Path, ctx: BuildContext, notes: list[str]) -> BuildOutput:
    method = quantize_qdq(prepared, ctx.stage / ARTIFACT, ctx, notes, symmetric=False)
    return BuildOutput(ARTIFACT, "onnxruntime", "int8", f"ONNX Runtime static quantization, {method}", notes)


def static_qdq_graph(ctx: BuildContext, notes: list[str]) -> Path:
    """A calibrated, symmetric Q/DQ graph of the source in the scratch folder: what TensorRT's
    explicit quantization builds INT8 engines from (TensorRT takes zero points of 0 only)."""
    if not isinstance(ctx.data, TensorData) or ctx.source_config.tokenize is not None:
        raise BuildError("TensorRT INT8 calibrates on numeric inputs; this model has none (build fp16 or bf16 plans)")
    out = ctx.work / "qdq.onnx"
    quantize_qdq(_pre_process(source_onnx(ctx), ctx, notes), out, ctx, notes, symmetric=True)
    return out


def quantize_qdq(prepared: Path, out: Path, ctx: BuildContext, notes: list[str], *, symmetric: bool) -> str:
    """ORT `quantize_static` in QDQ format, calibrated on the model's calibration items; returns
    what it did. `symmetric`: zero points of 0 for weights and activations (TensorRT's rule)."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    data = ctx.data
    if not isinstance(data, TensorData) or ctx.source_config.tokenize is not None:
        raise BuildError("static INT8 calibrates on numeric inputs; text models use mode: dynamic")
    methods = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
               "percentile": CalibrationMethod.Percentile}
    method = ctx.options["calibrate_method"]
    if method not in methods:
        raise BuildError(f"calibrate_method must be one of {sorted(methods)}, got {method!r}")
    ctx.progress(f"static INT8 QDQ quantization, calibrated ({method}) on {data.calibration_count} items")
    reader = _Calibration(ctx.source_config, data.calibration, ctx.track)
    quantize_static(
        str(prepared),
        str(out),
        reader,
        quant_format=QuantFormat.QDQ,
        per_channel=bool(ctx.options["per_channel"]),
        reduce_range=bool(ctx.options["reduce_range"]),
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=methods[method],
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True} if symmetric
        else {"CalibTensorRangeSymmetric": False},
    )
    return (f"QDQ format, QInt8 weights and activations{' (symmetric)' if symmetric else ''}, {method}"
            f" calibration on {data.calibration_count} items apart from those evaluated")
