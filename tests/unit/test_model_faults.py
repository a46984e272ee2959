"""A served model meeting engine faults, through the repository with a real tiny ONNX model whose
engine hangs, raises or runs out of memory on cue: the watchdog fails the hung batch, a fresh
instance (new engine, warmed up) takes the stuck one's place, statistics and metrics show it,
readiness and liveness follow when none is left, and unload and shutdown never wait forever."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from server.errors import EngineError, ExecutionTimeout, Unavailable, without_tracebacks
from server.metrics import BatchlineCollector, exposition
from server.repository import ModelRepository
from tests.unit.cycles import server_objects_left_in_cycles
from tests.unit.fault_engines import HANG, RAISE, Faults, injected_faults, rows
from tests.unit.onnx_models import DOUBLING_CONFIG, doubling, write_model
from tests.unit.waiting import eventually


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[Faults]:
    yield from injected_faults(monkeypatch)

TIMEOUT_S = 0.3


@pytest.fixture
async def repository(tmp_path: Path, faults: Faults) -> AsyncIterator[ModelRepository]:
    repository = ModelRepository(tmp_path)
    config = {**DOUBLING_CONFIG, "dynamic_batching": {}, "execution_timeout_seconds": TIMEOUT_S}
    write_model(tmp_path, "double", config, doubling)
    await repository.load("double")
    yield repository
    faults.release.set()
    await repository.unload_all()


def metrics(repository: ModelRepository) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(BatchlineCollector(repository, gpus=list))
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model", "version")))): s.value
        for family in text_string_to_metric_families(exposition(registry).decode())
        for s in family.samples
    }


async def test_a_hung_batch_fails_and_a_fresh_instance_serves_on(repository: ModelRepository, faults: Faults) -> None:
    model = repository.get("double")
    with pytest.raises(ExecutionTimeout) as timed_out:
        await asyncio.wait_for(model.start_request({"x": rows(HANG)}), 10)
    assert f"within execution_timeout_seconds ({TIMEOUT_S:g} s)" in timed_out.value.message
    await eventually(lambda: model.stats.instances_replaced == 1, "a fresh instance replaced the stuck one")
    assert (await model.start_request({"x": rows(2.0)}))["y"].tolist() == [[4.0, 4.0]]
    assert model.ready and repository.all_ready() and repository.live()
    assert faults.created == 2  # a new engine, not the stuck one
    assert faults.runs(serial=2)[:2] == [[0.0] * 2, [0.0] * 4]  # warmed up (batches of 1 and 2) before the request
    assert faults.runs(serial=2)[2:] == [[2.0, 2.0]]
    stats = model.stats.as_dict("double", 1)
    assert stats["instances"] == {
        "in_service": 1, "stuck": 1, "timed_out": 1, "replaced": 1, "batch_caps": {"double-1-0": 4},
    }
    scraped = metrics(repository)
    assert scraped[("batchline_instances_in_service", ())] == 1
    assert scraped[("batchline_instances_stuck", ())] == 1
    assert scraped[("batchline_execution_timeouts_total", ())] == 1
    assert scraped[("batchline_instances_replaced_total", ())] == 1
    assert scraped[("batchline_requests_total", (("outcome", "engine_error"),))] == 1
    faults.release.set()  # the stuck run comes back at last: discarded, its engine closed
    await eventually(lambda: model.stats.instances_stuck == 0, "the stuck thread came back")
    assert metrics(repository)[("batchline_instances_stuck", ())] == 0


async def test_a_model_left_without_instances_is_not_ready_and_says_why(
    repository: ModelRepository, faults: Faults
) -> None:
    faults.refuse_load = lambda _: EngineError("no device memory for a new engine")
    model = repository.get("double")
    with pytest.raises(ExecutionTimeout):
        await asyncio.wait_for(model.start_request({"x": rows(HANG)}), 10)
    await eventually(lambda: not model.ready, "the model is not ready")
    [entry] = repository.index()
    assert entry.state == "UNAVAILABLE"
    assert "no instance in service" in entry.reason and "no device memory for a new engine" in entry.reason
    with pytest.raises(Unavailable, match="not ready: no instance in service"):
        repository.get("double")
    assert not repository.all_ready()
    assert not repository.live()  # only a new process frees a thread stuck in an engine
    assert metrics(repository)[("batchline_model_ready", ())] == 0
    faults.release.set()
    await eventually(lambda: model.stats.instances_stuck == 0, "the stuck thread came back")
    assert repository.live()
    faults.refuse_load = lambda _: None
    await repository.load("double")  # a reload brings it back
    assert (await repository.get("double").start_request({"x": rows(1.0)}))["y"].tolist() == [[2.0, 2.0]]


async def test_replacements_stop_when_more_threads_are_stuck_than_instances(
    repository: ModelRepository, faults: Faults
) -> None:
    model = repository.get("double")
    for _ in range(2):
        with pytest.raises(ExecutionTimeout):
            await asyncio.wait_for(model.start_request({"x": rows(HANG)}), 10)
        await eventually(lambda: model.stats.instances_replaced == 1 or not model.ready, "the watchdog acted")
    await eventually(lambda: not model.ready, "no more instances are started")
    assert model.stats.instances_stuck == 2 and model.stats.instances_replaced == 1
    assert "2 instances are stuck in the engine" in model.reason


async def test_an_engine_that_raises_fails_its_request_and_the_instance_serves_on(
    repository: ModelRepository, faults: Faults
) -> None:
    model = repository.get("double")
    with pytest.raises(EngineError, match="the engine failed on purpose"):
        await model.start_request({"x": rows(RAISE)})
    assert (await model.start_request({"x": rows(3.0)}))["y"].tolist() == [[6.0, 6.0]]
    assert model.stats.instances_abandoned == 0 and faults.created == 1


async def test_engine_errors_leave_nothing_in_reference_cycles(repository: ModelRepository, faults: Faults) -> None:
    """A failed run's error held, through its traceback, the frames that held the error (the
    instance thread's, the batch search's, the batcher's), and with them the batch's inputs:
    megabytes a failed batch, alive until a full collection, which the server's tuned
    collector runs rarely. A request alone, and a batch the search cuts to find its bad ones."""
    model = repository.get("double")

    async def failing(count: int) -> None:
        for _ in range(count):
            with pytest.raises(EngineError):
                await model.start_request({"x": rows(RAISE)})
            futures = [model.start_request({"x": rows(v)}) for v in (3.0, RAISE, 4.0, RAISE, 5.0)]
            outcomes = await asyncio.gather(*futures, return_exceptions=True)
            assert [isinstance(o, EngineError) for o in outcomes] == [False, True, False, True, False]

    found = await server_objects_left_in_cycles(failing, 3, 20)
    assert not found, found


def test_an_error_handed_on_loses_the_tracebacks_of_its_causes_and_contexts_too() -> None:
    def raised(error: BaseException) -> BaseException:
        try:
            raise error
        except BaseException as caught:  # noqa: BLE001
            return caught

    outer, cause, context = raised(EngineError("outer")), raised(KeyError("cause")), raised(ValueError("context"))
    outer.__cause__, outer.__context__ = cause, context  # as `raise outer from cause` within `except context`
    assert all(e.__traceback__ is not None for e in (outer, cause, context))
    assert without_tracebacks(outer) is outer
    assert all(e.__traceback__ is None for e in (outer, cause, context))


async def test_running_out_of_memory_splits_the_batch_and_shows_the_lowered_cap(
    repository: ModelRepository, faults: Faults
) -> None:
    faults.max_rows = 1
    model = repository.get("double")
    result = await model.start_request({"x": rows(1.0, 2.0, 3.0, 4.0)})
    assert result["y"].tolist() == [[2.0, 2.0], [4.0, 4.0], [6.0, 6.0], [8.0, 8.0]]
    stats = model.stats.as_dict("double", 1)
    assert stats["instances"]["batch_caps"] == {"double-1-0": 1}  # type: ignore[index]
    assert stats["memory_splits"] == 3  # 4 -> 2 + 2 -> 1 + 1 + 1 + 1
    scraped = metrics(repository)
    assert scraped[("batchline_instance_batch_cap", (("model_instance", "double-1-0"),))] == 1
    assert scraped[("batchline_memory_splits_total", ())] == 3
    assert scraped[("batchline_requests_total", (("outcome", "success"),))] == 1


async def test_unload_and_shutdown_do_not_wait_forever_on_a_hung_batch(
    repository: ModelRepository, faults: Faults
) -> None:
    hung = repository.get("double").start_request({"x": rows(HANG)})
    await asyncio.wait_for(asyncio.to_thread(faults.held.wait, 10), 15)
    await asyncio.wait_for(repository.unload_all(), 10)  # bounded by the watchdog, not the engine
    with pytest.raises(ExecutionTimeout):
        await hung
    assert faults.held.is_set() and not faults.release.is_set()  # the engine is still hung
