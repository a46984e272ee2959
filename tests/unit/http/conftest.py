"""Fixtures for ASGI-level tests of the HTTP edge: a real repository of tiny ONNX models whose
engines can be held busy on cue, and scripted ASGI exchanges.

An engine is held by its input, not by time: a batch holding the value HOLD blocks inside the
engine (on the instance's thread) until the test releases it, so "busy" is a state the test
sets and observes, never a race with the clock.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Self

import numpy as np
import orjson
import pytest
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

import server.model
from server.dataplane import DataPlane
from server.engines.base import Engine
from server.http import v2_infer
from server.repository import ModelRepository
from tests.unit.http.tiny_models import write_spin_model

HOLD = 99.0  # a batch with this x value waits in the engine until Gate.release
HOLD_LIMIT_S = 30  # a held batch that is never released fails instead of hanging the suite

Message = dict[str, Any]


class GatedEngine:
    """The real engine behind a gate: records the x values of every batch it runs; everything
    else (describe, close, whatever the engine interface grows) goes to the real engine."""

    def __init__(self, inner: Engine, gate: Gate) -> None:
        self._inner = inner
        self._gate = gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = [float(v) for v in inputs["x"].ravel()]
        self._gate.record(values)
        if HOLD in values:
            self._gate.held.set()
            if not self._gate.released.wait(HOLD_LIMIT_S):
                raise RuntimeError("a held batch was never released")
        return self._inner.run(inputs)


class Gate:
    """What every engine of a test ran, and the switch that holds HOLD batches."""

    def __init__(self) -> None:
        self.held = threading.Event()
        self.released = threading.Event()
        self._lock = threading.Lock()
        self._batches: list[list[float]] = []

    def record(self, values: list[float]) -> None:
        with self._lock:
            self._batches.append(values)

    @property
    def batches(self) -> list[list[float]]:
        """Batches of requests, in the order they reached an engine (warm-up's zeros left out)."""
        with self._lock:
            return [b for b in self._batches if any(b)]

    def ran(self) -> list[float]:
        return [v for batch in self.batches for v in batch]


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    """Every engine created during the test is gated; held batches are released at the end."""
    shared = Gate()
    real = server.model.create_engine

    def gated(*args: Any, **kwargs: Any) -> GatedEngine:
        return GatedEngine(real(*args, **kwargs), shared)

    monkeypatch.setattr(server.model, "create_engine", gated)
    yield shared
    shared.released.set()


@pytest.fixture
def asgi_tasks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths of the ASGI tasks uvicorn starts during the test (a call answered inline
    starts none)."""
    tasks: list[str] = []
    real_run = RequestResponseCycle.run_asgi

    async def counted(self: RequestResponseCycle, app: Any) -> None:
        tasks.append(self.scope["path"])
        await real_run(self, app)

    monkeypatch.setattr(RequestResponseCycle, "run_asgi", counted)
    return tasks


@pytest.fixture
def encoding_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every JSON output counts as too big to encode on the event loop; the names of the threads
    that encode answers during the test, in order."""
    monkeypatch.setattr(v2_infer, "INLINE_ENCODE_JSON_BYTES", 0)
    threads: list[str] = []
    real_answer = v2_infer._answer

    def answered_where(*args: Any) -> tuple[bytes, int | None]:
        threads.append(threading.current_thread().name)
        return real_answer(*args)

    monkeypatch.setattr(v2_infer, "_answer", answered_where)
    return threads


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """An empty repository folder; tests add the models they need."""
    folder = tmp_path / "models"
    folder.mkdir()
    return folder


@pytest.fixture
async def plane(root: Path, gate: Gate) -> AsyncIterator[DataPlane]:
    """A data plane over `spin` (one instance, dynamic batching), loaded and ready."""
    write_spin_model(root, "spin")
    repository = ModelRepository(root)
    await repository.load("spin")
    yield DataPlane(repository)
    gate.released.set()
    await repository.unload_all()


def infer_body(*values: float, **parameters: Any) -> bytes:
    """A KServe v2 JSON body for `spin`: one request of len(values) items."""
    document: dict[str, Any] = {
        "id": "req",
        "inputs": [{"name": "x", "shape": [len(values), 1], "datatype": "FP32", "data": list(values)}],
    }
    if parameters:
        document["parameters"] = parameters
    return orjson.dumps(document)


class Exchange:
    """One ASGI request: `receive` plays the scripted messages, then (as a server does once
    the body is in) waits until the test calls `disconnect`; `send` records every message."""

    def __init__(
        self,
        messages: list[Message],
        headers: dict[str, str] | None = None,
        path: str = "/v2/models/spin/infer",
    ) -> None:
        self.scope: dict[str, Any] = {
            "type": "http",
            "method": "POST",
            "path": path,
            "query_string": b"",
            "root_path": "",
            "headers": [(k.lower().encode(), v.encode("latin-1")) for k, v in (headers or {}).items()],
            "client": ("127.0.0.1", 50000),
        }
        self._script = list(messages)
        self.receive_calls = 0
        self.sent: list[Message] = []
        self.gone = asyncio.Event()

    @classmethod
    def of(cls, body: bytes, headers: dict[str, str] | None = None, path: str = "/v2/models/spin/infer") -> Self:
        """The whole body in one message, its length declared."""
        declared = {"content-length": str(len(body)), **(headers or {})}
        return cls([{"type": "http.request", "body": body, "more_body": False}], declared, path)

    def disconnect(self) -> None:
        self.gone.set()

    async def receive(self) -> Message:
        self.receive_calls += 1
        if self._script:
            return self._script.pop(0)
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(dict(message))

    @property
    def status(self) -> int:
        assert self.sent, "nothing was sent"
        return int(self.sent[0]["status"])

    @property
    def headers(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.sent[0]["headers"]}

    def json(self) -> Any:
        assert [m["type"] for m in self.sent] == ["http.response.start", "http.response.body"], self.sent
        return orjson.loads(self.sent[1]["body"])
