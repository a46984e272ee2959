"""The precision variants of a model in a repository, as `batchline build` leaves them.

A variant is a model folder whose config.yaml has `build: {source: MODEL, engine, precision}`
(e.g. minilm-onnxruntime-int8); the model itself is the FP32 reference. Read from the files, not
by importing the server, so the bench keeps working while the build tooling changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from server.layout import config_path, version_numbers


@dataclass(frozen=True)
class Variant:
    name: str
    folder: Path
    engine: str
    precision: str  # what it was built to: build.precision, else the config's precision
    engine_precision: str  # the config's precision: the dtype the engine computes in
    source: str | None  # None: the model itself
    built: bool  # a numeric version folder exists (a variant whose builds all failed has none)
    build: dict[str, Any] | None


def _config(folder: Path) -> dict[str, Any] | None:
    try:
        config = yaml.safe_load(config_path(folder).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    return config if isinstance(config, dict) else None


def _variant(folder: Path, config: dict[str, Any]) -> Variant:
    build = config.get("build") if isinstance(config.get("build"), dict) else None
    built = bool(version_numbers(folder))
    return Variant(
        name=str(config.get("name", folder.name)),
        folder=folder,
        engine=str(config.get("engine", (build or {}).get("engine", "?"))),
        precision=str((build or {}).get("precision") or config.get("precision", "fp32")),
        engine_precision=str(config.get("precision", "fp32")),
        source=str(build["source"]) if build and build.get("source") else None,
        built=built,
        build=build,
    )


def find(repository: Path, model: str) -> list[Variant]:
    """The model first, then each folder built from it, by name."""
    found: list[Variant] = []
    base = _config(repository / model)
    if base is None:
        raise FileNotFoundError(f"{config_path(repository / model)} is missing")
    found.append(_variant(repository / model, base))
    for folder in sorted(p for p in repository.iterdir() if p.is_dir() and p.name != model):
        config = _config(folder)
        build = (config or {}).get("build")
        if isinstance(build, dict) and build.get("source") == model:
            found.append(_variant(folder, config or {}))
    return found
