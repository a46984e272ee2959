"""Engines that fail on cue, for the fault tests: a real (tiny ONNX) engine behind a wrapper that
hangs, raises or runs out of memory when a batch holds a chosen x value. The test's own requests
set every fault up, never the clock; waits are on state, bounded, and fail with a sentence."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import server.model
from server.engines.base import Engine
from server.errors import EngineError

HANG = 99.0  # a batch holding this waits in the engine until Faults.release is set
RAISE = 13.0  # a batch holding this fails with an engine error
OOM = 7.0  # a batch holding this runs out of memory, whatever its size (ONNX Runtime's words)
HANG_LIMIT_S = 60  # a hung batch nobody releases ends, so no thread outlives the test run by much


class Faults:
    """The switches every faulty engine of a test reads, and what each engine ran."""

    def __init__(self) -> None:
        self.held = threading.Event()
        self.release = threading.Event()
        self.max_rows: int | None = None  # batches of more rows run out of memory (MemoryError)
        self.refuse_load: Callable[[Path], BaseException | None] = lambda _: None
        self.created = 0
        self.builds_held = False  # set: each engine build waits in its thread until `release`
        self.building = threading.Event()  # a held build has begun
        self._lock = threading.Lock()
        self._runs: list[tuple[str, int, list[float]]] = []  # (version folder, engine serial, x values)

    def record(self, version: str, serial: int, values: list[float]) -> None:
        with self._lock:
            self._runs.append((version, serial, values))

    def runs(self, version: str | None = None, serial: int | None = None) -> list[list[float]]:
        with self._lock:
            return [v for ver, s, v in self._runs if version in (None, ver) and serial in (None, s)]


class FaultyEngine:
    """The real engine, doing what `faults` says first; everything else goes to the real one."""

    def __init__(self, inner: Engine, faults: Faults, version: str, serial: int) -> None:
        self._inner = inner
        self._faults = faults
        self.version = version
        self.serial = serial
        self.closed = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["x"]
        values = [float(v) for v in x.ravel()]
        self._faults.record(self.version, self.serial, values)
        if HANG in values:
            self._faults.held.set()
            if not self._faults.release.wait(HANG_LIMIT_S):
                raise RuntimeError("a hung batch was never released")
        if self._faults.max_rows is not None and len(x) > self._faults.max_rows:
            raise MemoryError()  # a batch too big fails to allocate before anything else
        if RAISE in values:
            raise EngineError("the engine failed on purpose")
        if OOM in values:
            cause = RuntimeError(
                "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running Add node."
                " Status Message: bfc_arena.cc:376 onnxruntime::BFCArena::AllocateRawInternal Failed to allocate"
                " memory for requested buffer of size 1048576"
            )
            raise EngineError(f"ONNX Runtime failed: {cause}") from cause
        return self._inner.run(inputs)

    def close(self) -> None:
        self.closed.set()
        self._inner.close()


def injected_faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[Faults]:
    """For a test's `faults` fixture: every engine the model layer creates during the test is a
    FaultyEngine; hung batches and held builds are released at the end."""
    shared = Faults()
    real = server.model.create_engine

    def create(config: Any, version_dir: Path, device: Any) -> FaultyEngine:
        refusal = shared.refuse_load(version_dir)
        if refusal is not None:
            raise refusal
        if shared.builds_held:
            shared.building.set()
            shared.release.wait(HANG_LIMIT_S)
        shared.created += 1
        return FaultyEngine(real(config, version_dir, device), shared, version_dir.name, shared.created)

    monkeypatch.setattr(server.model, "create_engine", create)
    yield shared
    shared.release.set()


def rows(*values: float, width: int = 2) -> tuple[str, np.ndarray]:
    """One FP32 request of len(values) items for the doubling model: item i is all values[i]."""
    return "FP32", np.repeat(np.array(values, np.float32).reshape(-1, 1), width, axis=1)
