"""What each builder receives and returns, and how its options are checked.

A builder writes one artifact into the staging folder and says how the variant must be served
(engine, the config's precision) and what it did. This module imports no builder: the builder
modules take these types from here, and the table of which builder makes what is
`registry.py`, above them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.config import ModelConfig
from server.quantize.data import EvalData
from server.quantize.errors import BuildError
from server.quantize.progress import Track

Options = dict[str, Any]


@dataclass
class BuildContext:
    source_config: ModelConfig
    source_version_dir: Path
    source_artifact: Path
    engine: str  # the target engine asked for
    precision: str  # the target precision asked for
    device: str  # "cpu" or "gpu": where the build will be judged and served
    stage: Path  # becomes the version folder: only what serves goes here
    work: Path  # scratch for intermediates (exported ONNX, pre-processed graphs)
    options: Options
    data: EvalData
    progress: Callable[[str], None]
    track: Track  # long loops (calibration): a bar on a terminal


@dataclass
class BuildOutput:
    artifact: str  # file name inside `stage`
    engine: str  # the serving engine of the variant
    precision: str  # the variant config's `precision` (what the serving engine is told)
    method: str
    notes: list[str] = field(default_factory=list)
    datatypes: dict[str, str] = field(default_factory=dict)  # config tensor name -> datatype it now has


@dataclass(frozen=True)
class Builder:
    run: Callable[[BuildContext], BuildOutput]
    defaults: Callable[[ModelConfig, EvalData], Options]
    sources: tuple[str, ...]  # source engines it can start from


def resolve_options(builder: Builder, source: ModelConfig, data: EvalData, given: Options) -> Options:
    """Defaults merged with what was asked; unknown option names are refused, not ignored."""
    defaults = builder.defaults(source, data)
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise BuildError(f"unknown build options {unknown}; this build takes {sorted(defaults)}")
    resolved = {**defaults, **given}
    for key, value in resolved.items():
        expected = type(defaults[key])
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            resolved[key] = float(value)
        elif not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise BuildError(f"build option {key!r} must be {expected.__name__}, got {value!r}")
    return resolved
