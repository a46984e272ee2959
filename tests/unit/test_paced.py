"""Paced renders (/metrics, the repository index): callers waiting at once share one render that began after each of
them asked, and renders back to back take at most their share of the event loop."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

import server.paced
from server.dataplane import DataPlane
from server.http.app import create_app
from server.paced import PacedRender
from server.repository import IndexEntry, ModelRepository


class Busy:
    """A render that holds the loop `seconds` (as a scrape does) and counts itself."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.renders: list[tuple[float, float]] = []  # (began, ended), perf_counter

    def __call__(self) -> int:
        began = time.perf_counter()
        while time.perf_counter() - began < self.seconds:
            pass
        self.renders.append((began, time.perf_counter()))
        return len(self.renders)


class Clock:
    """The paced module's clock, moved only by the renders (and a microsecond a reading): a
    machine that stalls the test cannot make a caller find the loop free when the test means it
    to wait."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1e-6
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(server.paced, "time", clock)
    return clock


class Rendering:
    """A render that takes `seconds` of the clock, counts itself, and gives its outcomes in turn."""

    def __init__(self, clock: Clock, seconds: float, outcomes: Iterator[int | Exception] | None = None) -> None:
        self.clock = clock
        self.seconds = seconds
        self.outcomes = outcomes
        self.began: list[float] = []

    def __call__(self) -> int:
        self.began.append(self.clock.perf_counter())
        self.clock.now += self.seconds
        outcome = next(self.outcomes) if self.outcomes is not None else len(self.began)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


async def test_a_lone_caller_is_rendered_at_once() -> None:
    busy = Busy(0)
    paced = PacedRender(busy)
    assert await paced() == 1
    assert len(busy.renders) == 1


async def test_callers_waiting_at_once_share_one_render_that_began_after_each_asked(clock: Clock) -> None:
    render = Rendering(clock, 0.005)
    paced = PacedRender(render, loop_share=0.1)
    assert await paced() == 1  # the loop is now owed 45 ms before the next render
    asked: list[float] = []

    async def caller() -> int:
        asked.append(clock.perf_counter())
        return await paced()

    results = await asyncio.gather(*(caller() for _ in range(20)))
    assert results == [2] * 20
    assert max(asked) < render.began[1]  # no caller got figures from before it asked


async def test_renders_back_to_back_take_at_most_their_share_of_the_loop() -> None:
    busy = Busy(0.005)
    paced = PacedRender(busy, loop_share=0.1)
    for _ in range(4):
        await paced()
    for (_, ended), (began, _) in zip(busy.renders, busy.renders[1:]):
        assert began - ended >= 9 * 0.005 * 0.99  # 5 ms of rendering, then 45 ms for everyone else


async def test_a_caller_that_gives_up_does_not_cancel_the_render_others_wait_for(clock: Clock) -> None:
    paced = PacedRender(Rendering(clock, 0.002))
    await paced()
    leaving = asyncio.create_task(paced())
    staying = asyncio.create_task(paced())
    await asyncio.sleep(0)
    leaving.cancel()
    assert await staying == 2
    with pytest.raises(asyncio.CancelledError):
        await leaving


async def test_a_failed_render_reaches_every_caller_and_the_next_one_renders_again(
    clock: Clock, caplog: pytest.LogCaptureFixture,
) -> None:
    failure = RuntimeError("the collector failed")
    paced = PacedRender(Rendering(clock, 0.002, iter([1, failure, failure, 4])))
    assert await paced() == 1
    waiting = [asyncio.create_task(paced()) for _ in range(3)]
    for task in waiting:
        with pytest.raises(RuntimeError, match="the collector failed"):
            await task
    abandoned = asyncio.create_task(paced())  # the render it waits for fails after it left
    await asyncio.sleep(0)
    abandoned.cancel()
    with pytest.raises(asyncio.CancelledError):
        await abandoned
    await asyncio.sleep(0.05)  # that render (due 18 ms after the last) has run, and failed, by now
    del abandoned
    gc.collect()
    assert "never retrieved" not in caplog.text
    assert await paced() == 4


def test_a_share_outside_0_to_1_is_refused() -> None:
    for share in (0, -0.5, 1.5):
        with pytest.raises(ValueError, match="loop_share"):
            PacedRender(lambda: None, loop_share=share)


class CountedCollector(Collector):
    """A collector that costs the loop 20 ms a scrape, and counts the scrapes."""

    def __init__(self) -> None:
        self.collects = 0

    def collect(self) -> list[Metric]:
        self.collects += 1
        time.sleep(0.02)
        gauge = GaugeMetricFamily("batchline_test_collects", "Scrapes rendered.")
        gauge.add_metric([], self.collects)
        return [gauge]


async def test_scrapes_of_the_real_app_at_once_share_renders(tmp_path: Path) -> None:
    """Sixteen clients scraping /metrics together: each gets the metrics, in two renders, not sixteen."""
    registry = CollectorRegistry()
    counted = CountedCollector()
    registry.register(counted)
    app = create_app(DataPlane(ModelRepository(tmp_path)), metrics=registry)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://batchline.test") as client:
        responses = await asyncio.gather(*(client.get("/metrics") for _ in range(16)))
    assert all(r.status_code == 200 and "batchline_test_collects" in r.text for r in responses)
    assert counted.collects <= 3  # the first alone, the rest together (on a slow machine, a third)


class CountedIndex(ModelRepository):
    """A repository whose index counts its reads."""

    reads = 0

    def index(self) -> list[IndexEntry]:
        self.reads += 1
        time.sleep(0.002)  # a folder of thousands of models takes tens of milliseconds
        return super().index()


async def test_index_calls_of_the_real_app_at_once_share_reads(tmp_path: Path) -> None:
    """Sixteen clients asking for the repository index together, over HTTP and gRPC's shared
    data plane: each gets it, from two reads of the folder, not sixteen (one client polling the
    index of 5,000 models held everyone else's inference to ~60 requests a second)."""
    (tmp_path / "double").mkdir()
    (tmp_path / "double" / "config.yaml").write_text("name: double\n")
    repository = CountedIndex(tmp_path)
    app = create_app(DataPlane(repository))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://batchline.test") as client:
        responses = await asyncio.gather(*(client.post("/v2/repository/index", json={}) for _ in range(16)))
    assert all(r.status_code == 200 and r.json() == [{"name": "double", "state": "", "reason": ""}] for r in responses)
    assert repository.reads <= 3  # the first alone, the rest together (on a slow machine, a third)
