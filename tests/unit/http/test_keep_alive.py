"""The idle timer of the HTTP protocol, through a real uvicorn on loopback: armed once per idle
spell, not made and cancelled per request, it still closes a connection idle for the keep-alive
timeout, and only such a one: not one that keeps sending, nor one whose answer is still due. It
also closes a connection that never sends a request, and one whose request's head does not come
whole in time (408)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server.dataplane import DataPlane
from server.http import door
from server.http.app import create_app
from tests.unit.http.conftest import HOLD, Gate, infer_body
from tests.unit.http.test_door import post, read_response, started
from tests.unit.waiting import eventually

KEEP_ALIVE_S = 0.5


@pytest.fixture
def short_keep_alive(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Connections idle for half a second are closed, not five; each timer the protocol arms
    is listed, newest last."""
    timers: list[Any] = []
    real = HttpToolsProtocol.__init__

    def init(self: HttpToolsProtocol, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        self.timeout_keep_alive = KEEP_ALIVE_S  # type: ignore[assignment]  # uvicorn's int, any number works
        loop = self.loop

        class CountingLoop:
            def __getattr__(self, name: str) -> Any:
                return getattr(loop, name)

            def call_later(self, *args: Any) -> Any:
                handle = loop.call_later(*args)
                timers.append(handle)
                return handle

        self.loop = CountingLoop()  # type: ignore[assignment]

    monkeypatch.setattr(HttpToolsProtocol, "__init__", init)
    return timers


@pytest_asyncio.fixture
async def connection(
    plane: DataPlane, short_keep_alive: list[Any],
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A client's keep-alive connection to a real uvicorn serving the data plane."""
    plane.start([])
    frontend, port = await started(create_app(plane))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()
        await frontend.drain()


async def _closed(reader: asyncio.StreamReader, within_s: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), within_s) == b""
    except TimeoutError:
        return False


async def test_an_idle_connection_is_closed_after_the_timeout_and_one_timer_serves_many_requests(
    connection: tuple[asyncio.StreamReader, asyncio.StreamWriter], short_keep_alive: list[Any],
) -> None:
    reader, writer = connection
    for _ in range(20):
        writer.write(post(infer_body(1.0)))
        assert (await read_response(reader))[0] == 200
    assert len(short_keep_alive) <= 2  # armed as the connection opened (and again if it fired meanwhile), not per request
    started_idle = asyncio.get_running_loop().time()
    assert await _closed(reader, 5)
    assert asyncio.get_running_loop().time() - started_idle >= KEEP_ALIVE_S - 0.05


async def test_a_connection_that_keeps_sending_is_not_closed_when_its_first_timer_fires(
    connection: tuple[asyncio.StreamReader, asyncio.StreamWriter], short_keep_alive: list[Any],
) -> None:
    """Requests spread over three timeouts, none idle for one: the timer that fires finds the
    connection idle for less and waits out the rest."""
    reader, writer = connection
    for _ in range(15):
        writer.write(post(infer_body(1.0)))
        assert (await read_response(reader))[0] == 200
        await asyncio.sleep(KEEP_ALIVE_S * 0.2)
    assert not reader.at_eof()
    assert len(short_keep_alive) > 1  # it fired meanwhile, and re-armed for what was left
    assert await _closed(reader, 5)  # then idle: closed


async def test_a_connection_whose_answer_is_due_is_not_closed_while_it_computes(
    connection: tuple[asyncio.StreamReader, asyncio.StreamWriter], gate: Gate,
) -> None:
    reader, writer = connection
    writer.write(post(infer_body(1.0)))
    assert (await read_response(reader))[0] == 200  # the timer is armed
    writer.write(post(infer_body(HOLD)))
    await eventually(gate.held.is_set, "the second call is held in the engine")
    await asyncio.sleep(KEEP_ALIVE_S * 3)  # the timer fires while the call computes
    gate.released.set()
    assert (await read_response(reader))[0] == 200
    writer.write(post(infer_body(1.0)))  # and the connection serves on
    assert (await read_response(reader))[0] == 200


async def test_a_connection_the_client_closes_leaves_no_timer_behind(
    connection: tuple[asyncio.StreamReader, asyncio.StreamWriter], short_keep_alive: list[Any],
) -> None:
    reader, writer = connection
    writer.write(post(infer_body(1.0)))
    assert (await read_response(reader))[0] == 200
    writer.close()
    await eventually(lambda: short_keep_alive[-1].cancelled(), "the idle timer is cancelled with its connection")


async def test_a_connection_upgraded_to_a_websocket_leaves_no_timer_behind(
    connection: tuple[asyncio.StreamReader, asyncio.StreamWriter], short_keep_alive: list[Any],
) -> None:
    """The connection passes to uvicorn's websocket protocol (the app then refuses it): the
    HTTP protocol it leaves has nothing left to time."""
    reader, writer = connection
    writer.write(post(infer_body(1.0)))
    assert (await read_response(reader))[0] == 200  # the timer is armed
    writer.write(b"GET /ws HTTP/1.1\r\nHost: batchline\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
    await eventually(lambda: short_keep_alive[-1].cancelled(), "the idle timer is cancelled with the upgrade")


async def test_a_connection_that_sends_no_request_is_closed_after_the_timeout(
    connection: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    reader, _ = connection
    assert await _closed(reader, 5)


@pytest.fixture
def short_head_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(door, "HEAD_TIMEOUT_S", KEEP_ALIVE_S)


async def test_a_head_that_does_not_come_whole_in_time_is_refused_408_and_closed(
    connection: tuple[asyncio.StreamReader, asyncio.StreamWriter], short_head_timeout: None,
) -> None:
    """A byte of it now and then kept the connection open for ever: each read marks it busy."""
    reader, writer = connection
    request = post(infer_body(1.0))
    head_end = request.index(b"\r\n\r\n")
    for byte in range(6):
        writer.write(request[byte:byte + 1])
        await asyncio.sleep(KEEP_ALIVE_S * 0.4)
    started = asyncio.get_running_loop().time()
    answer = await asyncio.wait_for(reader.read(), 5)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"did not come whole within" in answer and b"connection: close" in answer.lower()
    assert asyncio.get_running_loop().time() - started < 5 and head_end > 6


async def test_a_head_that_comes_slowly_but_in_time_is_served(
    connection: tuple[asyncio.StreamReader, asyncio.StreamWriter], short_keep_alive: list[Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(door, "HEAD_TIMEOUT_S", KEEP_ALIVE_S * 4)
    reader, writer = connection
    request = post(infer_body(1.0))
    for start in range(0, 40, 10):  # the head over twice the keep-alive timeout, within the head's
        writer.write(request[start:start + 10])
        await asyncio.sleep(KEEP_ALIVE_S * 0.6)
    writer.write(request[40:])
    assert (await read_response(reader))[0] == 200
    assert len(short_keep_alive) > 1  # the timer found the head coming and gave it time


async def test_a_head_the_server_has_not_read_on_for_is_not_timed(
    connection: tuple[asyncio.StreamReader, asyncio.StreamWriter], gate: Gate, short_head_timeout: None,
) -> None:
    """A head cut off at the end of a read, behind calls queued while one computes: reading is
    paused for them, so it is the server that waits, not the client, and nothing is cut off."""
    reader, writer = connection
    third = post(infer_body(3.0))
    writer.write(post(infer_body(HOLD)) + post(infer_body(2.0)) + third[:20])
    await eventually(gate.held.is_set, "the first call is held in the engine")
    await asyncio.sleep(KEEP_ALIVE_S * 4)  # past the idle timer and the head's time, twice
    gate.released.set()
    assert [(await read_response(reader))[0] for _ in range(2)] == [200, 200]
    writer.write(third[20:])
    assert (await read_response(reader))[0] == 200
