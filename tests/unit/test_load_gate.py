"""Models load side by side; a batch profile times alone, nothing waits forever, and loads
leave the threads requests offload their work to."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

import server.model
from server import load_gate
from server.load_gate import LoadGate
from server.repository import ModelRepository
from tests.unit.onnx_models import DOUBLING_CONFIG, doubling, write_model
from tests.unit.waiting import eventually


class Holder:
    """A thread inside one of the gate's sections until released: `inside` says it got in."""

    def __init__(self, section: AbstractContextManager[None]) -> None:
        self.inside, self._release = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._hold, args=(section,), daemon=True)
        self._thread.start()

    def _hold(self, section: AbstractContextManager[None]) -> None:
        with section:
            self.inside.set()
            self._release.wait(10)

    def release(self) -> None:
        self._release.set()
        self._thread.join(10)


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    made: list[Holder] = []
    yield made
    for holder in made:
        holder.release()


def hold(holders: list[Holder], section: AbstractContextManager[None]) -> Holder:
    holders.append(Holder(section))
    return holders[-1]


KEPT_OUT = 0.2  # seconds a thread the gate should keep out is given to get in anyway


def waiting(gate: LoadGate, threads: int = 1) -> None:
    """Until `threads` threads wait at the gate."""
    deadline = time.monotonic() + 5
    while len(gate._changed._waiters) < threads:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "nobody came to wait at the gate"
        time.sleep(0.005)


def test_a_profile_waits_for_every_build_in_progress(holders: list[Holder]) -> None:
    gate = LoadGate(wait_s=30)
    first = hold(holders, gate.building("a"))
    assert first.inside.wait(5)
    profile = hold(holders, gate.alone("m/1"))
    waiting(gate)
    second = hold(holders, gate.building("b"))  # a profile waits, none runs: builds go on beside each other
    assert second.inside.wait(5)
    first.release()
    assert not profile.inside.wait(KEPT_OUT), "b is still building"
    second.release()
    assert profile.inside.wait(5)


def test_a_build_waits_while_a_profile_runs_but_a_replacement_does_not(holders: list[Holder]) -> None:
    gate = LoadGate(wait_s=30)
    profile = hold(holders, gate.alone("m/1"))
    assert profile.inside.wait(5)
    build = hold(holders, gate.building("b"))
    replacement = hold(holders, gate.building("stuck", wait=False))
    assert replacement.inside.wait(5), "a model short of an instance gets it back at once"
    assert not build.inside.wait(KEPT_OUT)
    profile.release()
    assert build.inside.wait(5)


def test_two_profiles_take_turns(holders: list[Holder]) -> None:
    gate = LoadGate(wait_s=30)
    first = hold(holders, gate.alone("m/1"))
    assert first.inside.wait(5)
    second = hold(holders, gate.alone("n/1"))
    assert not second.inside.wait(KEPT_OUT)
    first.release()
    assert second.inside.wait(5)


@pytest.mark.parametrize(("stuck", "waiter", "warning"), [
    ("building", "alone", "m/1 waited 0 s for other models to load and times its batch ladder beside them"),
    ("alone", "building", "instance b waited 0 s for another model's batch profile"),
])
def test_a_load_or_profile_that_never_ends_keeps_nothing_waiting_forever(
    holders: list[Holder], caplog: pytest.LogCaptureFixture, stuck: str, waiter: str, warning: str
) -> None:
    gate = LoadGate(wait_s=0.2)
    sections = {"building": lambda: gate.building("instance b"), "alone": lambda: gate.alone("m/1")}
    assert hold(holders, sections[stuck]()).inside.wait(5)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING), sections[waiter]():
        waited = time.monotonic() - started
    assert 0.2 <= waited < 5
    assert warning in caplog.text


async def test_a_load_leaves_the_threads_requests_offload_their_work_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model being built (for minutes, say) holds a load thread, not one of the event loop's
    default executor, where requests offload their parsing: with that executor down to one
    thread, work offloaded while a model builds still runs at once."""
    asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=1))
    building, release = threading.Event(), threading.Event()
    real = server.model.create_engine

    def slow_build(config: Any, version_dir: Path, device: Any) -> Any:
        building.set()
        release.wait(10)
        return real(config, version_dir, device)

    monkeypatch.setattr(server.model, "create_engine", slow_build)
    write_model(tmp_path, "double", DOUBLING_CONFIG, doubling)
    repository = ModelRepository(tmp_path)
    load = asyncio.create_task(repository.load("double"))
    try:
        await eventually(building.is_set, "the model is being built")
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "ran"), 5) == "ran"
    finally:
        release.set()
        await load
    assert repository.get("double").ready, "the load itself went through"
    await repository.unload_all()


async def test_an_unload_never_waits_for_a_load_thread(tmp_path: Path) -> None:
    """Every load thread held by loads waiting their turn (eight versions, each waiting for the
    others' profiles): an unrelated model's unload waited 14 s for one to close its instances."""
    write_model(tmp_path, "double", DOUBLING_CONFIG, doubling)
    repository = ModelRepository(tmp_path)
    await repository.load("double")
    held = threading.Event()
    loop = asyncio.get_running_loop()
    waiting = [loop.run_in_executor(load_gate._LOAD_THREADS, held.wait, 30)
               for _ in range(load_gate._LOAD_THREADS._max_workers)]
    try:
        await asyncio.wait_for(repository.unload("double"), 10)
        assert repository.loaded() == []
    finally:
        held.set()
        await asyncio.gather(*waiting)
