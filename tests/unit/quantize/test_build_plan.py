"""A build as a plan and its steps, each on its own: what the plan resolves, how `judge` and
`publish` decide, and how long FP32's figures live (a build's own, or shared when passed)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from server.config import BuildGate, BuildSpec
from server.engines.digests import file_digest
from server.layout import version_numbers
from server.quantize import runner, variant
from server.quantize.api import build, judge, plan_build, publish
from server.quantize.builders import BuildOutput
from server.quantize.errors import BuildError
from server.quantize.plan import BuildPlan, Made, Verdict
from server.quantize.references import References


def quiet(message: str) -> None:
    """Progress sink: tests do not print."""


def _declare(repository: Path, name: str, **build_block: Any) -> None:
    """A variant config of digits whose `build:` block records an earlier build."""
    raw = yaml.safe_load((repository / "digits" / "config.yaml").read_text())
    raw.update(name=name, engine="onnxruntime", precision="int8",
               build={"source": "digits", "engine": "onnxruntime", "precision": "int8", **build_block})
    (repository / name).mkdir()
    (repository / name / "config.yaml").write_text(yaml.safe_dump(raw))


def test_a_new_variant_plans_the_defaults_on_the_cpu(repository: Path) -> None:
    plan = plan_build(repository, "digits", "onnxruntime", "int8", progress=quiet)
    assert (plan.variant, plan.variant_dir) == ("digits-onnxruntime-int8", repository / "digits-onnxruntime-int8")
    assert plan.source.model == "digits" and plan.source.version == 1 and plan.source.config.engine == "torch"
    assert plan.source.digest == file_digest(repository / "digits" / "1" / "model.pt2")
    assert plan.given == {} and plan.options["mode"] == "static"  # the builder's defaults
    assert plan.gate == BuildGate() and plan.device == "cpu" and plan.bench.enabled
    assert plan.key == plan_build(repository, "digits", "onnxruntime", "int8", progress=quiet).key
    assert not plan.variant_dir.exists()  # planning makes nothing


def test_options_gate_and_device_come_from_the_variants_earlier_build(repository: Path) -> None:
    _declare(repository, "digits-tuned", options={"per_channel": False}, gate={"min_accuracy_ratio": 0.9})
    earlier = plan_build(repository, "digits", "onnxruntime", "int8", name="digits-tuned", progress=quiet)
    assert earlier.given == {"per_channel": False} and earlier.options["per_channel"] is False
    assert earlier.gate.min_accuracy_ratio == 0.9 and earlier.device == "cpu"
    asked = plan_build(repository, "digits", "onnxruntime", "int8", name="digits-tuned", options={},
                       gate=BuildGate(), progress=quiet)
    assert asked.given == {} and asked.options["per_channel"] is True and asked.gate == BuildGate()
    assert asked.key != earlier.key  # the options shape the artifact; the gate does not
    assert plan_build(repository, "digits", "onnxruntime", "int8", name="digits-tuned", options={"per_channel": False},
                      progress=quiet).key == earlier.key


def test_the_device_is_checked_and_tensorrt_plans_for_the_gpu(repository: Path) -> None:
    assert plan_build(repository, "digits", "tensorrt", "fp16", device="cpu", progress=quiet).device == "gpu"
    with pytest.raises(BuildError, match="device must be cpu or gpu"):
        plan_build(repository, "digits", "onnxruntime", "int8", device="tpu", progress=quiet)
    with pytest.raises(BuildError, match="not usable"):
        plan_build(repository, "digits", "onnxruntime", "int8", name="digits", progress=quiet)


def _one_hot(classes: np.ndarray) -> np.ndarray:
    return np.eye(10, dtype=np.float32)[classes]


def _made(plan: BuildPlan, stage: Path, config: dict[str, Any] | None = None) -> Made:
    """A staged build with a stand-in artifact, served as its source (for steps that do not run it)."""
    stage.mkdir(parents=True, exist_ok=True)
    (stage / "model.onnx").write_bytes(b"not a graph")
    output = BuildOutput("model.onnx", "onnxruntime", plan.precision, "a test build", notes=["builder's note"])
    return Made(stage=stage, work=stage, output=output, config=config or {}, served_as=plan.source.config)


def _evaluations(monkeypatch: pytest.MonkeyPatch, plan: BuildPlan, build_classes: np.ndarray) -> list[str]:
    """FP32 answers every label right, the build answers `build_classes`; returns the labels evaluated."""
    labels = plan.data.labels
    assert labels is not None
    seen: list[str] = []

    def evaluate(config: Any, version_dir: Path, data: Any, track: Any, label: str, device: str) -> dict:
        seen.append(label)
        return {"output": _one_hot(labels if label.startswith("evaluating FP32") else build_classes)}

    monkeypatch.setattr(runner, "evaluate", evaluate)
    return seen


def test_judge_fails_a_build_below_the_gate_and_says_why(
    repository: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = plan_build(repository, "digits", "onnxruntime", "fp32", progress=quiet)
    labels = plan.data.labels
    assert labels is not None
    wrong = labels.copy()
    wrong[: len(wrong) // 5] = (wrong[: len(wrong) // 5] + 1) % 10  # a fifth of the answers change
    _evaluations(monkeypatch, plan, wrong)
    verdict = judge(plan, _made(plan, tmp_path / "stage"), References())
    assert not verdict.servable and not verdict.quality["passed"]
    assert verdict.quality["gate"] == BuildGate().model_dump(mode="json")
    assert verdict.notes[0] == "builder's note"
    assert verdict.notes[1].startswith("quality gate FAILED: accuracy 0.8") and "published anyway" not in verdict.notes[1]

    lenient = dataclasses.replace(plan, gate=BuildGate(enforce=False))
    verdict = judge(lenient, _made(lenient, tmp_path / "stage"), References())
    assert verdict.servable and not verdict.quality["passed"]
    assert verdict.notes[1].endswith("; published anyway (enforce: false)")


def test_judge_passes_a_build_that_answers_as_fp32(
    repository: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = plan_build(repository, "digits", "onnxruntime", "fp32", progress=quiet)
    assert plan.data.labels is not None
    seen = _evaluations(monkeypatch, plan, plan.data.labels)
    verdict = judge(plan, _made(plan, tmp_path / "stage"), References())
    assert verdict.servable and verdict.quality["passed"] and verdict.notes == ["builder's note"]
    assert seen == ["evaluating FP32: ", "evaluating the build: "]


def test_publish_keeps_a_rejected_build_under_rejected_and_never_serves_it(repository: Path) -> None:
    lines: list[str] = []
    plan = plan_build(repository, "digits", "onnxruntime", "fp32", progress=lines.append)
    plan.variant_dir.mkdir()
    verdict = Verdict(quality={"passed": False, "checks": []}, servable=False, notes=["quality gate FAILED: x"])
    report = publish(plan, _made(plan, plan.variant_dir / ".build-test"), verdict, None)
    kept = plan.variant_dir / "rejected" / plan.key[:16]
    assert not report.servable and report.version is None and report.location == f"{plan.variant}/rejected/{plan.key[:16]}"
    assert (kept / "build.json").is_file() and (kept / "model.onnx").is_file()
    assert version_numbers(plan.variant_dir) == [] and not (plan.variant_dir / "config.yaml").exists()
    assert lines == [report.summary()] and "GATE FAILED" in lines[0]


def test_publish_makes_a_servable_build_the_next_version(repository: Path) -> None:
    plan = plan_build(repository, "digits", "onnxruntime", "fp32", progress=quiet)
    plan.variant_dir.mkdir()
    config = variant.derive_config(variant.read_raw_config(repository / "digits"), name=plan.variant,
                                   engine="onnxruntime", precision="fp32", model_filename=None,
                                   spec=BuildSpec(source="digits", engine="onnxruntime", precision="fp32"))
    verdict = Verdict(quality={"passed": True, "checks": []}, servable=True, notes=[])
    report = publish(plan, _made(plan, plan.variant_dir / ".build-test", config), verdict, None)
    assert report.servable and report.version == 1 and report.location == f"{plan.variant}/1"
    assert (plan.variant_dir / "1" / "build.json").is_file() and variant.served_versions(plan.variant_dir) == [1]
    assert not (plan.variant_dir / "rejected").exists()


def _count_fp32_evaluations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    real, seen = runner.evaluate, []

    def counting(*args: Any, **kwargs: Any) -> Any:
        label = args[4] if len(args) > 4 else kwargs.get("label", "")
        if label.startswith("evaluating FP32"):
            seen.append(label)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "evaluate", counting)
    return seen


def test_fp32_is_evaluated_per_build_unless_a_references_is_shared(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No module-level memo: a build keeps FP32's answers only while it runs, unless its caller
    passes a References that several builds share."""
    seen = _count_fp32_evaluations(monkeypatch)
    for _ in range(2):
        build(repository, "digits", "torch", "bf16", force=True, progress=quiet, benchmark=False)
    assert len(seen) == 2
    shared = References()
    for _ in range(2):
        build(repository, "digits", "torch", "bf16", force=True, progress=quiet, benchmark=False, references=shared)
    assert len(seen) == 3


class CountingTiming:
    """Stands in for bench.Timing: counts the timings asked of it."""

    seconds, sequence_length, device = 0.1, 32, "cpu"

    def __init__(self) -> None:
        self.runs: list[tuple[list[int] | None, str]] = []

    def run(self, config: Any, version_dir: Path, batches: list[int] | None, label: str) -> dict[str, Any]:
        self.runs.append((batches, label))
        return {"buckets": [{"batch": b} for b in batches or []]}


def test_fp32_is_timed_once_per_batch_sizes_and_settings(repository: Path) -> None:
    plan = plan_build(repository, "digits", "onnxruntime", "fp32", progress=quiet)
    references, timing = References(), CountingTiming()
    first = references.timing(plan, timing, [1, 8])  # type: ignore[arg-type]
    assert references.timing(plan, timing, [1, 8]) is first  # type: ignore[arg-type]
    references.timing(plan, timing, [1, 32])  # type: ignore[arg-type]
    assert timing.runs == [([1, 8], "timing FP32"), ([1, 32], "timing FP32")]
