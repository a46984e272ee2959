"""The batcher facing instance faults: a stuck instance is retired and replaced, a model left with
none answers its queue at once, working caps lowered by memory shape later batches, and a batch
that failed in part answers the rest. Fake instances do what each test scripts, when it says."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest

from server.errors import ExecutionTimeout, OutOfMemory, Unavailable
from server.scheduler.batcher import Batcher, BatchRunner, QueueSettings
from server.scheduler.policy import BatchPolicy
from server.scheduler.request import InferenceRequest
from server.stats import ModelStatistics
from server.workers.result import BatchResult

Outcome = Callable[[list[dict[str, np.ndarray]]], BatchResult]


def doubled(feeds: list[dict[str, np.ndarray]]) -> BatchResult:
    return BatchResult([{"y": f["x"] * 2} for f in feeds])


class ScriptedInstance:
    """Each batch waits for the test's `finish(outcome)`: a result maker, or an error to raise."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.batches: list[list[float]] = []
        self._pending: list[asyncio.Future[Outcome | BaseException]] = []

    async def run(self, feeds: list[dict[str, np.ndarray]]) -> BatchResult:
        self.batches.append([float(f["x"][0, 0]) for f in feeds])
        step: asyncio.Future[Outcome | BaseException] = asyncio.get_running_loop().create_future()
        self._pending.append(step)
        outcome = await step
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome(feeds)

    def finish(self, outcome: Outcome | BaseException = doubled) -> None:
        next(s for s in self._pending if not s.done()).set_result(outcome)


def request(value: float) -> InferenceRequest:
    future = asyncio.get_running_loop().create_future()
    return InferenceRequest({"x": np.array([[value]], np.float32)}, 1, future)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


STUCK = ExecutionTimeout("instance a did not finish a batch within execution_timeout_seconds (1 s)")


async def test_a_stuck_instance_is_retired_and_a_fresh_one_takes_its_queue() -> None:
    stuck, fresh = ScriptedInstance("a"), ScriptedInstance("a")
    arrived: asyncio.Future[BatchRunner] = asyncio.get_running_loop().create_future()
    asked: list[BatchRunner] = []

    async def replace(old: BatchRunner) -> BatchRunner:
        asked.append(old)
        return await arrived

    stats = ModelStatistics()
    batcher = Batcher(BatchPolicy(4), QueueSettings(), [stuck], stats, replace=replace)
    first = request(1.0)
    batcher.submit(first)
    await settle()
    stuck.finish(STUCK)
    with pytest.raises(ExecutionTimeout):
        await first.future
    await settle()
    assert asked == [stuck] and stats.instances_abandoned == 1 and stats.instances_in_service == 0
    waiting = request(2.0)
    batcher.submit(waiting)  # queued for the replacement, not refused
    await settle()
    assert batcher.queue_depth == 1 and stuck.batches == [[1.0]]
    arrived.set_result(fresh)
    await settle()
    assert fresh.batches == [[2.0]]
    fresh.finish()
    assert (await waiting.future)["y"].item() == 4.0
    assert stats.instances_replaced == 1 and stats.instances_in_service == 1
    assert stats.failures["engine_error"] == 1 and stuck.batches == [[1.0]]  # never handed another


async def test_with_no_instance_left_and_none_coming_the_queue_is_answered_at_once() -> None:
    stuck = ScriptedInstance("a")
    told: list[str] = []

    async def replace(old: BatchRunner) -> BatchRunner:
        raise Unavailable("the fresh engine did not load: out of device memory")

    stats = ModelStatistics()
    batcher = Batcher(BatchPolicy(1), QueueSettings(), [stuck], stats, replace=replace, on_exhausted=told.append)
    first, queued = request(1.0), request(2.0)
    batcher.submit(first)
    batcher.submit(queued)
    await settle()
    stuck.finish(STUCK)
    with pytest.raises(Unavailable, match="no instance of this model is in service.*did not load"):
        await asyncio.wait_for(queued.future, 5)
    assert len(told) == 1 and "instance a is stuck in the engine and was not replaced" in told[0]
    with pytest.raises(Unavailable):
        batcher.submit(request(3.0))
    assert stats.instances_in_service == 0 and stats.instances_replaced == 0


async def test_the_other_instances_serve_on_while_one_is_replaced() -> None:
    stuck, healthy = ScriptedInstance("a"), ScriptedInstance("b")
    never: asyncio.Future[BatchRunner] = asyncio.get_running_loop().create_future()

    async def replace(old: BatchRunner) -> BatchRunner:
        return await never

    batcher = Batcher(BatchPolicy(1), QueueSettings(), [healthy, stuck], ModelStatistics(), replace=replace)
    batcher.submit(request(1.0))  # the last idle instance goes first: the stuck one
    await settle()
    stuck.finish(STUCK)
    await settle()
    for value in (2.0, 3.0):
        r = request(value)
        batcher.submit(r)
        await settle()
        healthy.finish()
        assert (await r.future)["y"].item() == 2 * value
    assert healthy.batches == [[2.0], [3.0]] and stuck.batches == [[1.0]]
    never.cancel()


async def test_a_working_cap_lowered_by_memory_shapes_later_batches() -> None:
    small = ScriptedInstance("a")
    stats = ModelStatistics()
    batcher = Batcher(BatchPolicy(8), QueueSettings(), [small], stats)
    batcher.submit(request(0.0))
    await settle()
    for value in (1.0, 2.0, 3.0):
        batcher.submit(request(value))

    def ran_out_then_fit(feeds: list[dict[str, np.ndarray]]) -> BatchResult:
        return BatchResult(doubled(feeds).outputs, batch_cap=2, memory_splits=1)

    small.finish(ran_out_then_fit)
    await settle()
    assert small.batches[1] == [1.0, 2.0]  # within the instance's cap of 2, not the policy's 8
    assert stats.instance_batch_caps == {"a": 2} and stats.memory_splits == 1
    assert stats.dispatch_reasons["full"] == 1
    small.finish()
    await settle()
    assert small.batches[2] == [3.0]
    small.finish()


async def test_a_batch_that_failed_in_part_answers_the_rest() -> None:
    worker = ScriptedInstance("a")
    stats = ModelStatistics()
    batcher = Batcher(BatchPolicy(8), QueueSettings(), [worker], stats)
    batcher.submit(request(0.0))
    await settle()
    requests = [request(v) for v in (1.0, 2.0, 3.0)]
    for r in requests:
        batcher.submit(r)
    worker.finish()
    await settle()

    def middle_too_big(feeds: list[dict[str, np.ndarray]]) -> BatchResult:
        outputs = doubled(feeds).outputs
        outputs[1] = {}
        return BatchResult(outputs, failed={1: OutOfMemory("ran out of memory on a single item")})

    worker.finish(middle_too_big)
    assert (await requests[0].future)["y"].item() == 2.0 and (await requests[2].future)["y"].item() == 6.0
    with pytest.raises(OutOfMemory):
        await requests[1].future
    assert stats.success.count == 3 and stats.failures["engine_error"] == 1
    assert stats.inference_count == 1 + 2  # the batch of one, then the two answered


async def test_drain_ends_when_the_only_instance_is_stuck() -> None:
    stuck = ScriptedInstance("a")

    async def replace(old: BatchRunner) -> BatchRunner:
        raise AssertionError("no replacement is started while draining")

    batcher = Batcher(BatchPolicy(1), QueueSettings(), [stuck], ModelStatistics(), replace=replace)
    first, queued = request(1.0), request(2.0)
    batcher.submit(first)
    batcher.submit(queued)
    await settle()
    draining = asyncio.create_task(batcher.drain())
    await settle()
    stuck.finish(STUCK)  # what the watchdog does to a hung run: the drain's bound
    await asyncio.wait_for(draining, 5)
    with pytest.raises(Unavailable):
        await queued.future
    assert first.future.done() and queued.future.done()
