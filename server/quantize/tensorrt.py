"""TensorRT engine builds: the logic that can be checked anywhere, the build only on a GPU.

What is pure (and unit-tested on CPU): the optimization profiles, one per batch bucket
(min/opt/max shapes, server/engines/profiles.py), the engine-cache key (an engine is only valid
for the GPU model, compute capability and TensorRT version it was built with), the timing-cache
name (per GPU model and TensorRT version), and the INT8 rule: explicit quantization only, i.e. an
ONNX graph that already carries Q/DQ nodes (TensorRT 10 deprecates implicit calibration).
`build_engine` imports tensorrt lazily and fails with a clear message where it is not installed;
its call sequence (profiles, flags, timing cache, engine cache) is tested against a fake. A plan that builds is gated like every build, served by the tensorrt engine
(server/engines/tensorrt.py) on a GPU instance group. Neither has run on the machines this was
written on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from server.config import ModelConfig
from server.engines.digests import file_digest
from server.engines.profiles import Profile, cache_root, optimization_profiles
from server.engines.registry import ENGINES
from server.engines.spec import EngineIO
from server.engines.tensorrt import unsupported_tensorrt
from server.quantize.builders import BuildContext, BuildOutput, Options
from server.quantize.data import EvalData
from server.quantize.errors import BuildError

NOT_INSTALLED = (
    "TensorRT is not installed on this machine (pip install tensorrt needs an NVIDIA GPU machine"
    " with CUDA); build the onnxruntime variant instead"
)
QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})
logger = logging.getLogger("server.quantize")


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
            " the static QDQ quantization produced none"
        )


def precision_flags(precision: str) -> list[str]:
    """The BuilderFlag names a precision sets (names, so this stays importable without TensorRT)."""
    return {"fp32": [], "fp16": ["FP16"], "bf16": ["BF16"], "int8": ["INT8", "FP16"]}[precision]


def defaults(source: ModelConfig, data: EvalData) -> Options:
    """workspace_mb for every plan; INT8 also takes the static QDQ calibration options."""
    return {"workspace_mb": 4096, "calibrate_method": "minmax", "per_channel": True, "reduce_range": False}


def build(ctx: BuildContext) -> BuildOutput:
    """The `tensorrt` builder: the FP32 graph (INT8: quantized first to a calibrated, symmetric
    Q/DQ graph), checked, then handed to `build_engine` (needs TensorRT and a GPU)."""
    from server.quantize.onnx_builds import source_onnx, static_qdq_graph

    notes: list[str] = []
    if ctx.precision == "int8":
        import onnx

        graph = static_qdq_graph(ctx, notes)
        check_int8_graph({n.op_type for n in onnx.load(str(graph), load_external_data=False).graph.node})
    else:
        calibrating = {k: v for k, v in ctx.options.items() if k != "workspace_mb"}
        changed = sorted(k for k, v in calibrating.items() if v != defaults(ctx.source_config, ctx.data)[k])
        if changed:
            raise BuildError(f"{changed} apply to TensorRT INT8 builds only (calibration)")
        graph = source_onnx(ctx)
    built = build_engine(graph, ctx.stage / ENGINES["tensorrt"].artifact, ctx.source_config, ctx.precision,
                         workspace_mb=int(ctx.options["workspace_mb"]))
    return BuildOutput(
        ENGINES["tensorrt"].artifact,
        "tensorrt",
        ctx.precision,
        f"TensorRT plan, {len(built['profiles'])} optimization profiles (one per batch bucket)"
        + (", INT8 by explicit quantization of a calibrated symmetric Q/DQ graph" if ctx.precision == "int8" else ""),
        [f"for {built['gpu']} (sm {built['compute_capability'][0]}{built['compute_capability'][1]}), TensorRT"
         f" {built['tensorrt']}: a plan runs only there; engine cache key {built['cache_key'][:16]}"
         + (" (engine cache hit: not rebuilt)" if built["engine_cache_hit"] else ""), *notes],
    )


def timing_cache_name(gpu_name: str, compute_capability: tuple[int, int], tensorrt_version: str) -> str:
    """Kernel timings are only valid for one GPU model and TensorRT version."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", gpu_name).strip("-").lower()
    return f"timing-{slug}-sm{compute_capability[0]}{compute_capability[1]}-trt{tensorrt_version}.cache"


def build_engine(
    onnx_path: Path, plan_path: Path, config: ModelConfig, precision: str, *, workspace_mb: int = 4096,
    cache: Path | None = None,
) -> dict[str, Any]:
    """Parse the ONNX graph, add one profile per batch bucket, build and save the plan.

    A plan already in the engine cache under the same key (GPU model, compute capability,
    TensorRT version, graph, precision, profiles) is copied instead of rebuilt, when the copy
    matches the sha256 stored with it (`reuse_cached_plan`); a new build reads and then extends the timing cache of this GPU model and TensorRT version. Written
    against the TensorRT 10 Python API, and refuses any other major (11 has no BuilderFlag.FP16,
    BF16 or INT8); it has NOT been run (no TensorRT on the machines this was written on).
    Returns the cache key, the profiles and whether the engine cache had it.
    """
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise BuildError(NOT_INSTALLED) from exc
    if (problem := unsupported_tensorrt(trt.__version__)) is not None:
        raise BuildError(problem)  # before TensorRT 11 fails on BuilderFlag.FP16 with an AttributeError
    import torch

    cache = cache or cache_root()
    profiles = optimization_profiles(EngineIO.from_config(config))
    props = torch.cuda.get_device_properties(0)
    gpu = (props.name, (props.major, props.minor), trt.__version__)
    key = engine_cache_key(
        gpu_name=gpu[0], compute_capability=gpu[1], tensorrt_version=gpu[2],
        source_digest=file_digest(onnx_path), precision=precision, profiles=profiles,
    )
    result = {"cache_key": key, "profiles": [p.as_dict() for p in profiles], "gpu": gpu[0],
              "compute_capability": list(gpu[1]), "tensorrt": gpu[2]}
    cached_plan = cache / "engines" / f"{key}.plan"
    if reuse_cached_plan(cached_plan, plan_path):
        return {**result, "engine_cache_hit": True}

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
    timing_path = cache / timing_cache_name(*gpu)
    timing = build_config.create_timing_cache(timing_path.read_bytes() if timing_path.is_file() else b"")
    if not build_config.set_timing_cache(timing, ignore_mismatch=False):  # a cache from elsewhere: start afresh
        build_config.set_timing_cache(build_config.create_timing_cache(b""), ignore_mismatch=False)
    for profile in profiles:
        optimization = builder.create_optimization_profile()
        for name, (low, opt, high) in profile.shapes.items():
            optimization.set_shape(name, low, opt, high)
        build_config.add_optimization_profile(optimization)
    plan = builder.build_serialized_network(network, build_config)
    if plan is None:
        raise BuildError("TensorRT failed to build the engine (see its log above)")
    plan_path.write_bytes(bytes(plan))
    timings = build_config.get_timing_cache()
    if timings is not None:
        _write_atomically(timing_path, bytes(timings.serialize()))
    _write_atomically(cached_plan, bytes(plan))
    # after the plan: a crash between the two leaves a plan without its digest, which is rebuilt
    digest = hashlib.sha256(bytes(plan)).hexdigest()
    _write_atomically(plan_digest_path(cached_plan), f"{digest}  {cached_plan.name}\n".encode())
    return {**result, "engine_cache_hit": False}


def plan_digest_path(cached_plan: Path) -> Path:
    """`<key>.plan.sha256` beside the plan, a `sha256sum -c` line (checkable by hand)."""
    return cached_plan.with_name(cached_plan.name + ".sha256")


def reuse_cached_plan(cached_plan: Path, plan_path: Path) -> bool:
    """Copy a cached plan to `plan_path` if the copy matches the digest recorded when the plan
    was stored; else (no plan, no digest, damaged or swapped) leave nothing and say so: the plan
    is built again. The copy is what is checked, so what was checked is what serves; a plan is
    code TensorRT deserializes, and a cache other users may share is no place to trust one."""
    digest_path = plan_digest_path(cached_plan)
    if not cached_plan.is_file():
        return False
    try:
        recorded = digest_path.read_text(encoding="utf-8").split()[0].lower()
    except (OSError, UnicodeDecodeError, IndexError):
        logger.warning("TensorRT engine cache: %s has no readable digest (%s); building the plan again",
                       cached_plan, digest_path)
        return False
    shutil.copyfile(cached_plan, plan_path)
    if file_digest(plan_path) != recorded:
        plan_path.unlink(missing_ok=True)
        logger.warning("TensorRT engine cache: %s does not match its recorded sha256 (damaged or replaced); "
                       "building the plan again", cached_plan)
        return False
    return True


def _write_atomically(path: Path, data: bytes) -> None:
    """Readers (another build, in this process or another) see the old file or the whole new
    one, never half of it; concurrent writers each have their own temporary file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as partial:
        temporary = Path(partial.name)
        try:
            partial.write(data)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
    temporary.chmod(0o644)  # a cache other users may share: not mkstemp's 0600
    temporary.replace(path)
