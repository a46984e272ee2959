"""Lifecycle and scheduling through the real app at the ASGI level (httpx's ASGI transport):
reload and unload with requests in flight, and priorities, preserve_ordering and merging as a
config.yaml sets them. Engines are held by input (see conftest), so every interleaving is set
up by the test and observed in the server's own state, never left to the clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from server.dataplane import DataPlane
from server.errors import Unavailable
from server.http.app import create_app
from server.http.auth import AccessPolicy
from server.model import ModelState, ModelVersion
from server.repository import ModelRepository
from tests.unit.http.conftest import HOLD, Gate, infer_body
from tests.unit.http.tiny_models import write_spin_model
from tests.unit.waiting import eventually

Order = list[float]
ADMIN_TOKEN = "lifecycle-admin-token-0123"
AS_ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"}


@asynccontextmanager
async def serving(root: Path, gate: Gate, **overrides: Any) -> AsyncIterator[tuple[httpx.AsyncClient, ModelRepository]]:
    """`spin` with its config.yaml changed by `overrides`, loaded, behind the whole app, with
    model control on; the client sends the admin token and JSON, as load and unload want."""
    write_spin_model(root, "spin", **overrides)
    repository = ModelRepository(root)
    await repository.load("spin")
    app = create_app(DataPlane(repository), access=AccessPolicy(model_control=True, admin_token=ADMIN_TOKEN))
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://batchline", headers=AS_ADMIN) as client:
            yield client, repository
    finally:
        gate.released.set()
        await repository.unload_all()


async def infer(client: httpx.AsyncClient, value: float, answered: Order | None = None, **parameters: Any) -> httpx.Response:
    """POST one request; `answered` records the order in which responses come back."""
    response = await client.post("/v2/models/spin/infer", content=infer_body(value, **parameters))
    if answered is not None:
        answered.append(value)
    return response


def echoed(response: httpx.Response) -> float:
    assert response.status_code == 200, response.text
    return float(response.json()["outputs"][0]["data"][0])


async def hold_the_instance(client: httpx.AsyncClient, gate: Gate, answered: Order | None = None) -> asyncio.Task[httpx.Response]:
    task = asyncio.create_task(infer(client, HOLD, answered))
    await eventually(gate.held.is_set, "a request holds an instance")
    return task


# --- reload and unload with requests in flight ------------------------------------------------


async def reload_behind_a_running_and_a_queued_request(
    client: httpx.AsyncClient, gate: Gate, old: ModelVersion
) -> tuple[asyncio.Task[httpx.Response], asyncio.Task[httpx.Response], asyncio.Task[httpx.Response]]:
    """A request held in `old`'s engine, another (5.0) queued behind it, and a reload that has
    swapped versions and drains `old`: the tasks of the three."""
    running = await hold_the_instance(client, gate)
    queued = asyncio.create_task(infer(client, 5.0))
    await eventually(lambda: old.queue_depth == 1, "a second request is queued behind it")
    reload = asyncio.create_task(client.post("/v2/repository/models/spin/load"))
    await eventually(lambda: old.state is ModelState.UNLOADING, "the reload swapped versions and drains the old one")
    return running, queued, reload


async def test_a_reload_lets_queued_requests_finish_and_serves_new_ones(root: Path, gate: Gate) -> None:
    async with serving(root, gate) as (client, repository):
        old = repository.get("spin")
        running, queued, reload = await reload_behind_a_running_and_a_queued_request(client, gate, old)
        assert echoed(await infer(client, 6.0)) == 6.0  # the new version serves at once
        assert repository.get("spin") is not old
        gate.released.set()
        done = await asyncio.wait_for(asyncio.gather(running, queued, reload), 30)
    assert [r.status_code for r in done] == [200, 200, 200], [r.text for r in done]
    assert echoed(done[1]) == 5.0
    assert sorted(gate.ran()) == [5.0, 6.0, HOLD]


async def test_a_call_its_front_end_admitted_before_a_reload_is_served_by_the_version_serving_now(
    root: Path, gate: Gate
) -> None:
    """A front end chooses the version, then parses the body (on a worker thread when large) or
    sends a list's later chunks: a reload that swapped versions meanwhile answered it 503,
    though no request is to fail because of the swap. It goes to the version that replaced it,
    whether the old one still drains (busy) or is gone (idle)."""
    def x(value: float) -> dict[str, tuple[str, np.ndarray]]:
        return {"x": ("FP32", np.array([[value]], np.float32))}

    async with serving(root, gate) as (client, repository):
        plane = DataPlane(repository)
        old = plane.admit("spin", None)
        running = await hold_the_instance(client, gate)
        reload = asyncio.create_task(client.post("/v2/repository/models/spin/load"))
        await eventually(lambda: old.state is ModelState.UNLOADING, "the reload swapped versions and drains the old one")
        while_draining = plane.start_call(old, x(4.0), {}).answer()
        gate.released.set()
        outputs, *done = await asyncio.wait_for(asyncio.gather(while_draining, running, reload), 30)
        assert [r.status_code for r in done] == [200, 200], [r.text for r in done]
        assert outputs[0][2].ravel().tolist() == [4.0]
        idle = plane.admit("spin", None)
        assert (await client.post("/v2/repository/models/spin/load")).status_code == 200
        assert not idle.ready  # gone: it drained nothing and closed at once
        outputs = await asyncio.wait_for(plane.start_call(idle, x(5.0), {}).answer(), 30)
        assert outputs[0][2].ravel().tolist() == [5.0]
        assert (await client.post("/v2/repository/models/spin/unload")).status_code == 200
        with pytest.raises(Unavailable, match="not loaded"):  # unloaded, not replaced: nothing serves it
            plane.start_call(idle, x(6.0), {})
    assert sorted(gate.ran()) == [4.0, 5.0, HOLD]


async def test_a_reload_counts_on_from_the_old_version_and_what_it_answered_as_it_drained(
    root: Path, gate: Gate
) -> None:
    """One series under the same labels: the counts go on from the old version's, not from
    zero, and the requests it answers after the swap are counted (they were in neither)."""
    async with serving(root, gate) as (client, repository):
        for value in (1.0, 2.0):
            echoed(await infer(client, value))
        running, queued, reload = await reload_behind_a_running_and_a_queued_request(client, gate, repository.get("spin"))
        echoed(await infer(client, 6.0))
        gate.released.set()
        done = await asyncio.wait_for(asyncio.gather(running, queued, reload), 30)
        assert [r.status_code for r in done] == [200, 200, 200]
        echoed(await infer(client, 7.0))
        stats = (await client.get("/v2/models/spin/stats")).json()["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] == 6
    assert stats["inference_count"] == stats["execution_count"] == 6  # every request alone in its batch
    assert sum(b["compute_infer"]["count"] for b in stats["batch_stats"]) == 6


async def test_an_unload_lets_queued_requests_finish_and_refuses_new_ones_with_503(root: Path, gate: Gate) -> None:
    async with serving(root, gate) as (client, repository):
        old = repository.get("spin")
        running = await hold_the_instance(client, gate)
        queued = asyncio.create_task(infer(client, 5.0))
        await eventually(lambda: old.queue_depth == 1, "a second request is queued behind it")
        unload = asyncio.create_task(client.post("/v2/repository/models/spin/unload"))
        await eventually(lambda: old.state is ModelState.UNLOADING, "the unload drains the model")
        late = await infer(client, 6.0)
        assert late.status_code == 503 and "not loaded" in late.json()["error"]
        gate.released.set()
        done = await asyncio.wait_for(asyncio.gather(running, queued, unload), 30)
        assert [r.status_code for r in done] == [200, 200, 200], [r.text for r in done]
        after = await infer(client, 7.0)
        assert after.status_code == 503
    assert sorted(gate.ran()) == [5.0, HOLD]


async def test_a_request_in_admission_when_the_unload_starts_gets_503_not_500(root: Path, gate: Gate) -> None:
    """Unloading closes the engines: whatever had not reached the queue by then is refused
    cleanly, and nothing already queued is lost."""
    async with serving(root, gate) as (client, repository):
        old = repository.get("spin")
        running = await hold_the_instance(client, gate)
        queued = [asyncio.create_task(infer(client, float(v))) for v in (1, 2, 3)]
        await eventually(lambda: old.queue_depth == 3, "three requests are queued")
        unload = asyncio.create_task(client.post("/v2/repository/models/spin/unload"))
        await eventually(lambda: old.state is ModelState.UNLOADING, "the unload drains the model")
        racing = [asyncio.create_task(infer(client, float(v))) for v in (4, 5)]
        gate.released.set()
        done = await asyncio.wait_for(asyncio.gather(running, *queued, unload), 30)
        refused = await asyncio.wait_for(asyncio.gather(*racing), 30)
    assert all(r.status_code == 200 for r in done), [r.text for r in done]
    assert all(r.status_code == 503 for r in refused), [r.text for r in refused]


async def test_a_reload_that_fails_keeps_the_serving_version(root: Path, gate: Gate) -> None:
    """Triton's contract: if a reload fails, the already loaded model stays loaded and serves."""
    async with serving(root, gate) as (client, _):
        (root / "spin" / "1" / "model.onnx").write_bytes(b"not an onnx graph")
        failed = await client.post("/v2/repository/models/spin/load")
        assert failed.status_code == 503 and "failed to load" in failed.json()["error"]
        assert echoed(await infer(client, 3.0)) == 3.0


# --- the batching settings of config.yaml, over the app --------------------------------------


async def test_a_priority_1_request_runs_before_priority_2_ones_queued_earlier(root: Path, gate: Gate) -> None:
    batching = {"max_queue_delay_microseconds": 0, "priority_levels": 2, "default_priority_level": 2}
    async with serving(root, gate, dynamic_batching=batching, warmup={"batch_sizes": [1], "batch_cap": 1}) as (
        client, repository,
    ):
        model = repository.get("spin")
        running = await hold_the_instance(client, gate)
        low = [asyncio.create_task(infer(client, v, priority=2)) for v in (1.0, 2.0)]
        await eventually(lambda: model.queue_depth == 2, "two priority-2 requests are queued")
        default = asyncio.create_task(infer(client, 3.0))  # the config's default level: 2
        await eventually(lambda: model.queue_depth == 3, "the default-level request is queued")
        high = asyncio.create_task(infer(client, 4.0, priority=1))
        await eventually(lambda: model.queue_depth == 4, "the priority-1 request is queued last")
        gate.released.set()
        responses = await asyncio.wait_for(asyncio.gather(running, *low, default, high), 30)
    assert all(r.status_code == 200 for r in responses)
    assert gate.batches == [[HOLD], [4.0], [1.0], [2.0], [3.0]]


@pytest.mark.parametrize("preserve", [True, False])
async def test_preserve_ordering_answers_in_arrival_order_across_two_instances(
    root: Path, gate: Gate, preserve: bool
) -> None:
    batching = {"max_queue_delay_microseconds": 0, "preserve_ordering": preserve}
    answered: Order = []
    async with serving(root, gate, dynamic_batching=batching, instance_group=[{"count": 2, "kind": "CPU"}]) as (
        client, repository,
    ):
        model = repository.get("spin")
        first = await hold_the_instance(client, gate, answered)
        second = asyncio.create_task(infer(client, 5.0, answered))
        await eventually(lambda: model.stats.execution_count == 1, "the second request ran on the other instance")
        await eventually(lambda: preserve or answered == [5.0], "the unordered answer comes back")
        assert answered == ([] if preserve else [5.0]), "the later request was answered before the earlier one"
        gate.released.set()
        await asyncio.wait_for(asyncio.gather(first, second), 30)
    assert answered == ([HOLD, 5.0] if preserve else [5.0, HOLD])


@pytest.mark.parametrize("dynamic", [True, False])
async def test_without_dynamic_batching_queued_requests_never_share_a_batch(
    root: Path, gate: Gate, dynamic: bool
) -> None:
    batching = {"max_queue_delay_microseconds": 0} if dynamic else None
    async with serving(root, gate, dynamic_batching=batching) as (client, repository):
        model = repository.get("spin")
        running = await hold_the_instance(client, gate)
        queued = [asyncio.create_task(infer(client, v)) for v in (1.0, 2.0, 3.0)]
        await eventually(lambda: model.queue_depth == 3, "three requests are queued")
        gate.released.set()
        await asyncio.wait_for(asyncio.gather(running, *queued), 30)
    assert gate.batches == ([[HOLD], [1.0, 2.0, 3.0]] if dynamic else [[HOLD], [1.0], [2.0], [3.0]])


async def test_control_bodies_of_the_wrong_type_are_refused_not_read_as_something_else(root: Path, gate: Gate) -> None:
    """{"ready": "false"} listed ready models only (bool("false") is True), and "parameters": []
    loaded as if there were none."""
    async with serving(root, gate) as (client, _):
        for body in ({"ready": "false"}, {"ready": 0}):
            refused = await client.post("/v2/repository/index", json=body)
            assert refused.status_code == 400 and "'ready' must be true or false" in refused.json()["error"]
        assert (await client.post("/v2/repository/index", json={"ready": False})).status_code == 200
        refused = await client.post("/v2/repository/models/spin/load", json={"parameters": []})
        assert refused.status_code == 400 and "'parameters' must be an object" in refused.json()["error"]
        assert (await client.post("/v2/repository/models/spin/load", json={"parameters": None})).status_code == 200
