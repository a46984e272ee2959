"""Infer calls answered inline by a front-end process (`--http-workers`), through a real uvicorn
on loopback and a real link to a data plane over a Unix socket: a small call whose body comes
whole with its head is parsed, sent over the link from the parser's callback and answered from
its link call's future, with no ASGI task; a call naming the client's shared memory goes to the
server process whole, from the task, as before. A client that leaves, the graceful stop running
out and a lost server process are met as on the task's way, and no call or connection is left
in a reference cycle."""

from __future__ import annotations

import asyncio
import functools
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NamedTuple

import orjson
import pytest
import pytest_asyncio

from server.dataplane import DataPlane
from server.http import v2_infer
from server.http.forward import ForwardApp
from server.http.frontend import HttpFrontEnd
from server.http.v2_infer import infer_v2
from server.http.worker_process import front_end_app
from server.inflight import InFlight
from server.link import LinkClient, PlaneLink
from server.settings import ServerSettings
from tests.unit.cycles import server_objects_left_in_cycles
from tests.unit.http.conftest import HOLD, Gate, infer_body
from tests.unit.http.test_door import exchange, post, read_response, started
from tests.unit.waiting import eventually


class FrontEnd(NamedTuple):
    port: int
    tasks: list[str]  # the paths of the ASGI tasks the front end started
    frontend: HttpFrontEnd
    link: LinkClient
    ends: list[PlaneLink]  # the server process's end of the link
    flight: InFlight  # the front end's bound on requests in flight


@pytest_asyncio.fixture
async def front(plane: DataPlane, asgi_tasks: list[str], tmp_path: Path) -> AsyncIterator[FrontEnd]:
    """One front end, the access log on, linked to `plane` (over `spin`) as to a server process."""
    plane.start([])
    ends: list[PlaneLink] = []

    def end() -> PlaneLink:
        ends.append(PlaneLink(plane, functools.partial(infer_v2, plane)))
        return ends[-1]

    path = str(tmp_path / "link.sock")
    server = await asyncio.get_running_loop().create_unix_server(end, path)
    link = await LinkClient.connect(path, lambda: None)
    forward = ForwardApp(str(tmp_path / "nobody.sock"))
    app = front_end_app(ServerSettings(access_log="json", max_in_flight=4), link, forward, 1)
    frontend, port = await started(app, grace_s=1)
    try:
        yield FrontEnd(port, asgi_tasks, frontend, link, ends, app.app.endpoint.flight)  # type: ignore[attr-defined]
    finally:
        await frontend.drain()
        link.close()
        await forward.close()
        server.close()
        await server.wait_closed()


async def test_a_small_call_is_sent_over_the_link_with_no_task(front: FrontEnd) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    try:
        writer.write(post(infer_body(1.0)) + post(infer_body(2.0)))  # pipelined: answered in order
        for value in (1.0, 2.0):
            status, headers, body = await read_response(reader)
            assert status == 200 and orjson.loads(body)["outputs"][0]["data"] == [value]
            assert orjson.loads(body)["model_version"] == "1" and headers["content-type"] == "application/json"
        writer.write(post(b'{"inputs": []}'))  # refused here, before the link
        status, _, body = await read_response(reader)
        assert status == 400 and "non-empty list" in orjson.loads(body)["error"]
        writer.write(post(infer_body(3.0), path="/v2/models/nowhere/infer"))  # refused there, typed
        status, _, body = await read_response(reader)
        assert status == 404 and "nowhere" in orjson.loads(body)["error"]
        assert front.tasks == [], "answered inline, without an ASGI task"
    finally:
        writer.close()
    assert (front.flight.requests, front.flight.bytes) == (0, 0)


async def test_a_call_naming_the_clients_shared_memory_goes_whole_from_the_task(front: FrontEnd) -> None:
    body = orjson.dumps({"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32",
                                     "parameters": {"shared_memory_region": "nowhere",
                                                    "shared_memory_byte_size": 4}}]})
    status, answer = await exchange(front.port, post(body))
    assert status == 400 and "--allow-client-shm" in orjson.loads(answer)["error"], "judged by the server process"
    assert front.tasks == ["/v2/models/spin/infer"]


async def test_a_client_that_leaves_drops_its_call_there_and_gives_its_place_back(
    front: FrontEnd, gate: Gate, caplog: pytest.LogCaptureFixture,
) -> None:
    held = asyncio.create_task(exchange(front.port, post(infer_body(HOLD))))
    await eventually(gate.held.is_set, "a request holds the instance")
    _, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(post(infer_body(7.0)))
    await eventually(lambda: len(front.ends[0]._calls) == 2, "the second call is queued in the server process")
    writer.close()
    await eventually(lambda: front.flight.requests == 1, "the call that left gave its place back")
    await eventually(lambda: len(front.ends[0]._calls) == 1, "the server process dropped it")
    gate.released.set()
    assert (await held)[0] == 200
    assert 7.0 not in gate.ran(), "the call whose client left was computed"
    assert front.tasks == [] and not front.link._pending
    access = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "batchline.access"]
    assert sorted(line["status"] for line in access) == [200, 499]


async def test_outputs_too_big_to_encode_on_the_loop_are_encoded_on_a_thread(
    front: FrontEnd, encoding_threads: list[str],
) -> None:
    status, answer = await exchange(front.port, post(infer_body(8.0)))
    assert status == 200 and orjson.loads(answer)["outputs"][0]["data"] == [8.0]
    assert front.tasks == [] and encoding_threads and encoding_threads[0] != "MainThread"


async def test_a_call_cut_off_by_the_end_of_the_grace_period_is_told_503_and_dropped_there(
    front: FrontEnd, gate: Gate,
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    try:
        writer.write(post(infer_body(HOLD)))
        await eventually(gate.held.is_set, "the request is held in the engine")
        _, queued = await asyncio.open_connection("127.0.0.1", front.port)
        queued.write(post(infer_body(9.0)))
        await eventually(lambda: len(front.ends[0]._calls) == 2, "a second call is queued in the server process")
        draining = asyncio.create_task(front.frontend.drain())
        status, headers, body = await read_response(reader)
        assert status == 503 and "stopped before this request was answered" in orjson.loads(body)["error"]
        assert headers["connection"] == "close"
        await asyncio.wait_for(draining, 10)
        await eventually(lambda: len(front.ends[0]._calls) == 1, "the queued call was dropped there")
        queued.close()
    finally:
        gate.released.set()
        writer.close()
    assert 9.0 not in gate.ran()


async def test_a_lost_server_process_is_a_503_for_the_calls_waiting_on_it(front: FrontEnd, gate: Gate) -> None:
    waiting = asyncio.create_task(exchange(front.port, post(infer_body(HOLD))))
    await eventually(gate.held.is_set, "the request is held in the engine")
    front.ends[0].transport.close()  # type: ignore[union-attr]
    status, body = await asyncio.wait_for(waiting, 10)
    assert status == 503 and "server process is gone" in orjson.loads(body)["error"]
    status, body = await exchange(front.port, post(infer_body(1.0)))
    assert status == 503 and "server process is gone" in orjson.loads(body)["error"]
    assert front.tasks == [] and (front.flight.requests, front.flight.bytes) == (0, 0)


def _big_body() -> bytes:
    """Over INLINE_DECODE_BYTES: the task's way."""
    return infer_body(1.0, padding="x" * v2_infer.INLINE_DECODE_BYTES)


def _shared_memory_body() -> bytes:
    return orjson.dumps({"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32",
                                     "parameters": {"shared_memory_region": "nowhere",
                                                    "shared_memory_byte_size": 4}}]})


@pytest.mark.parametrize(("body", "path", "status"), [
    (_big_body(), "/v2/models/nowhere/infer", 404),  # the task's way, refused by the server process
    (_big_body(), "/v2/models/spin/infer", 200),
    (_shared_memory_body(), "/v2/models/spin/infer", 400),  # sent whole, refused there
    (infer_body(1.0), "/v2/models/nowhere/infer", 404),  # inline, refused there
    (infer_body(1.0), "/v2/models/spin/infer", 200),
], ids=["task-404", "task", "shared-memory-400", "inline-404", "inline"])
async def test_calls_leave_nothing_in_reference_cycles(front: FrontEnd, body: bytes, path: str, status: int) -> None:
    """An error raised from a link call holds the frames it passed through: were they to hold
    the call, its body and tensors would wait for a rare full collection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)

    async def requests(count: int) -> None:
        for _ in range(count):
            writer.write(post(body, path=path))
            assert (await read_response(reader))[0] == status

    found = await server_objects_left_in_cycles(requests, 20, 100)
    writer.close()
    assert not found, f"left in reference cycles by 100 requests: {dict(found)}"


async def test_a_connection_closed_after_an_inline_call_is_freed_by_its_count(front: FrontEnd) -> None:
    """uvicorn lets a request's cycle go of the protocol as its task ends; an inline call has no
    task, and the connection would wait in a reference cycle for a rare collection."""
    assert not await server_objects_left_by_connections(front.port)


async def server_objects_left_by_connections(port: int) -> Counter[str]:
    """What of the server's a collection finds in cycles after 20 connections that each carry
    one small call, answered, then close."""

    async def connections(count: int) -> None:
        for _ in range(count):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(post(infer_body(1.0)))
            assert (await read_response(reader))[0] == 200
            writer.close()
            await writer.wait_closed()
            await asyncio.sleep(0.01)  # the server's side sees it closed

    return await server_objects_left_in_cycles(connections, 5, 20)
