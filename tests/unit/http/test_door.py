"""The door: 429s answered by the HTTP protocol before an ASGI task exists, through a real
uvicorn on loopback, with HTTP/1.1's connection rules kept: the refused body is dropped and the
connection kept, pipelined requests answered in order, 100-continue and HTTP/1.0 closed."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import pytest_asyncio
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server.asgi import body
from server.dataplane import DataPlane
from server.http import door
from server.http.app import create_app
from server.http.auth import AccessPolicy
from server.http.door import Admitted, Door, Refused
from server.http.frontend import HttpFrontEnd
from server.http.infer import INFER_PATH, FastInferApp, InferEndpoint
from server.inflight import InFlight
from server.repository import ModelRepository
from tests.unit.http.conftest import HOLD, Gate, infer_body
from tests.unit.http.tiny_models import write_spin_model
from tests.unit.waiting import eventually

TOKEN = "an-inference-token-of-some-length"


ANSWER_WITHIN_S = 5  # a broken protocol leaves the client waiting: it fails here rather than hangs


async def started(app: Any, grace_s: float = 1) -> tuple[HttpFrontEnd, int]:
    listener = socket.create_server(("127.0.0.1", 0))
    frontend = HttpFrontEnd(app, listener, log_level="warning", grace_s=grace_s)
    await frontend.start()
    return frontend, listener.getsockname()[1]


@pytest_asyncio.fixture
async def one_slot(plane: DataPlane, gate: Gate) -> AsyncIterator[tuple[int, asyncio.Task[tuple[int, bytes]]]]:
    """A server that serves one infer call at a time, that call held in the engine: every
    other infer call is over the in-flight bound."""
    plane.start([])
    frontend, port = await started(create_app(plane, flight=InFlight(1)))
    held = asyncio.create_task(exchange(port, post(infer_body(HOLD))))
    await eventually(gate.held.is_set, "a request holds the instance")
    yield port, held
    gate.released.set()
    await frontend.drain()


def post(body: bytes, *headers: str, version: str = "1.1", path: str = "/v2/models/spin/infer") -> bytes:
    head = [f"POST {path} HTTP/{version}", "Host: batchline", "Content-Type: application/json",
            f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: batchline\r\n\r\n".encode()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One answer, within ANSWER_WITHIN_S; every header name is asserted to come once (a dict
    would hide a second)."""

    async def read() -> tuple[int, dict[str, str], bytes]:
        status = int((await reader.readline()).split()[1])
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            assert name.strip().lower() not in headers, f"{name} twice"
            headers[name.strip().lower()] = value.strip()
        return status, headers, await reader.readexactly(int(headers.get("content-length", "0")))

    return await asyncio.wait_for(read(), ANSWER_WITHIN_S)


async def exchange(port: int, request: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    status, _, body = await read_response(reader)
    writer.close()
    return status, body


async def test_a_refused_request_keeps_its_connection_and_what_follows_is_answered(
    one_slot: tuple[int, asyncio.Task[tuple[int, bytes]]], gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    port, held = one_slot
    through_the_app: list[object] = []
    monkeypatch.setattr(InferEndpoint, "_refuse_busy", lambda *args: through_the_app.append(args))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(post(infer_body(1.0)) + get("/v2/health/live"))  # pipelined: a body, then a request
    status, headers, body = await read_response(reader)
    assert status == 429 and headers["retry-after"] == "1" and "date" in headers
    assert "limit of requests in flight" in orjson.loads(body)["error"]
    assert (await read_response(reader))[0] == 200, "the request after the refused body was answered"
    gate.released.set()
    assert (await held)[0] == 200
    writer.write(post(infer_body(2.0)))  # the same connection, later: served
    status, _, body = await read_response(reader)
    assert status == 200 and orjson.loads(body)["outputs"][0]["data"] == [2.0]
    writer.close()
    assert 1.0 not in gate.ran(), "a refused request never reached the engine"
    assert through_the_app == [], "the protocol answered the 429, not the app (does uvicorn still call the door?)"


async def test_through_the_protocol_a_stopping_server_at_its_bound_says_503_not_429(
    one_slot: tuple[int, asyncio.Task[tuple[int, bytes]]], plane: DataPlane, gate: Gate
) -> None:
    """The door's own 429 told a client to retry here in a second, with the server going away."""
    port, held = one_slot
    plane.begin_stop()
    status, body = await exchange(port, post(infer_body(1.0)))
    assert status == 503 and "shutting down" in orjson.loads(body)["error"]
    gate.released.set()
    assert (await held)[0] == 200


@pytest.mark.parametrize(("path", "sent"), [("/v2/models/spin/infer", ""), ("/v2/models/spin/infer", '{"inputs": ['),
                                           ("/v1/embeddings", '{"model": ')])
async def test_a_body_that_stops_part_way_is_refused_and_frees_its_place(
    plane: DataPlane, monkeypatch: pytest.MonkeyPatch, path: str, sent: str,
) -> None:
    """Through uvicorn itself: an upload that stops (before its first byte, or part-way) gets
    408 once no part has come for the idle timeout, its connection is closed, and the place it
    held in flight serves the next call."""
    monkeypatch.setattr(body, "BODY_IDLE_TIMEOUT_S", 0.3)
    plane.start([])
    frontend, port = await started(create_app(plane, flight=InFlight(1)))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post(b"", path=path).replace(b"Content-Length: 0", b"Content-Length: 4096") + sent.encode())
        status, headers, answer = await read_response(reader)
        assert status == 408 and headers["connection"] == "close"
        error = orjson.loads(answer)["error"]
        assert "no part of the request body came for 0.3 s" in (error if isinstance(error, str) else error["message"])
        assert await asyncio.wait_for(reader.read(), 5) == b"", "the server closed the connection"
        writer.close()
        assert (await exchange(port, post(infer_body(2.0))))[0] == 200
    finally:
        await frontend.drain()


async def test_a_body_that_came_with_its_head_is_read_with_no_timer(
    plane: DataPlane, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The idle timeout costs a timer (microseconds a request): a body already received, as
    most are, is read without one."""
    timed: list[object] = []
    real = body.within_idle_timeout
    monkeypatch.setattr(body, "within_idle_timeout", lambda part: timed.append(part) or real(part))
    plane.start([])
    frontend, port = await started(create_app(plane))
    try:
        assert (await exchange(port, post(infer_body(2.0))))[0] == 200
        assert timed == []
    finally:
        await frontend.drain()


@pytest.mark.parametrize("how", ["100-continue", "HTTP/1.0", "Connection: close"])
async def test_a_refused_client_that_cannot_go_on_is_closed(
    one_slot: tuple[int, asyncio.Task[tuple[int, bytes]]], how: str
) -> None:
    port, _ = one_slot
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if how == "100-continue":
        writer.write(post(b"", "Expect: 100-continue").replace(b"Content-Length: 0", b"Content-Length: 64"))
    elif how == "HTTP/1.0":
        writer.write(post(infer_body(1.0), version="1.0"))
    else:
        writer.write(post(infer_body(1.0), "Connection: close"))
    status, headers, _ = await read_response(reader)
    assert status == 429 and headers["connection"] == "close"
    assert await asyncio.wait_for(reader.read(), 5) == b"", "the server closed the connection"
    writer.close()


@pytest.mark.parametrize("how", ["inline", "too-big-for-inline", "body-later"])
async def test_a_full_queue_is_refused_with_its_model_and_counted(root: Path, gate: Gate, how: str) -> None:
    """A small call whose body comes with its head is refused as it starts; one too big to
    answer inline, or whose body has not come yet, at the door, before its body is read (the
    rest of it dropped as it comes, the connection kept)."""
    write_spin_model(root, "bounded", dynamic_batching={"max_queue_delay_microseconds": 0,
                                                        "default_queue_policy": {"max_queue_size": 1}})
    plane = DataPlane(ModelRepository(root))
    plane.start(["bounded"])
    await eventually(plane.server_ready, "the model is ready")
    frontend, port = await started(create_app(plane))
    path = "/v2/models/bounded/infer"
    model = plane.repository.get("bounded")
    held = asyncio.create_task(exchange(port, post(infer_body(HOLD), path=path)))
    await eventually(gate.held.is_set, "a request holds the instance")
    queued = asyncio.create_task(exchange(port, post(infer_body(2.0), path=path)))
    await eventually(lambda: model.queue_depth == 1, "a request waits")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        refused = post(orjson.dumps(orjson.loads(infer_body(3.0)) | {"id": "x" * 17_000 if how == "too-big-for-inline" else "small"}),
                       path=path)
        head, _, body = refused.partition(b"\r\n\r\n")
        writer.write(head + b"\r\n\r\n" if how == "body-later" else refused)
        status, headers, content = await read_response(reader)  # for body-later: before its body is sent
        assert status == 429 and "queue of this model is full (1 requests waiting)" in orjson.loads(content)["error"]
        assert headers["retry-after"] == "1"
        assert plane.statistics("bounded", None)["model_stats"][0]["failures"]["queue_full"] == 1
        if how == "body-later":
            writer.write(body + get("/v2/health/live"))
            assert (await read_response(reader))[0] == 200, "the body was dropped, the connection kept in step"
    finally:
        writer.close()
        gate.released.set()
        assert [(await t)[0] for t in (held, queued)] == [200, 200]
        await frontend.drain()
        await plane.stop()
    assert 3.0 not in gate.ran()


class RefusesMarked(Door):
    """The door's protocol under test on its own: refuses requests that carry `x-refuse`."""

    def __init__(self) -> None:
        pass

    def decide(self, scope: Any) -> Refused | Admitted | None:
        return Refused(b'{"error":"marked"}', "1", False) if (b"x-refuse", b"1") in scope["headers"] else None


async def test_a_refused_request_taken_from_the_pipeline_lets_the_next_one_run(
    plane: DataPlane, gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    plane.start([])
    monkeypatch.setattr(Door, "of", classmethod(lambda cls, app: RefusesMarked()))
    frontend, port = await started(create_app(plane))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        # held in the engine, then two requests pipelined behind it on the same connection
        writer.write(post(infer_body(HOLD)))
        await eventually(gate.held.is_set, "the first request holds the instance")
        writer.write(post(infer_body(1.0), "x-refuse: 1") + post(infer_body(2.0)))
        await asyncio.sleep(0.2)
        gate.released.set()
        statuses = [(await asyncio.wait_for(read_response(reader), 10))[0] for _ in range(3)]
        assert statuses == [200, 429, 200]
    finally:
        writer.close()
        await frontend.drain()


async def test_a_refusal_never_lets_a_later_pipelined_request_overtake_one_still_running(
    plane: DataPlane, gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused A, then B (held in the engine), then C behind it, in one write: the answers come
    A, B, C. Releasing the pipeline on A's refusal would start C while B still runs, and the
    client would read C's answer as B's."""
    plane.start([])
    monkeypatch.setattr(Door, "of", classmethod(lambda cls, app: RefusesMarked()))
    frontend, port = await started(create_app(plane))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(post(infer_body(1.0), "x-refuse: 1") + post(infer_body(HOLD)) + get("/v2/health/ready"))
        assert (await asyncio.wait_for(read_response(reader), 10))[0] == 429
        await eventually(gate.held.is_set, "B holds the instance")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(read_response(reader), 0.5)  # nothing may come before B's answer
        gate.released.set()
        status, _, body = await asyncio.wait_for(read_response(reader), 10)
        assert status == 200 and orjson.loads(body)["outputs"][0]["data"] == [HOLD], "B's answer second"
        status, _, body = await asyncio.wait_for(read_response(reader), 10)
        assert status == 200 and body == b"{}", "C's answer last"
    finally:
        writer.close()
        await frontend.drain()


async def test_what_the_door_leaves_to_the_app(plane: DataPlane) -> None:
    plane.start([])
    gate = create_app(plane, flight=InFlight(1), access=AccessPolicy(inference_token=TOKEN))
    door = Door.of(gate)
    assert door is not None
    endpoint = gate.app.endpoint  # type: ignore[attr-defined]
    endpoint.flight.requests = 1  # over the bound: an infer call would be refused

    def scope(method: str, path: str, *headers: tuple[bytes, bytes]) -> dict[str, Any]:
        return {"type": "http", "method": method, "path": path, "headers": list(headers), "client": None}

    bearer = (b"authorization", f"Bearer {TOKEN}".encode())
    length = (b"content-length", b"12")
    refused = door.decide(scope("POST", "/v2/models/spin/infer", bearer))
    assert isinstance(refused, Refused) and refused.retry_after == "1" and not refused.close
    assert door.decide(scope("POST", "/v2/models/spin/infer", bearer, (b"expect", b"100-Continue"))) == Refused(
        refused.body, "1", True), "a client waiting for 100 Continue may never send its body: closed"
    assert door.decide(scope("POST", "/v2/models/spin/infer")) is None, "no token: the gate answers 401 first"
    assert door.decide(scope("GET", "/v2/models/spin", bearer)) is None
    assert door.decide(scope("POST", "/v2/repository/index", bearer)) is None
    endpoint.flight.requests = 0
    assert door.decide(scope("POST", "/v2/models/spin/versions/2/infer", bearer, length)) == Admitted(
        "spin", "2", {b"authorization": bearer[1], b"content-length": b"12"}, 12, True), "within bounds: to the endpoint"
    assert door.decide(scope("POST", "/v2/models/unknown/infer", bearer)) == Admitted(
        "unknown", None, {b"authorization": bearer[1]}, endpoint.reservation(None), False), "the endpoint answers 404"
    big = (b"content-length", b"16385")
    assert not door.decide(scope("POST", "/v2/models/spin/infer", bearer, big)).inline, "too big to parse inline"
    for header in [(b"content-encoding", b"gzip"), (b"expect", b"100-continue")]:
        assert not door.decide(scope("POST", "/v2/models/spin/infer", bearer, length, header)).inline, header
    assert INFER_PATH.fullmatch("/v2/models/spin/versions/1/infer")


async def test_an_admitted_infer_call_goes_to_the_endpoint_past_the_apps_layers(
    plane: DataPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gate and the router asked once, at the door, not again per call; every other request,
    and an infer call the gate refuses, still goes through them."""
    plane.start([])
    app = create_app(plane, access=AccessPolicy(inference_token=TOKEN))
    routed: list[str] = []
    route = FastInferApp.__call__

    async def counted(self: FastInferApp, scope: Any, receive: Any, send: Any) -> None:
        routed.append(scope["path"])
        await route(self, scope, receive, send)

    monkeypatch.setattr(FastInferApp, "__call__", counted)
    frontend, port = await started(app)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    bearer = f"Authorization: Bearer {TOKEN}"
    try:
        writer.write(post(infer_body(1.0), bearer))
        status, _, body = await read_response(reader)
        assert status == 200 and orjson.loads(body)["outputs"][0]["data"] == [1.0]
        writer.write(post(infer_body(1.0), bearer, path="/v2/models/unknown/infer"))
        assert (await read_response(reader))[0] == 404, "the endpoint answers an unknown model"
        assert routed == [], "admitted infer calls never reach the router"
        writer.write(post(infer_body(1.0)))
        status, headers, _ = await read_response(reader)
        assert status == 401 and "bearer" in headers["www-authenticate"].lower(), "the gate answers, as before"
        writer.write(get("/v2/health/live"))
        assert (await read_response(reader))[0] == 200
        assert routed == ["/v2/health/live"], "the gate's refusal is its own; the rest is routed"
    finally:
        writer.close()
        await frontend.drain()


async def test_a_head_request_refused_by_the_gate_gets_no_body_and_its_connection_stays_in_step(
    plane: DataPlane,
) -> None:
    """A HEAD answer is its head alone: a body after it would be read as the next answer."""
    plane.start([])
    frontend, port = await started(create_app(plane, access=AccessPolicy(inference_token=TOKEN)))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"HEAD /v2/models/spin HTTP/1.1\r\nHost: batchline\r\n\r\n" + get("/v2/health/live"))
        status = int((await asyncio.wait_for(reader.readline(), ANSWER_WITHIN_S)).split()[1])
        head = []
        while (line := await asyncio.wait_for(reader.readline(), ANSWER_WITHIN_S)) != b"\r\n":
            head.append(line.lower())
        assert status == 401 and any(line.startswith(b"content-length: ") for line in head)
        status, _, body = await read_response(reader)
        assert (status, body) == (200, b"{}"), "the next answer follows the HEAD answer's head at once"
    finally:
        writer.close()
        await frontend.drain()


async def test_a_client_that_leaves_after_sending_a_large_body_has_its_queued_call_dropped(
    plane: DataPlane, gate: Gate,
) -> None:
    """The last part of a body, past uvicorn's high-water mark, pauses reading, which only the
    app's next receive would resume: the endpoint, with the whole body, asks no more, so the
    client's leaving went unread and its queued call ran anyway."""
    plane.start([])
    frontend, port = await started(create_app(plane))
    model = plane.repository.get("spin")
    try:
        held = asyncio.create_task(exchange(port, post(infer_body(HOLD))))
        await eventually(gate.held.is_set, "a request holds the instance")
        request = post(infer_body(5.0) + b" " * (200 << 10))  # valid JSON, 200 KiB of it whitespace
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request[:-(180 << 10)])
        # read, and the endpoint waits for the rest: on loopback it comes in one piece past the
        # high-water mark (were it split, the test would pass without the case it is for)
        await asyncio.sleep(0.3)
        writer.write(request[-(180 << 10):])
        await eventually(lambda: model.queue_depth == 1, "the large request is queued")
        writer.close()
        await eventually(lambda: model.queue_depth == 0, "the large request is dropped when its client leaves")
        assert plane.statistics("spin", None)["model_stats"][0]["failures"] == {"cancelled": 1}
        gate.released.set()
        assert (await held)[0] == 200
        assert gate.ran() == [HOLD], "the engine ran a request whose client had left"
    finally:
        gate.released.set()
        await frontend.drain()


async def test_a_head_past_its_limit_is_refused_and_requests_pipelined_in_one_read_are_not(
    plane: DataPlane, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A header of megabytes took the parser quadratic time to join, on the event loop; many
    small requests in one read are not one large head."""
    monkeypatch.setattr(door, "MAX_PIPELINED", 5000)  # all of them queued, as a head would be read
    plane.start([])
    frontend, port = await started(create_app(plane))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: batchline\r\nX-Big: ")

        async def send_on() -> None:  # 4 MiB of one header, a piece at a time, until the server closes
            with contextlib.suppress(ConnectionError):
                for _ in range(32):
                    writer.write(b"x" * (128 << 10))
                    await writer.drain()

        sending = asyncio.create_task(send_on())
        status, headers, body = await read_response(reader)
        assert status == 431 and headers["connection"] == "close"
        assert "line and headers exceed" in orjson.loads(body)["error"]
        await asyncio.wait_for(sending, ANSWER_WITHIN_S)
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: batchline\r\nX-Big: " + b"x" * (200 << 10))
        assert (await read_response(reader))[0] == 431  # in one write: the read that begins a head counts
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v2/repository/index HTTP/1.1\r\nHost: batchline\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-Trailer: ")
        sending = asyncio.create_task(send_on())  # trailers are joined as headers are: counted the same
        with contextlib.suppress(ConnectionResetError):  # closed, with the rest unread: a reset
            await asyncio.wait_for(reader.read(), ANSWER_WITHIN_S)  # until the server closes, not hangs
        await asyncio.wait_for(sending, ANSWER_WITHIN_S)
        writer.close()
        near = b"GET /v2/health/live HTTP/1.1\r\nHost: batchline\r\nX-Near: " + b"x" * (60 << 10) + b"\r\n\r\n"
        flood = get("/v2/health/live") * 3000  # about 150 KB in a read or two
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(near + flood)
        for _ in range(3001):
            assert (await read_response(reader))[0] == 200
        writer.close()
    finally:
        await frontend.drain()


@pytest.fixture
def protocols(monkeypatch: pytest.MonkeyPatch) -> list[HttpToolsProtocol]:
    """Every connection's protocol the server makes from now on."""
    made: list[HttpToolsProtocol] = []
    init = HttpToolsProtocol.__init__

    def recorded(self: HttpToolsProtocol, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(HttpToolsProtocol, "__init__", recorded)
    return made


async def test_a_client_that_pipelines_and_reads_no_answers_is_not_read_ahead_of_them(
    plane: DataPlane, protocols: list[HttpToolsProtocol],
) -> None:
    """uvicorn reads on after each answer, though requests are queued behind it: a client that
    pipelined and read nothing had the server read a read's worth of requests (thousands of small
    ones) for every answer, each queued with its state, and its memory grew by a gigabyte in
    seconds. Reading stays paused until the queued requests are answered."""
    plane.start([])
    frontend, port = await started(create_app(plane))
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(get("/v2/health/live") * 40_000)  # about 1.7 MB; the answers are never read
        deepest = 0
        for _ in range(150):
            await asyncio.sleep(0.01)
            deepest = max(deepest, *(len(protocol.pipeline) for protocol in protocols))
        assert 0 < deepest <= door.MAX_PIPELINED, deepest
        writer.close()
        assert (await exchange(port, get("/v2/health/live")))[0] == 200
    finally:
        await frontend.drain()


async def test_requests_pipelined_past_the_bound_are_dropped_and_the_connection_ends_after_the_rest(
    plane: DataPlane, protocols: list[HttpToolsProtocol], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The parser took a whole read (256 KiB: about 6,000 small requests) and queued every
    request in it with its state: 100 connections that pipelined GETs and read nothing held 570
    MB. Past MAX_PIPELINED queued, the rest is dropped; the queued are answered, then the
    server's side closes (an end the client reads after its answers, not a reset), what still
    comes is read and dropped, and the connection is closed LINGER_S later."""
    monkeypatch.setattr(door, "LINGER_S", 0.5)
    plane.start([])
    frontend, port = await started(create_app(plane))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(get("/v2/health/live") * 1000)  # in one read or a few: past the bound either way
        await writer.drain()
        answered = await _answers_until_the_end(reader)
        assert answered.count(200) == len(answered) and 1 + door.MAX_PIPELINED <= len(answered) < 1000
        writer.write(get("/v2/health/live") * 10)  # read and dropped, unanswered
        await eventually(lambda: protocols[0].transport.is_closing(), "the connection is closed after its linger")
        writer.close()
        assert (await exchange(port, get("/v2/health/live")))[0] == 200  # other connections are served
    finally:
        await frontend.drain()


async def test_a_body_that_comes_after_the_bound_is_dropped_unread_and_the_rest_answered(
    plane: DataPlane, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Queued requests read through the app turn reading back on while they are answered; a
    dropped request's body that then came was parsed, counted as a head and refused (431, the
    connection closed under the answers still due), or, during the linger, written to after
    the server's side had closed (an error logged, the connection reset). Past the bound,
    nothing more is parsed."""
    monkeypatch.setattr(door, "LINGER_S", 0.5)
    loop_errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: loop_errors.append(context))
    plane.start([])
    frontend, port = await started(create_app(plane))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        big = 4 << 20
        writer.write(post(b"{}", path="/v2/repository/index") * (1 + door.MAX_PIPELINED)
                     + f"POST /v2/models/spin/infer HTTP/1.1\r\nHost: b\r\nContent-Length: {big}\r\n\r\n".encode())
        for _ in range(big // (64 << 10)):
            writer.write(b" " * (64 << 10))
            await writer.drain()
        answered = await _answers_until_the_end(reader)
        assert answered == [200] * (1 + door.MAX_PIPELINED)
        writer.close()
        assert loop_errors == []
    finally:
        await frontend.drain()


async def _answers_until_the_end(reader: asyncio.StreamReader) -> list[int]:
    """The statuses of the answers a connection gives until the server ends it (an end, not a
    reset: a reset raises here)."""
    everything = await asyncio.wait_for(reader.read(), ANSWER_WITHIN_S)
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", everything)]
