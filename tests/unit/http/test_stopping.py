"""A stop (SIGTERM) as the data plane sees it: readiness false and new inference refused at
once, what is already queued or running answered, then the models unloaded."""

from __future__ import annotations

import asyncio
import signal

import httpx
import uvicorn

from server.dataplane import DataPlane
from server.http.app import create_app
from server.http.stopping import StoppingServer
from tests.unit.http.conftest import HOLD, Gate, infer_body
from tests.unit.waiting import eventually


async def test_a_stop_refuses_new_work_and_answers_what_is_in_flight(plane: DataPlane, gate: Gate) -> None:
    plane.start([])  # the fixture loaded spin already: nothing more to load
    await eventually(plane.server_ready, "the server is ready")
    app = create_app(plane)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://batchline") as client:
        assert (await client.get("/v2/health/ready")).status_code == 200
        held = asyncio.create_task(client.post("/v2/models/spin/infer", content=infer_body(HOLD)))
        await eventually(gate.held.is_set, "a request holds the instance")
        queued = asyncio.create_task(client.post("/v2/models/spin/infer", content=infer_body(2.0)))
        model = plane.repository.get("spin")
        await eventually(lambda: model.queue_depth == 1, "a request waits in the queue")

        StoppingServer(plane, uvicorn.Config(app)).handle_exit(signal.SIGTERM, None)

        ready = await client.get("/v2/health/ready")
        assert ready.status_code == 503
        refused = await client.post("/v2/models/spin/infer", content=infer_body(3.0))
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]
        assert (await client.get("/v2/health/live")).status_code == 200  # stopping is not dying
        gate.released.set()
        assert [(await t).status_code for t in (held, queued)] == [200, 200]
        assert 3.0 not in gate.ran()
