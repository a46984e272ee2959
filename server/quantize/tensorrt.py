"""TensorRT engine builds: the logic that can be checked anywhere, the build only on a GPU.

What is pure (and unit-tested on CPU): the optimization profiles, one per batch bucket
(min/opt/max shapes), the engine-cache key (an engine is only valid for the GPU model, compute
capability and TensorRT version it was built with), and the INT8 rule: explicit quantization
only, i.e. an ONNX graph that already carries Q/DQ nodes (TensorRT 10 deprecates implicit
calibration). `build_engine` imports tensorrt lazily and fails with a clear message where it
is not installed. A plan that builds is gated like every build, served by the tensorrt engine
(server/engines/tensorrt.py) on a GPU instance group. Neither has run on the machines this was
written on.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.config import ModelConfig
from server.quantize.builders import BuildContext, BuildOutput, Options
from server.quantize.data import EvalData
from server.quantize.errors import BuildError

NOT_INSTALLED = (
    "TensorRT is not installed on this machine (pip install tensorrt needs an NVIDIA GPU machine"
    " with CUDA); build the onnxruntime variant instead"
)
QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})


@dataclass(frozen=True)
class Profile:
    """One optimization profile: per engine input, the min/opt/max shapes TensorRT tunes for."""

    batch: int
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]

    def as_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "shapes": {k: [list(s) for s in v] for k, v in self.shapes.items()}}


def engine_inputs(config: ModelConfig) -> dict[str, list[int]]:
    """Engine input name -> dims without batch (-1 variable), tokenizer outputs included."""
    tokenize = config.tokenize
    inputs = {t.source_name: list(t.dims) for t in config.inputs if not (tokenize and t.name == tokenize.input)}
    if tokenize:
        for name in (tokenize.input_ids, tokenize.attention_mask, tokenize.token_type_ids):
            if name:
                inputs[name] = [-1]
    return inputs


def batch_buckets(config: ModelConfig) -> list[int]:
    """The batch sizes to build for: the config's batch_buckets, else its batch ladder."""
    if not config.batched:
        return [1]
    return list(config.batch_buckets) if config.batch_buckets else config.batch_ladder()


def optimization_profiles(config: ModelConfig) -> list[Profile]:
    """One profile per batch bucket: batches (previous bucket, bucket] tuned at the bucket.

    Variable non-batch dims are the sequence of a text model: 1..max_length, tuned at the
    middle sequence bucket. Any other variable dim has no known bound and is refused.
    """
    tokenize = config.tokenize
    profiles, previous = [], 0
    for bucket in batch_buckets(config):
        shapes = {}
        for name, dims in engine_inputs(config).items():
            low, opt, high = [], [], []
            for dim in dims:
                if dim > 0:
                    bounds = (dim, dim, dim)
                elif tokenize is not None:
                    buckets = tokenize.sequence_buckets or [tokenize.max_length]
                    bounds = (1, buckets[len(buckets) // 2], tokenize.max_length)
                else:
                    raise BuildError(f"input {name!r} has a variable dim with no known bound for TensorRT")
                low.append(bounds[0])
                opt.append(bounds[1])
                high.append(bounds[2])
            if config.batched:
                shapes[name] = ((previous + 1, *low), (bucket, *opt), (bucket, *high))
            else:
                shapes[name] = (tuple(low), tuple(opt), tuple(high))
        profiles.append(Profile(bucket, shapes))
        previous = bucket
    return profiles


def engine_cache_key(
    *, gpu_name: str, compute_capability: tuple[int, int], tensorrt_version: str, source_digest: str,
    precision: str, profiles: list[Profile],
) -> str:
    """A plan file is valid only for this GPU model, compute capability and TensorRT version."""
    material = {
        "gpu": gpu_name,
        "sm": list(compute_capability),
        "trt": tensorrt_version,
        "source": source_digest,
        "precision": precision,
        "profiles": [p.as_dict() for p in profiles],
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def has_explicit_qdq(op_types: set[str]) -> bool:
    return QDQ_OPS <= op_types


def check_int8_graph(op_types: set[str]) -> None:
    """TensorRT INT8 here is explicit quantization only: the graph must carry Q/DQ nodes."""
    if not has_explicit_qdq(op_types):
        raise BuildError(
            "TensorRT INT8 needs an explicitly quantized ONNX graph (QuantizeLinear/DequantizeLinear);"
            " build '<model>-onnxruntime-int8' (static QDQ) first and build TensorRT from it"
        )


def precision_flags(precision: str) -> list[str]:
    """The BuilderFlag names a precision sets (names, so this stays importable without TensorRT)."""
    return {"fp32": [], "fp16": ["FP16"], "bf16": ["BF16"], "int8": ["INT8", "FP16"]}[precision]


def defaults(source: ModelConfig, data: EvalData) -> Options:
    return {"workspace_mb": 4096}


def build(ctx: BuildContext) -> BuildOutput:
    """The `tensorrt` builder: check the graph, then hand over to `build_engine` (needs a GPU)."""
    from server.quantize.onnx_builds import source_onnx

    graph = source_onnx(ctx)
    if ctx.precision == "int8":
        import onnx

        check_int8_graph({n.op_type for n in onnx.load(str(graph), load_external_data=False).graph.node})
    built = build_engine(graph, ctx.stage / "model.plan", ctx.source_config, ctx.precision,
                         workspace_mb=int(ctx.options["workspace_mb"]))
    return BuildOutput(
        "model.plan",
        "tensorrt",
        ctx.precision,
        f"TensorRT plan, {len(built['profiles'])} optimization profiles (one per batch bucket)",
        [f"engine cache key {built['cache_key']}: valid only on this GPU model and TensorRT version"],
    )


def build_engine(
    onnx_path: Path, plan_path: Path, config: ModelConfig, precision: str, *, workspace_mb: int = 4096
) -> dict[str, Any]:
    """Parse the ONNX graph, add one profile per batch bucket, build and save the plan.

    Written against the TensorRT 10 Python API; it has NOT been run (no TensorRT on the
    machines this was written on). Returns the cache-key material of the engine built.
    """
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise BuildError(NOT_INSTALLED) from exc
    from server.quantize.cache import file_digest

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BuildError(f"TensorRT cannot parse {onnx_path}: {errors}")
    build_config = builder.create_builder_config()
    build_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mb << 20)
    for flag in precision_flags(precision):
        build_config.set_flag(getattr(trt.BuilderFlag, flag))
    profiles = optimization_profiles(config)
    for profile in profiles:
        optimization = builder.create_optimization_profile()
        for name, (low, opt, high) in profile.shapes.items():
            optimization.set_shape(name, low, opt, high)
        build_config.add_optimization_profile(optimization)
    plan = builder.build_serialized_network(network, build_config)
    if plan is None:
        raise BuildError("TensorRT failed to build the engine (see its log above)")
    plan_path.write_bytes(bytes(plan))
    import torch

    props = torch.cuda.get_device_properties(0)
    key = engine_cache_key(
        gpu_name=props.name, compute_capability=(props.major, props.minor), tensorrt_version=trt.__version__,
        source_digest=file_digest(onnx_path), precision=precision, profiles=profiles,
    )
    return {"cache_key": key, "profiles": [p.as_dict() for p in profiles]}
