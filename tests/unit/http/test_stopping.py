"""A stop (SIGTERM) as the Server runs it: readiness false and new inference refused at once,
what is already queued or running answered, every front end drained, then the models unloaded."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from server.dataplane import DataPlane
from server.http.app import create_app
from server.model import ModelState
from server.server import Server, StartFailed
from tests.unit.http.conftest import HOLD, Gate, infer_body
from tests.unit.waiting import eventually


class RecordingFrontEnd:
    """A front end that records what the Server asks of it."""

    def __init__(self, name: str, fail: bool = False) -> None:
        self.name = name
        self.fail = fail
        self.calls: list[str] = []

    async def start(self) -> None:
        self.calls.append("start")
        if self.fail:
            raise StartFailed(f"{self.name} could not bind")

    async def drain(self) -> None:
        self.calls.append("drain")

    def force(self) -> None:
        self.calls.append("force")


async def test_a_stop_refuses_new_work_and_answers_what_is_in_flight(plane: DataPlane, gate: Gate) -> None:
    frontends = [RecordingFrontEnd("http"), RecordingFrontEnd("grpc")]
    server = Server(plane, frontends, [])  # the fixture loaded spin already: nothing more to load
    running = asyncio.create_task(server.run())
    await eventually(plane.server_ready, "the server is ready")
    app = create_app(plane)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://batchline") as client:
        assert (await client.get("/v2/health/ready")).status_code == 200
        held = asyncio.create_task(client.post("/v2/models/spin/infer", content=infer_body(HOLD)))
        await eventually(gate.held.is_set, "a request holds the instance")
        queued = asyncio.create_task(client.post("/v2/models/spin/infer", content=infer_body(2.0)))
        model = plane.repository.get("spin")
        await eventually(lambda: model.queue_depth == 1, "a request waits in the queue")

        os.kill(os.getpid(), signal.SIGTERM)  # what an orchestrator sends

        await eventually(lambda: plane.stopping, "the signal reached the server")
        ready = await client.get("/v2/health/ready")
        assert ready.status_code == 503
        refused = await client.post("/v2/models/spin/infer", content=infer_body(3.0))
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]
        assert (await client.get("/v2/health/live")).status_code == 200  # stopping is not dying
        gate.released.set()
        assert [(await t).status_code for t in (held, queued)] == [200, 200]
        assert 3.0 not in gate.ran()
    await asyncio.wait_for(running, 30)
    assert [f.calls for f in frontends] == [["start", "drain"], ["start", "drain"]]
    assert model.state is not ModelState.READY and plane.repository.versions("spin") == [], "unloaded last"


async def test_a_second_interrupt_stops_waiting(plane: DataPlane) -> None:
    frontend = RecordingFrontEnd("http")
    server = Server(plane, [frontend], [])
    running = asyncio.create_task(server.run())
    await eventually(lambda: frontend.calls == ["start"], "the front end started")
    server.request_stop()
    server.request_stop()
    await asyncio.wait_for(running, 30)
    assert frontend.calls == ["start", "drain", "force"] or frontend.calls == ["start", "force", "drain"]


async def test_a_front_end_that_cannot_start_stops_the_others(plane: DataPlane) -> None:
    started, broken = RecordingFrontEnd("http"), RecordingFrontEnd("grpc", fail=True)
    with pytest.raises(StartFailed, match="grpc could not bind"):
        await asyncio.wait_for(Server(plane, [started, broken], []).run(), 30)
    assert started.calls == ["start", "drain"] and broken.calls == ["start"]
    assert plane.stopping and plane.repository.versions("spin") == []


class BrokenDrain(RecordingFrontEnd):
    async def drain(self) -> None:
        self.calls.append("drain")
        raise RuntimeError("the transport broke while draining")


async def test_a_front_end_that_fails_to_drain_does_not_keep_the_models_loaded(plane: DataPlane) -> None:
    broken, fine = BrokenDrain("grpc"), RecordingFrontEnd("http")
    server = Server(plane, [broken, fine], [])
    running = asyncio.create_task(server.run())
    await eventually(lambda: fine.calls == ["start"], "both front ends started")
    server.request_stop()
    await asyncio.wait_for(running, 30)
    assert broken.calls == fine.calls == ["start", "drain"]
    assert plane.repository.versions("spin") == [], "the models unloaded all the same"
