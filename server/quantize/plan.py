"""A build as a plan: what `api.build()` resolves before anything is made, and what its steps hand on.

`api.plan_build()` turns the caller's arguments into one frozen `BuildPlan` (the source, the
builder, resolved options, gate, device, evaluation data, cache key). The steps then take the
plan and what the step before produced: `make` leaves `Made`, `judge` a `Verdict`, `measure_speed`
the timing figures, and `publish` the report. Each step can be read, and tested, on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.config import BuildGate, ModelConfig
from server.quantize.builders import Builder, BuildOutput, Options
from server.quantize.data import EvalData
from server.quantize.progress import Track


@dataclass(frozen=True)
class Source:
    """The FP32 model a build starts from, at the version it serves now."""

    config: ModelConfig
    version: int
    version_dir: Path
    artifact: Path
    info: dict[str, Any]  # the report's `source` block: model, version, engine, artifact, sha256, size_bytes

    @property
    def model(self) -> str:
        return str(self.info["model"])

    @property
    def digest(self) -> str:
        return str(self.info["sha256"])


@dataclass(frozen=True)
class BenchSettings:
    """How the build and FP32 are timed: every timing of one build runs alike, to compare."""

    enabled: bool = True
    seconds: float = 1.0
    batches: list[int] | None = None  # None: the config's batch buckets, else 1, 8 and 32
    sequence_length: int = 32  # text models: tokens per timed item


@dataclass(frozen=True)
class BuildPlan:
    """Everything one build needs, resolved once; the steps read it and never change it."""

    repository: Path
    variant: str
    variant_dir: Path
    source: Source
    engine: str
    precision: str
    device: str  # "cpu" or "gpu": where the build is judged, timed and served
    builder: Builder
    given: Options  # the options as asked: the variant's `build:` block records these
    options: Options  # the builder's defaults merged with `given`: what builds, and the report's
    gate: BuildGate
    data: EvalData
    key: str  # the cache key
    versions: dict[str, str]  # the libraries that shape the build
    bench: BenchSettings
    started: float  # time.perf_counter() when the build began (the report's build_seconds)
    progress: Callable[[str], None]  # a line per step
    track: Track  # long loops: a bar on a terminal


@dataclass(frozen=True)
class Made:
    """What `make` leaves in the staging folder: the artifact and the config it will serve with."""

    stage: Path  # becomes the version folder (or rejected/<key>)
    work: Path  # scratch of this build: intermediates, the FP32 export, timing requests
    output: BuildOutput
    config: dict[str, Any]  # the derived config.yaml, as `publish` writes it
    served_as: ModelConfig  # the same, validated: how the build is evaluated and timed


@dataclass(frozen=True)
class Verdict:
    """What `judge` found: the report's quality block, whether the version may serve, and notes."""

    quality: dict[str, Any]
    servable: bool
    notes: list[str]
