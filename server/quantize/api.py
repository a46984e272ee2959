"""`build()`: make a quantized / lower-precision variant of a model, judge it, publish it or not.

Flow: `plan_build()` resolves the source (an FP32 model of the repository), the builder, the
options, gate, device and data into a `BuildPlan`, with its cache key; the variant's latest
version is reused if its key matches; otherwise four steps run in a hidden staging folder:
`make` the artifact and the variant's config, `judge` it against FP32 on held-out data,
`measure_speed` (optional), and `publish` the report, with the folder as the next version only
when the quality gate passes (or is not enforced), else under rejected/.
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
from pathlib import Path
from typing import Any

from server.config import BuildGate, BuildSpec, ModelConfig, load_model_config
from server.engines.digests import file_digest, record_digests, verify_artifact
from server.engines.registry import ENGINES, artifact_file
from server.layout import config_path, found_version_dir, version_number, version_numbers
from server.quantize import variant as variants
from server.quantize.bench import Timing
from server.quantize.builders import BuildContext, resolve_options
from server.quantize.cache import cache_key, library_versions
from server.quantize.data import load_eval_data
from server.quantize.errors import BuildError
from server.quantize.plan import BenchSettings, BuildPlan, Made, Source, Verdict
from server.quantize.progress import Track, untracked
from server.quantize.references import References
from server.quantize.registry import select
from server.quantize.reporting import (
    CHART_FILE,
    MARKDOWN_FILE,
    REJECTED_DIR,
    REPORT_FILE,
    BuildReport,
    find_reports,
)

logger = logging.getLogger("server.quantize")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# What a config says of serving alone: changing it never calls for a rebuild (a build's key).
SERVING_ONLY = {"name", "openai", "record_traffic", "dynamic_batching", "version_policy", "warmup",
                "instance_group", "execution_timeout_seconds", "max_item_bytes"}


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
    references: References | None = None,
) -> BuildReport:
    """Build `model` for `engine`/`precision` as the variant `name` (default model-engine-precision).

    `progress` gets a line per step; `track` wraps the long loops (a bar on a terminal).
    `device` ("cpu" or "gpu", default the variant's earlier build's or "cpu") is where the build
    is evaluated and timed, against FP32 on the same device, and where the variant serves.
    `recorded`: whether the source's eval/recorded.npz (traffic the server recorded) may stand in
    for eval/inputs.npz. `references`: FP32's figures to share with other builds of the same
    source in this run; by default the build computes its own and drops them when it returns.
    Returns the report; `report.servable` says whether a version was published. Raises
    `BuildError` (an EngineError) or `ConfigError` when no build can be made at all.
    """
    plan = plan_build(
        repository, model, engine, precision, name=name, progress=progress, track=track, device=device,
        options=options, gate=gate, bench=BenchSettings(benchmark, bench_seconds, bench_batches, sequence_length),
        recorded=recorded,
    )
    with variants.locked(plan.variant_dir):
        if not force:
            hit = _cached(plan.variant_dir, plan.key, plan.gate)
            if hit is not None:
                progress(f"{plan.variant}: cache hit ({hit.location}); nothing rebuilt")
                return hit
        try:
            return _run(plan, references if references is not None else References())
        except BaseException:
            variants.cleanup_if_empty(plan.variant_dir)
            raise


def plan_build(
    repository: Path,
    model: str,
    engine: str,
    precision: str,
    *,
    name: str | None = None,
    progress: Callable[[str], None] = _log,
    track: Track = untracked,
    device: str | None = None,
    options: dict[str, Any] | None = None,
    gate: BuildGate | None = None,
    bench: BenchSettings | None = None,
    recorded: bool = True,
) -> BuildPlan:
    """Everything the build needs, resolved and checked before anything is made: a bad source,
    name, combination, option or device is refused here. Options, gate and device not given
    are the variant's earlier build's, else the defaults."""
    started = time.perf_counter()
    repository = Path(repository).absolute()  # child processes and scratch folders run elsewhere
    source_config, source_version, source_version_dir, source_artifact = _source(repository, model)
    variant = name or variants.variant_name(model, engine, precision)
    if not _NAME.match(variant) or variant == model:
        raise BuildError(f"variant name {variant!r} is not usable (a folder name other than the source's)")
    variant_dir = repository / variant
    existing = _existing_variant(variant_dir, model)
    earlier = existing.build if existing else None
    builder = select(engine, precision, source_config.engine)
    given = dict(options if options is not None else (earlier.options if earlier else {}))
    data = load_eval_data(repository / model, source_version_dir, source_config, recorded=recorded)
    resolved = resolve_options(builder, source_config, data, given)
    gate = gate or (earlier.gate if earlier else BuildGate())
    device = _device(engine, device or (earlier.device if earlier else "cpu"))
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
    source = Source(source_config, source_version, source_version_dir, source_artifact, source_info)
    return BuildPlan(
        repository=repository, variant=variant, variant_dir=variant_dir, source=source, engine=engine,
        precision=precision, device=device, builder=builder, given=given, options=resolved, gate=gate, data=data,
        key=key, versions=versions, bench=bench or BenchSettings(), started=started, progress=progress, track=track,
    )


def _run(plan: BuildPlan, references: References) -> BuildReport:
    """The steps, in a staging folder (published, rejected or removed) and a scratch folder."""
    with variants.staging(plan.variant_dir) as stage, tempfile.TemporaryDirectory(prefix="batchline-build-") as work:
        made = make(plan, stage, Path(work))
        verdict = judge(plan, made, references)
        speed = measure_speed(plan, made, references) if plan.bench.enabled else None
        return publish(plan, made, verdict, speed)


def make(plan: BuildPlan, stage: Path, work: Path) -> Made:
    """The artifact in `stage` with the tokenizer and the digests, and the variant's derived config."""
    source, variant = plan.source, plan.variant
    plan.progress(f"{variant}: building {plan.engine} {plan.precision} from {source.model}/{source.version}")
    context = BuildContext(
        source_config=source.config, source_version_dir=source.version_dir, source_artifact=source.artifact,
        engine=plan.engine, precision=plan.precision, device=plan.device, stage=stage, work=work,
        options=plan.options, data=plan.data, progress=lambda m: plan.progress(f"{variant}: {m}"), track=plan.track,
    )
    try:
        output = plan.builder.run(context)
    except BuildError:
        raise
    except Exception as exc:  # the libraries' own errors on a model they cannot take: said, not a traceback
        logger.debug("the %s %s build of %s failed", plan.engine, plan.precision, source.model, exc_info=True)
        raise BuildError(f"the {plan.engine} {plan.precision} build failed: {type(exc).__name__}: "
                         f"{str(exc).strip()[:2000]}") from exc
    if source.config.tokenize is not None:
        tokenizer = source.config.tokenize.tokenizer
        shutil.copyfile(source.version_dir / tokenizer, stage / tokenizer)
    record_digests(stage)  # evaluated and timed as it will serve: verified; publish records the rest
    has_config = config_path(plan.variant_dir).is_file()
    base = variants.read_raw_config(plan.variant_dir if has_config else plan.repository / source.model)
    spec = BuildSpec.model_validate({"source": source.model, "engine": plan.engine, "precision": plan.precision,
                                     "device": plan.device, "options": plan.given, "gate": plan.gate})
    filename = None if output.artifact == ENGINES[output.engine].artifact else output.artifact
    derived = variants.derive_config(
        base, name=variant, engine=output.engine, precision=output.precision, model_filename=filename, spec=spec,
        datatypes={**{t.name: t.datatype for t in (*source.config.inputs, *source.config.outputs)},
                   **output.datatypes},
    )
    return Made(stage=stage, work=work, output=output, config=derived, served_as=ModelConfig.model_validate(derived))


def judge(plan: BuildPlan, made: Made, references: References) -> Verdict:
    """The build's answers against FP32's on the held-out data, through the gate."""
    from server.quantize.quality import judge as quality_of
    from server.quantize.runner import evaluate

    gate = plan.gate
    plan.progress(f"{plan.variant}: evaluating against FP32 on {plan.data.kind} held-out data")
    reference = references.outputs(plan)
    outputs = evaluate(made.served_as, made.stage, plan.data, plan.track, "evaluating the build: ", plan.device)
    quality = quality_of(plan.data, reference, outputs, gate, embedding_model=plan.source.config.openai is not None)
    quality["gate"] = gate.model_dump(mode="json")
    notes = list(made.output.notes)
    if not quality["passed"]:
        failed = [c for c in quality["checks"] if not c["passed"]]
        detail = ", ".join(f"{c['metric']} {c['value']:.4f}, not {c['op']} {c['threshold']:.4f}" for c in failed)
        notes.append(f"quality gate FAILED: {detail}" + ("" if gate.enforce else "; published anyway (enforce: false)"))
    return Verdict(quality=quality, servable=bool(quality["passed"] or not gate.enforce), notes=notes)


def measure_speed(plan: BuildPlan, made: Made, references: References) -> dict[str, Any]:
    """The engine alone at each batch size, for the build and for FP32 (and for the FP32 export
    in the build's engine when the engine changed), timed alike on the plan's device."""
    source, settings = plan.source, plan.bench
    plan.progress(f"{plan.variant}: timing the engine alone (1 thread) at each batch size")
    timing = Timing((plan.repository / source.model, source.version_dir), settings.seconds,
                    settings.sequence_length, made.work, plan.track, plan.device)
    bench = timing.run(made.served_as, made.stage, settings.batches, "timing the build")
    exported = made.work / "fp32.onnx"
    if made.output.engine == "onnxruntime" and source.config.engine != "onnxruntime" and exported.is_file():
        bench["fp32_same_engine"] = _same_engine_time(
            timing, made.served_as, exported, [b["batch"] for b in bench["buckets"]]
        )
    bench["reference"] = references.timing(plan, timing, settings.batches or [b["batch"] for b in bench["buckets"]])
    return bench


def publish(plan: BuildPlan, made: Made, verdict: Verdict, speed: dict[str, Any] | None) -> BuildReport:
    """Write the report into the stage, then make the stage the variant's next version when the
    verdict lets it serve, else keep it under rejected/<key> where it never serves."""
    variant_dir, output = plan.variant_dir, made.output
    version = (version_numbers(variant_dir) or [0])[-1] + 1
    servable = verdict.servable
    report = BuildReport(
        variant=plan.variant, source=plan.source.info, engine=plan.engine, precision=plan.precision,
        options=plan.options, cache_key=plan.key, device=plan.device, method=output.method, notes=verdict.notes,
        version=version if servable else None,
        location=f"{plan.variant}/{version}" if servable else f"{plan.variant}/{REJECTED_DIR}/{plan.key[:16]}",
        servable=servable, library_versions=plan.versions,
        artifact={"file": output.artifact, "size_bytes": (made.stage / output.artifact).stat().st_size},
        quality=verdict.quality, benchmark=speed,
        built_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        build_seconds=round(time.perf_counter() - plan.started, 2),
        build_peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    )
    _write_report(report, made.stage, plan.repository)
    if servable:
        published = variants.publish(variant_dir, made.stage, made.config, plan.source.model)
        assert published == version
    else:
        variants.reject(variant_dir, made.stage, plan.key)
    plan.progress(report.summary())
    return report


def _source(repository: Path, model: str) -> tuple[ModelConfig, int, Path, Path]:
    """The FP32 source: its config, the version it serves, that folder, and the artifact."""
    model_dir = repository / model
    if not config_path(model_dir).is_file():
        raise BuildError(f"model '{model}' is not in the repository {repository}")
    config = load_model_config(config_path(model_dir))
    if config.build is not None:
        raise BuildError(f"'{model}' is itself a build of '{config.build.source}'; build from the FP32 source")
    if config.precision != "fp32":
        raise BuildError(f"'{model}' is {config.precision}; builds start from an FP32 model")
    selected = config.version_policy.select(version_numbers(model_dir))
    if not selected:
        raise BuildError(f"model '{model}' has no version folder to build from (was it built?)")
    version_dir = found_version_dir(model_dir, selected[-1])
    artifact = artifact_file(config, version_dir)
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
                 if version_number(f.name) in served and r.servable]
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
    path = config_path(variant_dir)
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
    published = [(f, r) for f, r in reports if version_number(f.name) in served]
    if published:
        latest = max(published, key=lambda item: int(item[0].name))
        if latest[1].cache_key == key:
            latest[1].cache_hit = True
            return latest[1]
    for folder, report in reversed(reports):
        if version_number(folder.name) is None and report.cache_key == key and report.quality.get("gate") == gate.model_dump(mode="json"):
            report.cache_hit = True
            return report
    return None


def _device(engine: str, device: str) -> str:
    """"cpu" or "gpu"; a GPU build needs a GPU, and a TensorRT plan runs nowhere else."""
    from server.devices import visible_gpu_count

    if device not in ("cpu", "gpu"):
        raise BuildError(f"device must be cpu or gpu, not {device!r}")
    if ENGINES[engine].gpu_only:
        return "gpu"  # its builder says when its runtime or the GPU is missing
    if device == "gpu" and visible_gpu_count() == 0:
        raise BuildError(f"a {engine} build for the GPU needs one; no GPU is visible on this machine (neither NVML nor torch finds one)")
    return device


def _device_identity(device: str) -> str:
    """What the cache key records of the device: a GPU build is redone on another GPU model."""
    if device == "cpu":
        return "cpu"
    from server.gpu import identity

    return f"gpu {identity(0) or 'unknown'}"


def _same_engine_time(timing: Timing, config: ModelConfig, exported: Path, batches: list[int]) -> dict[str, Any]:
    """The FP32 export in the build's engine: separates the engine's gain from the precision's."""
    folder = timing.work / "fp32-same-engine"
    folder.mkdir(exist_ok=True)
    shutil.copyfile(exported, folder / ENGINES["onnxruntime"].artifact)
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
