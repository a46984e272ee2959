"""Reloading a model that serves: the new versions load and warm up beside the old ones and take
over only when all are ready; a reload that fails in any way (config, build gate, artifact,
warm-up, memory) leaves the old version serving and says why, as Triton does."""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import server.repository
from server.errors import EngineError, InvalidInput, Unavailable
from server.model import ModelState
from server.repository import ModelRepository
from server.scheduler.admission import Admission, Admitted
from tests.unit.fault_engines import HANG, Faults, injected_faults, rows
from tests.unit.onnx_models import DOUBLING_CONFIG, doubling, write_model
from tests.unit.waiting import eventually


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[Faults]:
    yield from injected_faults(monkeypatch)


@pytest.fixture
async def repository(tmp_path: Path) -> AsyncIterator[ModelRepository]:
    repository = ModelRepository(tmp_path)
    write_model(tmp_path, "double", {**DOUBLING_CONFIG, "dynamic_batching": {}}, doubling)
    await repository.load("double")
    yield repository
    await repository.unload_all()


def index(repository: ModelRepository) -> list[tuple[str, str, str]]:
    return [(e.version, e.state, e.reason) for e in repository.index() if e.name == "double"]


async def assert_version_1_serves(repository: ModelRepository) -> None:
    model = repository.get("double")
    assert model.version == 1 and model.ready
    assert (await model.start_request({"x": rows(1.5)}))["y"].tolist() == [[3.0, 3.0]]
    assert index(repository) == [("1", "READY", "")]
    assert repository.all_ready()


async def test_a_new_version_with_a_bad_artifact_leaves_the_old_one_serving(repository: ModelRepository) -> None:
    version_2 = repository.root / "double" / "2"
    version_2.mkdir()
    (version_2 / "model.onnx").write_bytes(b"not an onnx model")
    changes = repository.changes
    with pytest.raises(Unavailable) as failed:
        await repository.load("double")
    await assert_version_1_serves(repository)
    assert "version 2: ONNX Runtime cannot load" in failed.value.message
    assert failed.value.message.endswith("(version 1 serves on)")
    assert repository.changes > changes, "a load that built something leaves the heap something to settle"


async def test_a_new_version_whose_warm_up_fails_leaves_the_old_one_serving(
    repository: ModelRepository, faults: Faults
) -> None:
    doubling(repository.root / "double" / "2")
    config = yaml.safe_load((repository.root / "double" / "config.yaml").read_text())
    config["warmup"] = {"inputs": {"x": 13.0}}  # RAISE: every warm-up of the new load fails
    (repository.root / "double" / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(Unavailable) as failed:
        await repository.load("double")
    await assert_version_1_serves(repository)
    assert "version 2: warm-up at batch size 1 failed: the engine failed on purpose" in failed.value.message


async def test_a_new_version_that_runs_out_of_memory_loading_leaves_the_old_one_serving(
    repository: ModelRepository, faults: Faults
) -> None:
    doubling(repository.root / "double" / "2")
    faults.refuse_load = lambda folder: MemoryError("no room for the new engine") if folder.name == "2" else None
    with pytest.raises(Unavailable) as failed:
        await repository.load("double")
    await assert_version_1_serves(repository)
    assert "version 2: MemoryError: no room for the new engine" in failed.value.message


async def test_a_broken_config_on_reload_leaves_the_old_version_serving(repository: ModelRepository) -> None:
    (repository.root / "double" / "config.yaml").write_text("name: double\nengine: onnxruntime\nmax_batch_size: many\n")
    changes = repository.changes
    with pytest.raises(InvalidInput) as failed:
        await repository.load("double")
    assert repository.changes == changes, "refused before anything was built"
    await assert_version_1_serves(repository)
    changes = repository.changes
    await repository.unload("double")
    assert repository.changes > changes
    assert "max_batch_size" in failed.value.message and "version 1 serves on" in failed.value.message


async def test_a_build_that_fails_its_quality_gate_leaves_the_old_version_serving(
    repository: ModelRepository, monkeypatch: pytest.MonkeyPatch
) -> None:
    def gate_fails(*_: object) -> None:
        raise EngineError("double: the onnxruntime int8 build failed its quality gate (accuracy 0.5 < 0.99)")

    monkeypatch.setattr(server.repository, "ensure_built", gate_fails)
    config = yaml.safe_load((repository.root / "double" / "config.yaml").read_text())
    config["build"] = {"source": "elsewhere", "engine": "onnxruntime", "precision": "int8"}
    (repository.root / "double" / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(Unavailable) as failed:
        await repository.load("double")
    await assert_version_1_serves(repository)
    assert "failed its quality gate" in failed.value.message and "version 1 serves on" in failed.value.message


async def test_a_first_load_that_fails_still_shows_the_reason(tmp_path: Path) -> None:
    repository = ModelRepository(tmp_path)
    (tmp_path / "double" / "1").mkdir(parents=True)
    (tmp_path / "double" / "config.yaml").write_text(yaml.safe_dump({"name": "double", **DOUBLING_CONFIG}))
    with pytest.raises(Unavailable, match="missing"):
        await repository.load("double")
    [(_, state, reason)] = index(repository)
    assert state == "UNAVAILABLE" and "missing" in reason and not repository.all_ready()
    await repository.unload_all()


async def test_a_reload_under_load_fails_nothing_and_the_new_version_warms_up_first(
    repository: ModelRepository, faults: Faults
) -> None:
    """Clients keep calling while version 2 loads: every call is answered, by version 1 until the
    swap and by version 2 after; version 2's engine ran its warm-up before any request."""
    doubling(repository.root / "double" / "2")
    old = repository.get("double")
    answered: list[int] = []
    stop = asyncio.Event()

    async def client(value: float) -> None:
        while not stop.is_set():
            model = repository.get("double")
            outputs = await model.start_request({"x": rows(value)})
            assert outputs["y"].tolist() == [[2 * value, 2 * value]]
            answered.append(model.version)

    clients = [asyncio.create_task(client(float(i + 1))) for i in range(4)]
    await eventually(lambda: len(answered) >= 20, "version 1 answered some requests")
    await repository.load("double")
    seen = len(answered)
    await eventually(lambda: len(answered) >= seen + 20, "version 2 answered some requests")
    stop.set()
    await asyncio.gather(*clients)  # a failed request would raise here
    assert answered[-1] == 2 and answered.index(2) >= 20
    assert set(answered) == {1, 2}
    assert old.state.value == "UNAVAILABLE" and old.reason == "unloaded"
    version_2_runs = faults.runs(version="2")
    assert version_2_runs[:2] == [[0.0] * 2, [0.0] * 4]  # the warm-up (zeros, batches of 1 and 2) came first
    assert all(any(v) for v in version_2_runs[2:])


def held_in_admission(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """A request of x = 5.0 has its admission on a worker thread, as a big text's, held there
    until the second event is set; the first says it is there."""
    entered, proceed = threading.Event(), threading.Event()
    real_admission = Admission.admit_or_offload

    def slow_admission(self: Admission, inputs: dict, *args: Any) -> Any:  # type: ignore[type-arg]
        admitted = real_admission(self, inputs, *args)
        if float(inputs["x"][1][0][0]) != 5.0:
            return admitted

        def on_a_worker_thread() -> Admitted:
            entered.set()
            proceed.wait(10)
            return admitted if isinstance(admitted, Admitted) else admitted()

        return on_a_worker_thread

    monkeypatch.setattr(Admission, "admit_or_offload", slow_admission)
    return entered, proceed


async def test_a_request_in_admission_when_the_swap_comes_is_still_answered(
    repository: ModelRepository, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that took the old version and is still in admission (a big text being tokenized)
    when the new version takes over reaches the old one's queue and is answered; the drain
    waits for it."""
    doubling(repository.root / "double" / "2")
    entered, proceed = held_in_admission(monkeypatch)
    old = repository.get("double")
    slow = old.start_request({"x": rows(5.0)})
    await eventually(entered.is_set, "the request is in admission")
    reload = asyncio.create_task(repository.load("double"))
    await eventually(lambda: repository.get("double") is not old, "the new version took over")
    finished_first = reload.done()
    proceed.set()
    assert (await asyncio.wait_for(slow, 5))["y"].tolist() == [[10.0, 10.0]]
    await asyncio.wait_for(reload, 5)
    assert not finished_first  # the old version's drain waited for the request in admission
    assert repository.get("double").version == 2


async def test_admission_work_handed_back_runs_on_a_worker_thread(
    repository: ModelRepository, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What admission hands back to run off the event loop (a big text's decoding and
    tokenizing) runs on a worker thread, and the request is then queued and answered."""
    loop_thread = threading.current_thread().name
    threads: list[str] = []
    real_admission = Admission.admit_or_offload

    def handed_back(self: Admission, *args: Any) -> Any:
        admitted = real_admission(self, *args)

        def work() -> Admitted:
            threads.append(threading.current_thread().name)
            return admitted if isinstance(admitted, Admitted) else admitted()

        return work

    monkeypatch.setattr(Admission, "admit_or_offload", handed_back)
    assert (await repository.get("double").start_request({"x": rows(2.0)}))["y"].tolist() == [[4.0, 4.0]]
    assert len(threads) == 1 and threads[0] != loop_thread


async def test_a_request_cancelled_before_its_admission_starts_holds_up_no_unload(
    repository: ModelRepository, monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    """A request whose admission goes off the loop (a big text) and is cancelled in the same loop
    turn, before its task first runs: the unload it was counted for still goes through, nothing
    is left pending, and no coroutine is left never awaited."""
    real_admission = Admission.admit_or_offload

    def off_the_loop(self: Admission, *args: Any) -> Any:
        admitted = real_admission(self, *args)
        return admitted if callable(admitted) else (lambda: admitted)

    monkeypatch.setattr(Admission, "admit_or_offload", off_the_loop)
    model = repository.get("double")
    future = model.start_request({"x": rows(5.0)})
    assert model.pending_requests == 1
    future.cancel()
    await asyncio.wait_for(model.unload(), 5)
    assert model.pending_requests == 0
    gc.collect()
    assert not [w for w in recwarn if "never awaited" in str(w.message)]


async def test_a_request_given_up_in_admission_is_never_queued_and_its_admission_ends_first(
    repository: ModelRepository, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its admission on a worker thread reads its inputs to the end (nothing withdraws it
    meanwhile); its caller gone, it is then not queued nor run, and an unload waits for it."""
    entered, proceed = held_in_admission(monkeypatch)
    model = repository.get("double")
    future = model.start_request({"x": rows(5.0)})
    await eventually(entered.is_set, "the request is in admission")
    assert not model.withdraw(future) and not future.done()
    future.cancel()
    unload = asyncio.create_task(model.unload())
    await asyncio.sleep(0.05)
    assert not unload.done() and model.pending_requests == 1  # its admission still reads the inputs
    proceed.set()
    await asyncio.wait_for(unload, 5)
    assert model.pending_requests == 0 and model.stats.success.count == 0
    assert not model.stats.failures  # never queued: neither served nor dropped from the queue


async def test_a_reload_whose_caller_gives_up_runs_to_its_end(tmp_path: Path, faults: Faults) -> None:
    """A load's client that stops waiting (a gRPC deadline) stops nothing: the request the old
    version computes is answered, and the old version drains and frees its engines."""
    repository = ModelRepository(tmp_path)
    write_model(tmp_path, "double", {**DOUBLING_CONFIG, "dynamic_batching": {}}, doubling)
    await repository.load("double")
    old = repository.get("double")
    engines = [i.pipeline.engine for i in old.instances]
    computing = old.start_request({"x": rows(HANG)})
    await eventually(faults.held.is_set, "the request computes")
    reload = asyncio.create_task(repository.load("double"))
    await eventually(lambda: old.state is ModelState.UNLOADING, "the old version drains")
    reload.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reload
    faults.release.set()
    assert (await asyncio.wait_for(computing, 5))["y"].tolist() == [[2 * HANG, 2 * HANG]]
    await eventually(lambda: all(e.closed.is_set() for e in engines), "the old version's engines are freed")
    assert repository.get("double") is not old
    await repository.unload_all()


async def test_a_load_whose_caller_gives_up_while_it_builds_is_kept(tmp_path: Path, faults: Faults) -> None:
    """Cancelled while its engine builds: the version built is served, not left unowned."""
    repository = ModelRepository(tmp_path)
    write_model(tmp_path, "double", {**DOUBLING_CONFIG, "dynamic_batching": {}}, doubling)
    faults.builds_held = True
    load = asyncio.create_task(repository.load("double"))
    await eventually(faults.building.is_set, "an engine is being built")
    load.cancel()
    with pytest.raises(asyncio.CancelledError):
        await load
    faults.release.set()
    await eventually(lambda: bool(repository.loaded()), "the load ends")
    assert (await repository.get("double").start_request({"x": rows(1.0)}))["y"].tolist() == [[2.0, 2.0]]
    await repository.unload_all()


async def test_unloading_everything_waits_for_the_loads_in_progress(tmp_path: Path, faults: Faults) -> None:
    """A stop during startup's loads: they run to their end, then are unloaded with the rest, so
    no version comes up after the server said its models were unloaded."""
    repository = ModelRepository(tmp_path)
    write_model(tmp_path, "double", {**DOUBLING_CONFIG, "dynamic_batching": {}}, doubling)
    faults.builds_held = True
    startup = asyncio.create_task(repository.load_all())
    await eventually(faults.building.is_set, "an engine is being built")
    startup.cancel()
    unloading = asyncio.create_task(repository.unload_all())
    await asyncio.sleep(0.05)
    assert not unloading.done()  # it waits for the load held in its build
    faults.release.set()
    await asyncio.wait_for(unloading, 10)
    await asyncio.sleep(0.5)  # time for a load left running to end (it took about 0.1 s here)
    assert repository.loaded() == []
    assert not [t for t in threading.enumerate() if t.name.startswith("double-1-")]  # its instance closed


async def test_a_reload_keeps_the_old_version_when_one_of_several_new_ones_fails(tmp_path: Path) -> None:
    """All or nothing: a policy serving two versions swaps both or neither."""
    repository = ModelRepository(tmp_path)
    config = {**DOUBLING_CONFIG, "version_policy": {"latest": {"num_versions": 2}}}
    write_model(tmp_path, "double", config, doubling)
    doubling(tmp_path / "double" / "2")
    await repository.load("double")
    doubling(tmp_path / "double" / "3")
    (tmp_path / "double" / "2" / "model.onnx").write_bytes(b"broken since")
    with pytest.raises(Unavailable) as failed:
        await repository.load("double")
    assert [(v, s) for v, s, _ in index(repository)] == [("1", "READY"), ("2", "READY")]
    assert (await repository.get("double", "2").start_request({"x": rows(1.0)}))["y"].tolist() == [[2.0, 2.0]]
    assert "version 2: ONNX Runtime cannot load" in failed.value.message
    assert failed.value.message.endswith("(versions 1, 2 serve on)")
    await repository.unload_all()



async def test_a_first_load_where_one_version_fails_serves_the_others_and_says_which_failed(tmp_path: Path) -> None:
    """With nothing serving yet, the versions that loaded serve (a server starting with one bad
    version of three still serves that model); the call answers the failure, never 200."""
    repository = ModelRepository(tmp_path)
    write_model(tmp_path, "double", {**DOUBLING_CONFIG, "version_policy": {"all": {}}}, doubling)
    doubling(tmp_path / "double" / "2")
    doubling(tmp_path / "double" / "3")
    (tmp_path / "double" / "2" / "model.onnx").write_bytes(b"broken")
    with pytest.raises(Unavailable) as failed:
        await repository.load("double")
    assert "version 2: ONNX Runtime cannot load" in failed.value.message
    assert failed.value.message.endswith("(versions 1, 3 serve)")
    assert [(v, s) for v, s, _ in index(repository)] == [("1", "READY"), ("2", "UNAVAILABLE"), ("3", "READY")]
    assert (await repository.get("double").start_request({"x": rows(1.0)}))["y"].tolist() == [[2.0, 2.0]]
    await repository.unload_all()


async def test_a_model_loading_with_nothing_serving_shows_loading_in_the_index(tmp_path: Path, faults: Faults) -> None:
    """As Triton's index shows it; not UNAVAILABLE "unloaded", nor nothing, while it warms up."""
    repository = ModelRepository(tmp_path)
    write_model(tmp_path, "double", {**DOUBLING_CONFIG, "warmup": {"inputs": {"x": HANG}}}, doubling)
    load = asyncio.create_task(repository.load("double"))
    await eventually(faults.held.is_set, "the warm-up runs")
    assert index(repository) == [("", "LOADING", "")]
    faults.release.set()
    await asyncio.wait_for(load, 10)
    assert index(repository) == [("1", "READY", "")]
    await repository.unload_all()
