"""The one small interface every engine implements.

An engine knows its artifact and its device, nothing else: no HTTP, no queues, no metrics.
Tensors cross this boundary as numpy arrays keyed by the engine's own tensor names; BYTES
tensors are object arrays of `bytes` both ways, whatever the runtime wants inside.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from server.config import ModelConfig
from server.devices import Device
from server.engines.digests import verify_artifact
from server.engines.signature import EngineSignature
from server.errors import EngineError


@dataclass(frozen=True)
class EngineDescription:
    """What the engine really runs on, as verified after loading (logged and shown in stats)."""

    engine: str
    device: str
    precision: str
    providers: list[str] = field(default_factory=list)
    artifact: str = ""


class Engine(ABC):
    """Loads an artifact at construction; a failed load raises `EngineError` with the reason."""

    @abstractmethod
    def __init__(self, config: ModelConfig, version_dir: Path, device: Device) -> None: ...

    @abstractmethod
    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch. An engine is run from one thread, its instance's (warm-up included), so
        it may block, should release the GIL while computing, and may keep state per thread
        (torch keeps its CUDA graphs so)."""

    @abstractmethod
    def describe(self) -> EngineDescription: ...

    @property
    def compiles_per_shape(self) -> bool:
        """Whether the first run at a new input shape prepares something a client would wait
        for (a compile, a CUDA graph, an engine build, a timed kernel search). Warm-up runs every
        shape a batch can take (each batch bucket, times each sequence bucket) only for such an
        engine; for others, a few batch sizes. False unless the engine says otherwise."""
        return False

    @abstractmethod
    def signature(self) -> EngineSignature:
        """The tensors the artifact takes and gives, read from the artifact itself, so that the
        config can be checked against the model rather than trusted."""

    def close(self) -> None:
        """Free the engine's resources; the default relies on garbage collection."""


def artifact_path(config: ModelConfig, version_dir: Path, default_filename: str) -> Path:
    """The artifact an engine loads, checked against the version folder's recorded digests
    before anything reads it: every engine resolves its artifact here, so every engine gets the
    same check (`server/engines/digests.py`; a folder without a record loads with a warning)."""
    path = version_dir / (config.model_filename or default_filename)
    if not path.is_file():
        raise EngineError(f"model artifact {path} is missing (was the model built?)")
    verify_artifact(path, version_dir)
    return path

