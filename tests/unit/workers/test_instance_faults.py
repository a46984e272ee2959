"""An instance meeting engine faults: the watchdog abandons a hung run, an error fails only its
batch, and running out of memory halves the batch and lowers the instance's working cap. The
engine is a numpy doubler whose faults are chosen by the batch's x values (tests/unit/fault_engines)."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Iterator

import numpy as np
import pytest

from server.config import ModelConfig
from server.devices import Device
from server.engines.base import Engine, EngineDescription
from server.engines.signature import EngineSignature
from server.errors import EngineError, ExecutionTimeout, OutOfMemory, Unavailable
from server.workers.faults import is_out_of_memory
from server.workers.instance import ModelInstance
from server.workers.pipeline import ModelPipeline
from tests.unit.fault_engines import HANG, OOM, RAISE, Faults, FaultyEngine
from tests.unit.waiting import eventually

CONFIG = ModelConfig.model_validate({
    "name": "double", "engine": "onnxruntime", "max_batch_size": 8,
    "inputs": [{"name": "x", "datatype": "FP32", "dims": [1]}],
    "outputs": [{"name": "y", "datatype": "FP32", "dims": [1]}],
})


class Doubler(Engine):
    def __init__(self) -> None:
        pass

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": inputs["x"] * 2}

    def describe(self) -> EngineDescription:
        return EngineDescription("fake", "cpu", "fp32")

    def signature(self) -> EngineSignature:
        return EngineSignature(inputs=(), outputs=())


@pytest.fixture
def faults() -> Iterator[Faults]:
    shared = Faults()
    yield shared
    shared.release.set()


def instance(faults: Faults, timeout_s: float = 0) -> ModelInstance:
    engine = FaultyEngine(Doubler(), faults, "1", 1)
    return ModelInstance(ModelPipeline(CONFIG, engine, {}), Device("CPU"), "double-1-0", timeout_s=timeout_s)


def feed(*values: float) -> dict[str, np.ndarray]:
    return {"x": np.array(values, np.float32).reshape(-1, 1)}


def doubled(outputs: dict[str, np.ndarray]) -> list[float]:
    return outputs["y"].ravel().tolist()


async def test_the_watchdog_fails_a_hung_run_and_abandons_the_instance(faults: Faults) -> None:
    hung = instance(faults, timeout_s=0.2)
    with pytest.raises(ExecutionTimeout, match=r"double-1-0 did not finish a batch within execution_timeout_seconds \(0.2 s\)"):
        await asyncio.wait_for(hung.run([feed(HANG)]), 10)
    assert hung.abandoned and hung.stuck
    with pytest.raises(Unavailable):  # never handed another batch
        await hung.run([feed(1.0)])
    came_back = asyncio.Event()
    hung.on_return(came_back.set)
    hung.close()  # does not wait for the stuck thread
    assert not came_back.is_set()
    faults.release.set()
    await asyncio.wait_for(came_back.wait(), 10)
    await eventually(lambda: not hung.stuck, "the thread closed its engine and ended")
    assert hung.pipeline.engine.closed.is_set()  # type: ignore[attr-defined]


async def test_without_a_watchdog_a_slow_run_is_waited_for(faults: Faults) -> None:
    patient = instance(faults, timeout_s=0)
    running = asyncio.create_task(patient.run([feed(HANG)]))
    await asyncio.wait_for(asyncio.to_thread(faults.held.wait, 10), 15)
    assert not running.done()
    faults.release.set()
    assert doubled((await asyncio.wait_for(running, 10)).outputs[0]) == [2 * HANG]
    assert not patient.abandoned
    patient.close()


async def test_an_engine_that_raises_fails_its_batch_and_the_instance_serves_on(faults: Faults) -> None:
    worker = instance(faults, timeout_s=5)
    with pytest.raises(EngineError, match="the engine failed on purpose"):
        await worker.run([feed(1.0, RAISE)])
    assert not worker.abandoned
    assert doubled((await worker.run([feed(3.0)])).outputs[0]) == [6.0]
    worker.close()


async def test_running_out_of_memory_halves_the_batch_and_lowers_the_cap(faults: Faults) -> None:
    worker = instance(faults)
    faults.max_rows = 2
    result = await worker.run([feed(1.0), feed(2.0), feed(3.0), feed(4.0)])
    assert [doubled(o) for o in result.outputs] == [[2.0], [4.0], [6.0], [8.0]]
    assert not result.failed and result.memory_splits == 1 and result.batch_cap == worker.batch_cap == 2
    assert faults.runs() == [[1.0, 2.0, 3.0, 4.0], [1.0, 2.0], [3.0, 4.0]]
    # later batches are cut to the cap before they run: no more memory errors
    result = await worker.run([feed(5.0), feed(6.0, 7.5)])
    assert [doubled(o) for o in result.outputs] == [[10.0], [12.0, 15.0]]
    assert result.memory_splits == 0 and faults.runs()[3:] == [[5.0], [6.0, 7.5]]  # requests kept whole
    worker.close()


async def test_one_request_too_big_for_memory_is_cut_between_its_rows(faults: Faults) -> None:
    worker = instance(faults)
    faults.max_rows = 1
    result = await worker.run([feed(1.0, 2.0, 3.0, 4.0, 5.0)])
    assert doubled(result.outputs[0]) == [2.0, 4.0, 6.0, 8.0, 10.0]
    assert not result.failed and worker.batch_cap == 1
    worker.close()


async def test_a_single_item_that_still_runs_out_of_memory_fails_alone(faults: Faults) -> None:
    """...and does not shrink the cap: the batch sizes that failed only held that item."""
    worker = instance(faults)
    result = await worker.run([feed(1.0), feed(OOM), feed(3.0)])
    assert list(result.failed) == [1] and isinstance(result.failed[1], OutOfMemory)
    assert "ran out of memory on a single item" in result.failed[1].message
    assert doubled(result.outputs[0]) == [2.0] and doubled(result.outputs[2]) == [6.0]
    assert result.memory_splits == 2 and worker.batch_cap is None
    worker.close()


async def test_a_true_limit_still_lowers_the_cap_beside_an_item_too_big(faults: Faults) -> None:
    worker = instance(faults)
    faults.max_rows = 2
    result = await worker.run([feed(float(v)) for v in (1, 2, 3, OOM, 5, 6, 7.5, 8)])
    assert list(result.failed) == [3]
    assert [doubled(o) for i, o in enumerate(result.outputs) if i != 3] == [[2.0], [4.0], [6.0], [10.0], [12.0], [15.0], [16.0]]
    assert worker.batch_cap == 2  # [5, 6, 7.5, 8] ran out of memory without the big item
    worker.close()


async def test_an_error_other_than_memory_after_a_split_fails_only_its_request(faults: Faults) -> None:
    worker = instance(faults)
    faults.max_rows = 2
    result = await worker.run([feed(1.0), feed(2.0), feed(RAISE), feed(4.0)])
    assert list(result.failed) == [2] and isinstance(result.failed[2], EngineError)
    assert [doubled(o) for i, o in enumerate(result.outputs) if i != 2] == [[2.0], [4.0], [8.0]]
    worker.close()


async def test_a_request_the_engine_cannot_take_fails_alone_and_the_others_are_answered(faults: Faults) -> None:
    """A batch that fails for one request's values runs its halves again, and the halves of the
    half that fails: only that request fails."""
    worker = instance(faults)
    result = await worker.run([feed(1.0, 2.0), feed(RAISE), feed(3.0)])
    assert list(result.failed) == [1] and "the engine failed on purpose" in result.failed[1].message
    assert doubled(result.outputs[0]) == [2.0, 4.0] and doubled(result.outputs[2]) == [6.0]
    assert faults.runs() == [[1.0, 2.0, RAISE, 3.0], [1.0, 2.0], [RAISE, 3.0], [RAISE], [3.0]]
    worker.close()


async def test_the_request_at_fault_is_found_among_requests_of_uneven_rows(faults: Faults) -> None:
    """Halves of requests, not of rows: halving rows 1, 1, 2, 4 and 8 takes as many steps as
    there are rows to halve, and used to spend the search before it found the one."""
    worker = instance(faults)
    result = await worker.run([feed(RAISE), feed(1.0), feed(2.0, 2.0), feed(*[3.0] * 4), feed(*[4.0] * 8)])
    assert list(result.failed) == [0]
    assert [doubled(o) for o in result.outputs[1:]] == [[2.0], [4.0, 4.0], [6.0] * 4, [8.0] * 8]
    worker.close()


async def test_several_requests_the_engine_cannot_take_each_fail_alone(faults: Faults) -> None:
    """Four of eight, scattered: each fails alone with the engine's words, every good request is
    answered."""
    worker = instance(faults)
    values = [RAISE, 1.0, 2.0, RAISE, 4.0, RAISE, RAISE, 8.0]
    result = await worker.run([feed(v) for v in values])
    assert sorted(result.failed) == [0, 3, 5, 6]
    assert all("the engine failed on purpose" in result.failed[i].message for i in result.failed)
    assert {i: doubled(o) for i, o in enumerate(result.outputs) if i not in result.failed} == {
        1: [2.0], 2: [4.0], 4: [8.0], 7: [16.0]}
    worker.close()


async def test_requests_the_engine_cannot_take_at_the_head_of_a_batch_fail_alone(faults: Faults) -> None:
    """Four in a row at the head of eight: the search used to count every failed run in a row,
    found three, and failed the four good requests with the last bad one's error (which may
    quote its values). Each request found at fault starts the search again."""
    worker = instance(faults)
    result = await worker.run([feed(RAISE) for _ in range(4)] + [feed(v) for v in (1.0, 2.0, 3.0, 4.0)])
    assert sorted(result.failed) == [0, 1, 2, 3]
    assert [doubled(o) for o in result.outputs[4:]] == [[2.0], [4.0], [6.0], [8.0]]
    worker.close()


async def test_a_burst_of_bad_requests_past_the_bound_leaves_the_rest_answered(faults: Faults) -> None:
    """Six at the head of eight reach the bound (log2(8) + 3 = 6 found at fault in a row): the
    rest runs once as one, and is answered."""
    worker = instance(faults)
    result = await worker.run([feed(RAISE) for _ in range(6)] + [feed(1.0), feed(2.0)])
    assert sorted(result.failed) == list(range(6))
    assert [doubled(o) for o in result.outputs[6:]] == [[2.0], [4.0]]
    assert [len(run) for run in faults.runs()] == [8, 4, 2, 1, 1, 2, 1, 1, 4, 2, 1, 1, 2]
    worker.close()


@pytest.mark.parametrize("rest", [[RAISE, RAISE], [RAISE, 1.0]])
async def test_an_engine_that_fails_everything_costs_a_batch_a_few_runs_not_one_a_request(
    faults: Faults, rest: list[float],
) -> None:
    """Once log2(N) + 3 requests (8 requests: 6) failed alone with no run between that
    succeeded, and the rest failed together too, the rest fails unrun alone: Unavailable
    (retry), not another request's error."""
    worker = instance(faults)
    result = await worker.run([feed(RAISE) for _ in range(6)] + [feed(v) for v in rest])
    assert sorted(result.failed) == list(range(8))
    assert [len(run) for run in faults.runs()] == [8, 4, 2, 1, 1, 2, 1, 1, 4, 2, 1, 1, 2]
    assert all(isinstance(result.failed[i], EngineError) for i in range(6))
    for unrun in (6, 7):
        error = result.failed[unrun]
        assert isinstance(error, Unavailable) and "the engine failed on purpose" not in error.message, error
    worker.close()


def test_out_of_memory_is_told_from_other_errors() -> None:
    def wrapped(cause: BaseException) -> EngineError:
        try:
            raise EngineError(f"engine failed: {cause}") from cause
        except EngineError as exc:
            return exc

    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(wrapped(RuntimeError("BFCArena::AllocateRawInternal Failed to allocate memory for requested buffer")))
    assert is_out_of_memory(wrapped(RuntimeError("CUDA failure 2: out of memory ; GPU=0")))
    assert is_out_of_memory(RuntimeError("CUBLAS failure 3: CUBLAS_STATUS_ALLOC_FAILED"))
    assert is_out_of_memory(RuntimeError("[TRT] Error Code 2: OutOfMemory (no memory for the workspace)"))
    assert not is_out_of_memory(wrapped(RuntimeError("not enough space: expected 318080, got 314240")))
    assert not is_out_of_memory(EngineError("the engine failed on purpose"))


def test_torch_cuda_out_of_memory_is_known_by_its_type() -> None:
    torch = pytest.importorskip("torch")
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("tried to allocate 2.00 GiB"))


async def test_an_idle_instance_holds_nothing_of_its_last_batch(faults: Faults) -> None:
    """Inputs may be large, or views of a front end's shared memory that would stay mapped."""
    worker = instance(faults)
    inputs = feed(1.0, 2.0)
    held = weakref.ref(inputs["x"])
    result = await worker.run([inputs])
    assert doubled(result.outputs[0]) == [2.0, 4.0]
    del inputs, result
    await eventually(lambda: held() is None, "the batch's inputs are freed once it is answered")
    worker.close()
