"""Infer calls answered inline by the server's HTTP protocol, through a real uvicorn on loopback:
a small call whose body comes whole with its head starts on the data plane from the parser's
callback and is answered from its future's, with no ASGI task; any other call (a body that
comes later, compressed or waiting for 100 Continue, or large) takes the endpoint's task, as
before. Both answer alike, a client that leaves drops its queued call and gives its place back,
and a call whose outputs are too big to encode on the event loop is encoded on a thread."""

from __future__ import annotations

import asyncio
import gzip
import threading
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import pytest_asyncio
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server.access_log import AccessLog
from server.dataplane import DataPlane
from server.errors import InvalidInput
from server.http import door, v2_infer
from server.http.app import create_app
from server.http.infer import _InlineAnswer
from server.inflight import InFlight
from tests.unit.http.conftest import HOLD, Gate, infer_body
from tests.unit.http.test_door import exchange, post, read_response, started
from tests.unit.http.test_front_end_inline import server_objects_left_by_connections
from tests.unit.waiting import eventually


@pytest_asyncio.fixture
async def served(plane: DataPlane, asgi_tasks: list[str]) -> AsyncIterator[tuple[int, list[str], InFlight]]:
    """A real HTTP front end over `spin` with the access log on; the paths of the ASGI tasks it
    started, and its in-flight bound."""
    plane.start([])
    flight = InFlight(4)
    frontend, port = await started(create_app(plane, flight=flight, access_log=AccessLog("json")))
    yield port, asgi_tasks, flight
    await frontend.drain()


async def test_a_small_call_whose_body_came_with_its_head_runs_no_task(
    served: tuple[int, list[str], InFlight],
) -> None:
    port, tasks, _ = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(post(infer_body(1.0)) + post(infer_body(2.0)))  # pipelined: answered in order
        for value in (1.0, 2.0):
            status, headers, body = await read_response(reader)
            assert status == 200 and orjson.loads(body)["outputs"][0]["data"] == [value]
            assert headers["content-type"] == "application/json"
        writer.write(post(b'{"inputs": []}'))
        status, _, body = await read_response(reader)
        assert status == 400 and "non-empty list" in orjson.loads(body)["error"]
        writer.write(post(infer_body(3.0), path="/v2/models/nowhere/infer"))
        assert (await read_response(reader))[0] == 404
        assert tasks == [], "answered inline, without an ASGI task"
        request = post(infer_body(4.0))
        writer.write(request[:-5])  # the body's end in a later read: the task's way, with its timeout
        await writer.drain()
        await eventually(lambda: len(tasks) == 1, "the call took the endpoint's task")
        writer.write(request[-5:])
        status, _, body = await read_response(reader)
        assert status == 200 and orjson.loads(body)["outputs"][0]["data"] == [4.0]
    finally:
        writer.close()


@pytest.mark.parametrize("header", ["Content-Encoding: gzip", "Expect: 100-continue"])
async def test_a_compressed_call_or_one_awaiting_100_continue_takes_the_task(
    served: tuple[int, list[str], InFlight], header: str,
) -> None:
    port, tasks, _ = served
    body = gzip.compress(infer_body(5.0)) if "gzip" in header else infer_body(5.0)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(post(body, header))
        status, _, answer = await read_response(reader)
        if status == 100:  # the interim answer to Expect
            status, _, answer = await read_response(reader)
    finally:
        writer.close()
    assert status == 200 and orjson.loads(answer)["outputs"][0]["data"] == [5.0]
    assert tasks == ["/v2/models/spin/infer"]


async def test_a_body_too_big_to_parse_on_the_loop_takes_the_task(served: tuple[int, list[str], InFlight]) -> None:
    port, tasks, _ = served
    body = infer_body(6.0, padding="x" * v2_infer.INLINE_DECODE_BYTES)
    status, answer = await exchange(port, post(body))
    assert status == 200 and orjson.loads(answer)["outputs"][0]["data"] == [6.0]
    assert tasks == ["/v2/models/spin/infer"]


async def test_a_client_that_leaves_drops_its_queued_inline_call_and_gives_its_place_back(
    served: tuple[int, list[str], InFlight], gate: Gate, caplog: pytest.LogCaptureFixture,
) -> None:
    port, tasks, flight = served
    held = asyncio.create_task(exchange(port, post(infer_body(HOLD))))
    await eventually(gate.held.is_set, "a request holds the instance")
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(post(infer_body(7.0)))
    await eventually(lambda: flight.requests == 2, "the second call is in flight, queued")
    writer.close()
    await eventually(lambda: flight.requests == 1, "the call that left gave its place back")
    gate.released.set()
    assert (await held)[0] == 200
    assert 7.0 not in gate.ran(), "the call whose client left was computed"
    assert tasks == []
    access = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "batchline.access"]
    assert sorted(line["status"] for line in access) == [200, 499]


async def test_outputs_too_big_to_encode_on_the_loop_are_encoded_on_a_thread(
    served: tuple[int, list[str], InFlight], encoding_threads: list[str],
) -> None:
    port, tasks, _ = served
    status, answer = await exchange(port, post(infer_body(8.0)))
    assert status == 200 and orjson.loads(answer)["outputs"][0]["data"] == [8.0]
    assert tasks == [] and encoding_threads and encoding_threads[0] != "MainThread"


async def test_an_inline_call_cut_off_by_the_end_of_the_grace_period_is_told_503(plane: DataPlane, gate: Gate) -> None:
    """uvicorn cancels what still runs when its graceful stop times out: an inline call waiting
    for its answer is told 503 in the error shape, as a task is, and its connection closed."""
    plane.start([])
    frontend, port = await started(create_app(plane), grace_s=1)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(post(infer_body(HOLD)))
        await eventually(gate.held.is_set, "the request is held in the engine")
        draining = asyncio.create_task(frontend.drain())
        status, headers, body = await read_response(reader)
        assert status == 503 and "stopped before this request was answered" in orjson.loads(body)["error"]
        assert headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 5) == b""
        await asyncio.wait_for(draining, 10)
    finally:
        gate.released.set()
        writer.close()


@pytest.fixture
def short_keep_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvicorn closes a connection idle for half a second, not five."""
    real = HttpToolsProtocol.__init__

    def init(self: HttpToolsProtocol, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        self.timeout_keep_alive = 0.5

    monkeypatch.setattr(HttpToolsProtocol, "__init__", init)


@pytest.mark.parametrize("first", [post(infer_body(1.0), path="/v2/models/nowhere/infer"), post(b'{"inputs": []}')])
async def test_a_call_pipelined_behind_one_answered_at_once_is_not_cut_off_by_the_keep_alive_timer(
    plane: DataPlane, gate: Gate, short_keep_alive: None, first: bytes,
) -> None:
    """An answer given at once (404, 400) completes at the next turn: completed within the read,
    it armed the idle timer under the call that followed it, which the timer then closed."""
    plane.start([])
    frontend, port = await started(create_app(plane))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(first + post(infer_body(HOLD)))
        await eventually(gate.held.is_set, "the second call is held in the engine")
        await asyncio.sleep(1.0)  # past the keep-alive timeout, while the second call computes
        gate.released.set()
        assert (await read_response(reader))[0] in (400, 404)
        assert (await read_response(reader))[0] == 200
    finally:
        writer.close()
        await frontend.drain()


async def test_a_call_queued_behind_one_that_computes_with_its_body_still_coming_is_answered(
    plane: DataPlane, gate: Gate,
) -> None:
    """Reading stays paused while calls are queued behind the one computing; the last one
    queued starts with reading resumed, or the rest of its body would never be read."""
    plane.start([])
    frontend, port = await started(create_app(plane))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        second = post(infer_body(2.0))
        writer.write(post(infer_body(HOLD)) + second[:-5])
        await eventually(gate.held.is_set, "the first call is held in the engine")
        await asyncio.sleep(0.1)  # the second's head, and part of its body, read and queued
        gate.released.set()
        assert (await read_response(reader))[0] == 200
        writer.write(second[-5:])
        status, _, body = await read_response(reader)
        assert status == 200 and orjson.loads(body)["outputs"][0]["data"] == [2.0]
    finally:
        writer.close()
        await frontend.drain()


async def test_hundreds_of_pipelined_calls_answered_at_once_are_all_answered(
    plane: DataPlane, gate: Gate, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each completes at the next turn, so none starts the next from within its own answer (a
    chain of 400 overflowed the stack, lost answers and kept a place in flight)."""
    monkeypatch.setattr(door, "MAX_PIPELINED", 1000)  # the default bound would drop most of them
    plane.start([])
    flight = InFlight(8)
    frontend, port = await started(create_app(plane, flight=flight))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(post(infer_body(HOLD)))
        await eventually(gate.held.is_set, "a call holds the engine")
        writer.write(b"".join(post(infer_body(1.0), path="/v2/models/nowhere/infer") for _ in range(400)))
        await writer.drain()
        gate.released.set()
        assert (await read_response(reader))[0] == 200
        assert [(await read_response(reader))[0] for _ in range(400)] == [404] * 400
        assert flight.requests == 0 and flight.bytes == 0
    finally:
        writer.close()
        await frontend.drain()


async def test_the_error_of_a_call_nobody_waits_for_any_more_is_read() -> None:
    """Its client left, or the stop cut it off: nobody is left to tell, but the error is read,
    or asyncio logs it as never retrieved when the future is collected."""
    future = asyncio.get_running_loop().create_future()
    future.set_exception(RuntimeError("the engine failed"))
    answer = object.__new__(_InlineAnswer)
    answer._done = True
    answer.finished(future)
    assert not future._log_traceback  # type: ignore[attr-defined]


async def test_an_encoding_that_fails_after_the_client_left_gives_its_place_back_once(
    served: tuple[int, list[str], InFlight], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    port, _, flight = served
    monkeypatch.setattr(v2_infer, "INLINE_ENCODE_JSON_BYTES", 0)  # encoded on a thread
    encoding, go_on = threading.Event(), threading.Event()

    def failing(*args: Any) -> tuple[bytes, int | None]:
        encoding.set()
        go_on.wait(5)
        raise InvalidInput("cannot encode")

    monkeypatch.setattr(v2_infer, "_answer", failing)
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(post(infer_body(1.0)))
    await eventually(encoding.is_set, "the answer is being encoded")
    writer.close()
    await eventually(lambda: flight.requests == 0, "the call that left gave its place back")
    go_on.set()
    await asyncio.sleep(0.2)
    assert (flight.requests, flight.bytes) == (0, 0)
    access = [orjson.loads(r.getMessage())["status"] for r in caplog.records if r.name == "batchline.access"]
    assert access == [499]


@pytest.mark.parametrize("ways", [("task", "task"), ("task", "inline"), ("inline", "task"), ("inline", "inline")])
async def test_a_call_pipelined_behind_another_at_the_in_flight_bound_is_served(
    plane: DataPlane, gate: Gate, ways: tuple[str, str],
) -> None:
    """A call gives its place back before its answer is written: writing it starts the call
    pipelined behind it, which was refused 429 while the first still held the only place."""
    plane.start([])
    flight = InFlight(1)
    frontend, port = await started(create_app(plane, flight=flight))

    def call(way: str, value: float) -> bytes:
        body = infer_body(value)
        return post(gzip.compress(body), "Content-Encoding: gzip") if way == "task" else post(body)

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(call(ways[0], 1.0) + call(ways[1], 2.0))
        assert [(await read_response(reader))[0] for _ in range(2)] == [200, 200]
        assert (flight.requests, flight.bytes) == (0, 0)
    finally:
        writer.close()
        await frontend.drain()


async def test_a_connection_closed_after_an_inline_call_is_freed_by_its_count(
    served: tuple[int, list[str], InFlight],
) -> None:
    port, tasks, _ = served
    assert not await server_objects_left_by_connections(port)
    assert tasks == []
