"""`build()`: make a quantized / lower-precision variant of a model, judge it, publish it or not.

Flow: resolve the source (an FP32 model of the repository) and the builder; compute the cache
key; reuse the variant's latest version if its key matches; otherwise build into a hidden
staging folder, evaluate it against FP32 on held-out data, time it, write the report, and
publish the folder as the next version only when the quality gate passes (or is not enforced).
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import resource
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from server.config import CONFIG_FILENAME, BuildGate, BuildSpec, ModelConfig, load_model_config
from server.engines.digests import file_digest, record_digests, verify_artifact
from server.quantize import variant as variants
from server.quantize.builders import BuildContext, resolve_options, select
from server.quantize.cache import cache_key, library_versions
from server.quantize.data import EvalData, load_eval_data
from server.quantize.errors import BuildError
from server.quantize.progress import Track, untracked
from server.quantize.reporting import (
    CHART_FILE,
    MARKDOWN_FILE,
    REJECTED_DIR,
    REPORT_FILE,
    BuildReport,
    find_reports,
)

logger = logging.getLogger("server.quantize")
DEFAULT_ARTIFACTS = {"onnxruntime": "model.onnx", "torch": "model.pt2"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# What a config says of serving alone: changing it never calls for a rebuild (a build's key).
SERVING_ONLY = {"name", "openai", "record_traffic", "dynamic_batching", "version_policy", "warmup",
                "instance_group", "execution_timeout_seconds", "max_item_bytes"}

# In-process memo of FP32 figures: many builds of one source share them.
_reference_outputs: dict[tuple[str, str], dict[str, np.ndarray]] = {}
_reference_bench: dict[tuple[Any, ...], dict[str, Any]] = {}


def _log(message: str) -> None:
    logger.info("%s", message)


def build(
    repository: Path,
    model: str,
    engine: str,
    precision: str,
    *,
    name: str | None = None,
    force: bool = False,
    progress: Callable[[str], None] = _log,
    track: Track = untracked,
    device: str | None = None,
    options: dict[str, Any] | None = None,
    gate: BuildGate | None = None,
    benchmark: bool = True,
    bench_seconds: float = 1.0,
    bench_batches: list[int] | None = None,
    sequence_length: int = 32,
    recorded: bool = True,
) -> BuildReport:
    """Build `model` for `engine`/`precision` as the variant `name` (default model-engine-precision).

    `progress` gets a line per step; `track` wraps the long loops (a bar on a terminal).
    `device` ("cpu" or "gpu", default the variant's earlier build's or "cpu") is where the build
    is evaluated and timed, against FP32 on the same device, and where the variant serves.
    `recorded`: whether the source's eval/recorded.npz (traffic the server recorded) may stand in
    for eval/inputs.npz. Returns the report; `report.servable` says whether a version was published. Raises
    `BuildError` (an EngineError) or `ConfigError` when no build can be made at all.
    """
    started = time.perf_counter()
    repository = Path(repository).absolute()  # child processes and scratch folders run elsewhere
    source = _source(repository, model)
    source_config, source_version, source_version_dir, source_artifact = source
    variant = name or variants.variant_name(model, engine, precision)
    if not _NAME.match(variant) or variant == model:
        raise BuildError(f"variant name {variant!r} is not usable (a folder name other than the source's)")
    variant_dir = repository / variant
    existing = _existing_variant(variant_dir, model)
    builder = select(engine, precision, source_config.engine)
    given = dict(options if options is not None else (existing.build.options if existing and existing.build else {}))
    data = load_eval_data(repository / model, source_version_dir, source_config, recorded=recorded)
    resolved = resolve_options(builder, source_config, data, given)
    gate = gate or (existing.build.gate if existing and existing.build else BuildGate())
    device = _device(engine, device or (existing.build.device if existing and existing.build else "cpu"))
    versions = library_versions()
    source_digest = file_digest(source_artifact)
    key = cache_key(
        source_digest=source_digest,
        source_config=source_config.model_dump(mode="json", exclude=SERVING_ONLY),
        engine=engine,
        precision=precision,
        device=_device_identity(device),
        options=resolved,
        data_fingerprint=data.fingerprint,
        versions=versions,
    )
    source_info = {
        "model": model, "version": source_version, "engine": source_config.engine,
        "artifact": source_artifact.name, "sha256": source_digest, "size_bytes": source_artifact.stat().st_size,
    }
    with variants.locked(variant_dir):
        if not force:
            hit = _cached(variant_dir, key, gate)
            if hit is not None:
                progress(f"{variant}: cache hit ({hit.location}); nothing rebuilt")
                return hit
        try:
            return _build(
                repository, variant, variant_dir, source_config, source_version_dir, source_artifact,
                source_info, engine, precision, device, builder, given, resolved, gate, data, key, versions,
                progress, track, started, benchmark, bench_seconds, bench_batches, sequence_length,
            )
        except BaseException:
            variants.cleanup_if_empty(variant_dir)
            raise


def _build(
    repository: Path, variant: str, variant_dir: Path, source_config: ModelConfig, source_version_dir: Path,
    source_artifact: Path, source_info: dict[str, Any], engine: str, precision: str, device: str, builder: Any,
    given: dict[str, Any], resolved: dict[str, Any], gate: BuildGate, data: EvalData, key: str,
    versions: dict[str, str], progress: Callable[[str], None], track: Track, started: float, benchmark: bool,
    bench_seconds: float, bench_batches: list[int] | None, sequence_length: int,
) -> BuildReport:
    from server.quantize.quality import judge
    from server.quantize.runner import evaluate

    with variants.staging(variant_dir) as stage, tempfile.TemporaryDirectory(prefix="batchline-build-") as work:
        progress(f"{variant}: building {engine} {precision} from {source_info['model']}/{source_info['version']}")
        context = BuildContext(
            source_config=source_config, source_version_dir=source_version_dir, source_artifact=source_artifact,
            engine=engine, precision=precision, device=device, stage=stage, work=Path(work), options=resolved, data=data,
            progress=lambda m: progress(f"{variant}: {m}"), track=track,
        )
        try:
            output = builder.run(context)
        except BuildError:
            raise
        except Exception as exc:  # the libraries' own errors on a model they cannot take: said, not a traceback
            logger.debug("the %s %s build of %s failed", engine, precision, source_info["model"], exc_info=True)
            raise BuildError(f"the {engine} {precision} build failed: {type(exc).__name__}: "
                             f"{str(exc).strip()[:2000]}") from exc
        if source_config.tokenize is not None:
            tokenizer = source_config.tokenize.tokenizer
            shutil.copyfile(source_version_dir / tokenizer, stage / tokenizer)
        record_digests(stage)  # evaluated and timed as it will serve: verified; publish records the rest
        base = variants.read_raw_config(variant_dir if (variant_dir / CONFIG_FILENAME).is_file() else repository / source_info["model"])
        spec = BuildSpec(source=source_info["model"], engine=engine, precision=precision, device=device,
                         options=given, gate=gate)
        filename = None if output.artifact == DEFAULT_ARTIFACTS.get(output.engine) else output.artifact
        derived = variants.derive_config(
            base, name=variant, engine=output.engine, precision=output.precision, model_filename=filename, spec=spec,
            datatypes={**{t.name: t.datatype for t in (*source_config.inputs, *source_config.outputs)},
                       **output.datatypes},
        )
        variant_config = ModelConfig.model_validate(derived)

        progress(f"{variant}: evaluating against FP32 on {data.kind} held-out data")
        reference = _reference(source_config, source_version_dir, data, source_info["sha256"], track, device)
        outputs = evaluate(variant_config, stage, data, track, "evaluating the build: ", device)
        quality = judge(data, reference, outputs, gate, embedding_model=source_config.openai is not None)
        quality["gate"] = gate.model_dump(mode="json")
        servable = bool(quality["passed"] or not gate.enforce)
        notes = list(output.notes)
        if not quality["passed"]:
            failed = [c for c in quality["checks"] if not c["passed"]]
            detail = ", ".join(f"{c['metric']} {c['value']:.4f}, not {c['op']} {c['threshold']:.4f}" for c in failed)
            notes.append(f"quality gate FAILED: {detail}" + ("" if gate.enforce else "; published anyway (enforce: false)"))

        bench = None
        if benchmark:
            progress(f"{variant}: timing the engine alone (1 thread) at each batch size")
            dirs = (repository / source_info["model"], source_version_dir)
            timing = _Timing(dirs, bench_seconds, sequence_length, Path(work), track, device)
            bench = timing.run(variant_config, stage, bench_batches, "timing the build")
            exported = Path(work) / "fp32.onnx"
            if output.engine == "onnxruntime" and source_config.engine != "onnxruntime" and exported.is_file():
                bench["fp32_same_engine"] = _same_engine_time(
                    timing, variant_config, exported, [b["batch"] for b in bench["buckets"]]
                )
            bench["reference"] = _reference_time(
                timing, source_config, source_version_dir, bench_batches or [b["batch"] for b in bench["buckets"]],
                source_info["sha256"],
            )
        version = (variants.versions_on_disk(variant_dir) or [0])[-1] + 1
        report = BuildReport(
            variant=variant, source=source_info, engine=engine, precision=precision, options=resolved,
            cache_key=key, device=device, method=output.method, notes=notes,
            version=version if servable else None,
            location=f"{variant}/{version}" if servable else f"{variant}/{REJECTED_DIR}/{key[:16]}",
            servable=servable, library_versions=versions,
            artifact={"file": output.artifact, "size_bytes": (stage / output.artifact).stat().st_size},
            quality=quality, benchmark=bench,
            built_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            build_seconds=round(time.perf_counter() - started, 2),
            build_peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        )
        _write_report(report, stage, repository)
        if servable:
            published = variants.publish(variant_dir, stage, derived, source_info["model"])
            assert published == version
        else:
            variants.reject(variant_dir, stage, key)
        progress(report.summary())
        return report


def _source(repository: Path, model: str) -> tuple[ModelConfig, int, Path, Path]:
    """The FP32 source: its config, the version it serves, that folder, and the artifact."""
    model_dir = repository / model
    if not (model_dir / CONFIG_FILENAME).is_file():
        raise BuildError(f"model '{model}' is not in the repository {repository}")
    config = load_model_config(model_dir / CONFIG_FILENAME)
    if config.build is not None:
        raise BuildError(f"'{model}' is itself a build of '{config.build.source}'; build from the FP32 source")
    if config.precision != "fp32":
        raise BuildError(f"'{model}' is {config.precision}; builds start from an FP32 model")
    selected = config.version_policy.select(variants.versions_on_disk(model_dir))
    if not selected:
        raise BuildError(f"model '{model}' has no version folder to build from (was it built?)")
    version_dir = model_dir / str(selected[-1])
    artifact = version_dir / (config.model_filename or DEFAULT_ARTIFACTS[config.engine])
    if not artifact.is_file():
        raise BuildError(f"the source artifact {artifact} is missing (was the model built?)")
    verify_artifact(artifact, version_dir)  # a build loads it (a torch program) as serving would
    return config, selected[-1], version_dir, artifact


def published_build(repository: Path, variant: str, spec: BuildSpec) -> BuildReport | None:
    """The variant's latest published build if `spec` made it from the source's current artifact:
    it passed its gate when it was built, so it may serve as it is where the evaluation data a
    rebuild needs is absent (a serving image carries version folders, not eval/)."""
    try:
        _, _, _, artifact = _source(Path(repository), spec.source)
    except BuildError:
        return None
    served = variants.served_versions(Path(repository) / variant)
    published = [(f, r) for f, r in find_reports(Path(repository) / variant)
                 if f.name.isdigit() and int(f.name) in served and r.servable]
    if not published:
        return None
    _, report = max(published, key=lambda item: int(item[0].name))
    made_by_spec = (
        report.engine == spec.engine and report.precision == spec.precision and report.device == spec.device
        and all(report.options.get(k) == v for k, v in spec.options.items())
        and report.source.get("model") == spec.source and report.source.get("sha256") == file_digest(artifact)
    )
    return report if made_by_spec else None


def _existing_variant(variant_dir: Path, model: str) -> ModelConfig | None:
    """The variant's current config; refuses to overwrite a model that is not a build of `model`."""
    path = variant_dir / CONFIG_FILENAME
    if not path.is_file():
        return None
    config = load_model_config(path)
    if config.build is None or config.build.source != model:
        raise BuildError(f"'{variant_dir.name}' exists and is not a build of '{model}'; choose another name")
    return config


def _cached(variant_dir: Path, key: str, gate: BuildGate) -> BuildReport | None:
    """A previous build with this key: the latest version the variant's config serves, or a
    rejection under this gate. A version folder the config does not name (a publish that crashed
    before its config, or one rolled back) is not a hit: the config would not serve it."""
    reports = find_reports(variant_dir)
    served = variants.served_versions(variant_dir)
    published = [(f, r) for f, r in reports if f.name.isdigit() and int(f.name) in served]
    if published:
        latest = max(published, key=lambda item: int(item[0].name))
        if latest[1].cache_key == key:
            latest[1].cache_hit = True
            return latest[1]
    for folder, report in reversed(reports):
        if not folder.name.isdigit() and report.cache_key == key and report.quality.get("gate") == gate.model_dump(mode="json"):
            report.cache_hit = True
            return report
    return None


def _device(engine: str, device: str) -> str:
    """"cpu" or "gpu"; a GPU build needs a GPU, and a TensorRT plan runs nowhere else."""
    from server.devices import visible_gpu_count

    if device not in ("cpu", "gpu"):
        raise BuildError(f"device must be cpu or gpu, not {device!r}")
    if engine == "tensorrt":
        return "gpu"  # its builder says when TensorRT or the GPU is missing
    if device == "gpu" and visible_gpu_count() == 0:
        raise BuildError(f"a {engine} build for the GPU needs one; no GPU is visible on this machine (neither NVML nor torch finds one)")
    return device


def _device_identity(device: str) -> str:
    """What the cache key records of the device: a GPU build is redone on another GPU model."""
    if device == "cpu":
        return "cpu"
    from server.gpu import identity

    return f"gpu {identity(0) or 'unknown'}"


def _reference(config: ModelConfig, version_dir: Path, data: EvalData, digest: str,
               track: Track, device: str) -> dict[str, np.ndarray]:
    from server.quantize.runner import evaluate

    memo = (digest, data.fingerprint, device)
    if memo not in _reference_outputs:
        _reference_outputs[memo] = evaluate(config, version_dir, data, track, "evaluating FP32: ", device)
    return _reference_outputs[memo]


@dataclass(frozen=True)
class _Timing:
    """How every timing of one build runs: same data, seconds, sequence length and device."""

    dirs: tuple[Path, Path]  # the source's model folder and version folder (its evaluation data)
    seconds: float
    sequence_length: int
    work: Path
    track: Track
    device: str

    def run(self, config: ModelConfig, version_dir: Path, batches: list[int] | None, label: str) -> dict[str, Any]:
        from server.quantize.bench import benchmark

        return benchmark(config, version_dir, self.dirs, batches=batches, seconds=self.seconds,
                         sequence_length=self.sequence_length, workdir=self.work, track=self.track,
                         label=label, device=self.device)


def _reference_time(timing: _Timing, config: ModelConfig, version_dir: Path, batches: list[int],
                    digest: str) -> dict[str, Any]:
    memo = (digest, tuple(batches), timing.seconds, timing.sequence_length, timing.device)
    if memo not in _reference_bench:
        _reference_bench[memo] = timing.run(config, version_dir, batches, "timing FP32")
    return _reference_bench[memo]


def _same_engine_time(timing: _Timing, config: ModelConfig, exported: Path, batches: list[int]) -> dict[str, Any]:
    """The FP32 export in the build's engine: separates the engine's gain from the precision's."""
    folder = timing.work / "fp32-same-engine"
    folder.mkdir(exist_ok=True)
    shutil.copyfile(exported, folder / "model.onnx")
    record_digests(folder)
    fp32 = config.model_copy(update={"precision": "fp32", "build": None, "model_filename": None})
    return timing.run(fp32, folder, batches, "timing FP32 in the build's engine")


def _write_report(report: BuildReport, folder: Path, repository: Path) -> None:
    """build.json, build.md and the speed-vs-quality chart of every build of this source."""
    from server.quantize.chart import write_chart

    (folder / REPORT_FILE).write_text(report.to_json(), encoding="utf-8")
    (folder / MARKDOWN_FILE).write_text(report.markdown(), encoding="utf-8")
    siblings = [report]
    for candidate in sorted(p for p in repository.iterdir() if p.is_dir() and p.name != report.variant):
        found = find_reports(candidate)
        if found and found[-1][1].source.get("model") == report.source.get("model"):
            siblings.append(found[-1][1])
    write_chart(siblings, folder / CHART_FILE)
