"""The one small interface every engine implements.

An engine knows its spec (artifact, tensors, precision, its own options: server/engines/spec.py)
and its device, nothing else: no model config, no HTTP, no queues, no metrics.
Tensors cross this boundary as numpy arrays keyed by the engine's own tensor names; BYTES
tensors are object arrays of `bytes` both ways, whatever the runtime wants inside.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from server.devices import Device
from server.engines.signature import EngineSignature
from server.engines.spec import EngineSpec


@dataclass(frozen=True)
class EngineDescription:
    """What the engine really runs on, as verified after loading (logged and shown in stats)."""

    engine: str
    device: str
    precision: str
    providers: list[str] = field(default_factory=list)
    artifact: str = ""


class Engine(ABC):
    """Loads its spec's artifact at construction; a failed load raises `EngineError` with the reason."""

    @abstractmethod
    def __init__(self, spec: EngineSpec[Any], device: Device) -> None: ...

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

