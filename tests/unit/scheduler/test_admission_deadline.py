"""A request's `timeout` counts from when its front end took it in, not from admission: the
time spent reading and parsing its body is part of what the client waits."""

from __future__ import annotations

import time

import numpy as np

from server.config import ModelConfig
from server.scheduler.admission import REQUEST_OPTIONS, Admission
from tests.unit.admitting import admit

CONFIG = ModelConfig.model_validate(
    {
        "name": "double",
        "engine": "onnxruntime",
        "max_batch_size": 4,
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [1]}],
        "dynamic_batching": {"default_queue_policy": {"default_timeout_microseconds": 2_000_000}},
    }
)
INPUTS = {"x": ("FP32", np.ones((1, 1), dtype=np.float32))}


async def test_the_deadline_counts_from_receipt() -> None:
    received = time.perf_counter_ns() - 300_000_000  # its body took 300 ms to arrive and parse
    admitted = await admit(Admission(CONFIG, None), INPUTS, {"timeout": 1_000_000}, received)
    assert admitted.deadline_ns == received + 1_000_000_000


async def test_the_models_default_timeout_counts_from_receipt_too() -> None:
    received = time.perf_counter_ns() - 300_000_000
    admitted = await admit(Admission(CONFIG, None), INPUTS, {}, received)
    assert admitted.deadline_ns == received + 2_000_000_000


async def test_without_a_receipt_time_the_deadline_counts_from_admission() -> None:
    before = time.perf_counter_ns()
    admitted = await admit(Admission(CONFIG, None), INPUTS, {"timeout": 1_000_000})
    assert admitted.deadline_ns is not None
    assert before + 1_000_000_000 <= admitted.deadline_ns <= time.perf_counter_ns() + 1_000_000_000


async def test_no_timeout_no_deadline() -> None:
    config = CONFIG.model_copy(update={"dynamic_batching": None})
    admitted = await admit(Admission(config, None), INPUTS, {}, time.perf_counter_ns())
    assert admitted.deadline_ns is None


class Watched(dict):  # type: ignore[type-arg]
    """Parameters that note every key read."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.read: set[str] = set()

    def get(self, key: str, default: object = None) -> object:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> object:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)


async def test_admission_reads_only_the_parameters_a_front_end_passes_on() -> None:
    """A front-end process sends the server process REQUEST_OPTIONS alone (server/link.py)."""
    parameters = Watched({"timeout": 1_000_000, "priority": 0, "mine": 1})
    await admit(Admission(CONFIG, None), INPUTS, parameters)
    assert parameters.read and parameters.read <= set(REQUEST_OPTIONS)
