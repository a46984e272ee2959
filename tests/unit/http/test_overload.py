"""Overload at the ASGI level: the in-flight cap answers 429 before the body is read, a full
queue refuses before the body is parsed, control-plane bodies are capped, and a big body is
parsed off the event loop. Engines are held by input (the gate), never by time."""

from __future__ import annotations

import asyncio
import gzip
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import orjson
import pytest

from server.dataplane import DataPlane
from server.errors import DeadlineExceeded, InvalidInput, ServerBusy, Unavailable
from server.grpc.protos import grpc_service_pb2 as pb
from server.grpc.servicer import InferCall, InferenceServicer, _Stream, stream_share
from server.http import v2_infer
from server.http.app import create_app
from server.http.infer import CONTROL_BODY_BYTES, FastInferApp, InferEndpoint
from server.inflight import BUSY_MESSAGE, HELD_AHEAD, InFlight
from server.protocol.v2 import decode_request
from server.repository import ModelRepository
from tests.unit.http.conftest import HOLD, Exchange, Gate, infer_body
from tests.unit.http.tiny_models import write_spin_model
from tests.unit.waiting import eventually

T = TypeVar("T")

LIMIT = 64 << 20


async def unreachable(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError(f"{scope['path']} should have been served by the infer endpoint")


async def call(app: Callable[..., Any], exchange: Exchange) -> Exchange:
    await asyncio.wait_for(app(exchange.scope, exchange.receive, exchange.send), 30)
    return exchange


async def held(app: FastInferApp, gate: Gate) -> tuple[asyncio.Task[Exchange], Exchange]:
    """A request whose batch waits in the engine until the gate is released."""
    exchange = Exchange.of(infer_body(HOLD))
    task = asyncio.create_task(call(app, exchange))
    await eventually(gate.held.is_set, "the held request is in the engine")
    return task, exchange


def assert_busy(exchange: Exchange) -> None:
    assert exchange.status == 429, exchange.sent
    assert exchange.headers["retry-after"] == "1"
    assert "in flight" in exchange.json()["error"]
    assert exchange.receive_calls == 0, "the body of a refused request was read"


async def test_past_max_in_flight_a_request_is_refused_before_its_body_is_read(plane: DataPlane, gate: Gate) -> None:
    endpoint = InferEndpoint(plane, LIMIT, flight=InFlight(1))
    app = FastInferApp(unreachable, endpoint)
    task, first = await held(app, gate)
    assert endpoint.flight.requests == 1
    refused = await call(app, Exchange.of(infer_body(1.0)))
    assert_busy(refused)
    assert "connection" not in refused.headers  # uvicorn drains the unread body and keeps the connection
    gate.released.set()
    await task
    assert first.status == 200 and first.json()["outputs"][0]["data"] == [HOLD]
    assert endpoint.flight.requests == 0 and endpoint.flight.bytes == 0
    assert (await call(app, Exchange.of(infer_body(2.0)))).status == 200


async def test_past_max_in_flight_bytes_the_declared_length_is_refused(plane: DataPlane, gate: Gate) -> None:
    body = infer_body(HOLD)
    endpoint = InferEndpoint(plane, LIMIT, flight=InFlight(100, len(body) + 10))
    app = FastInferApp(unreachable, endpoint)
    task, _ = await held(app, gate)
    assert endpoint.flight.bytes == len(body)
    assert_busy(await call(app, Exchange.of(infer_body(1.0, 2.0))))
    # no declared length: let in, and refused as its part arrives with no room for it
    chunked = Exchange([{"type": "http.request", "body": infer_body(1.0), "more_body": False}])
    await call(app, chunked)
    assert chunked.status == 429 and chunked.headers["retry-after"] == "1", chunked.sent
    assert "in flight" in chunked.json()["error"]
    assert endpoint.flight.bytes == len(body) and endpoint.flight.requests == 1
    gate.released.set()
    await task
    assert endpoint.flight.bytes == 0


class Trickle(Exchange):
    """A client sending a body (without a Content-Length unless `headers` declare one), a part
    whenever the test says."""

    def __init__(self, headers: dict[str, str] | None = None) -> None:
        super().__init__([], headers)
        self.parts: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    def send_part(self, body: bytes, more: bool) -> None:
        self.parts.put_nowait({"type": "http.request", "body": body, "more_body": more})

    async def receive(self) -> dict[str, Any]:
        self.receive_calls += 1
        return await self.parts.get()


async def test_a_body_without_a_declared_length_holds_only_what_has_arrived(plane: DataPlane) -> None:
    """Counted as the body limit from its head on, a few clients trickling bodies held the whole
    byte bound, and every other call was refused meanwhile."""
    flight = InFlight(100, 1000)
    app = FastInferApp(unreachable, InferEndpoint(plane, LIMIT, flight=flight))
    body = infer_body(1.0)
    trickles = [Trickle() for _ in range(3)]
    tasks = [asyncio.create_task(call(app, t)) for t in trickles]
    for trickle in trickles:
        trickle.send_part(body[:10], more=True)
    await eventually(lambda: flight.bytes == 30, "each holds the 10 bytes it sent")
    served = await call(app, Exchange.of(infer_body(2.0)))
    assert served.status == 200 and served.json()["outputs"][0]["data"] == [2.0]
    for trickle in trickles:
        trickle.send_part(body[10:], more=False)
    await asyncio.gather(*tasks)
    assert [t.json()["outputs"][0]["data"] for t in trickles] == [[1.0]] * 3
    assert flight.requests == 0 and flight.bytes == 0


async def test_a_declared_body_holds_only_what_has_arrived_past_what_is_held_ahead(plane: DataPlane) -> None:
    """Counted whole from its head on, a few clients that declared big bodies and sent a byte
    now and then held the whole byte bound, and every other call was refused meanwhile. Each is
    let in where there is room for all it declared, and holds at most HELD_AHEAD until its bytes
    come; then what came."""
    declared = 1 << 20
    flight = InFlight(100, 2 * declared)
    app = FastInferApp(unreachable, InferEndpoint(plane, LIMIT, flight=flight))
    body = infer_body(1.0)
    body += b" " * (declared - len(body))  # JSON's whitespace, to the declared length
    trickles = [Trickle({"content-length": str(declared)}) for _ in range(3)]
    tasks = [asyncio.create_task(call(app, t)) for t in trickles]
    for trickle in trickles:
        trickle.send_part(body[:10], more=True)
    await eventually(lambda: flight.requests == 3, "all three are let in")
    assert flight.bytes == 3 * HELD_AHEAD
    served = await call(app, Exchange.of(infer_body(2.0)))
    assert served.status == 200 and served.json()["outputs"][0]["data"] == [2.0]
    for trickle, task in zip(trickles, tasks):  # one at a time: two whole bodies would not fit
        trickle.send_part(body[10:], more=False)
        await task
        assert trickle.status == 200 and trickle.json()["outputs"][0]["data"] == [1.0], trickle.sent
    assert flight.requests == 0 and flight.bytes == 0


async def test_a_declared_body_is_refused_as_it_comes_when_others_took_its_room(plane: DataPlane) -> None:
    """Let in with room for all of it, a body longer than what it holds ahead can find that room
    taken by the time its bytes come: refused then (429), as a body of no declared length is."""
    declared = 1 << 20
    flight = InFlight(100, declared + HELD_AHEAD)
    app = FastInferApp(unreachable, InferEndpoint(plane, LIMIT, flight=flight))
    body = infer_body(1.0)
    body += b" " * (declared - len(body))
    slow, fast = (Trickle({"content-length": str(declared)}) for _ in range(2))
    slow_task = asyncio.create_task(call(app, slow))
    slow.send_part(body[:10], more=True)
    await eventually(lambda: flight.requests == 1, "the slow one is let in")
    fast_task = asyncio.create_task(call(app, fast))
    fast.send_part(body[:-10], more=True)
    await eventually(lambda: flight.bytes == HELD_AHEAD + declared - 10, "the fast one holds what it sent")
    slow.send_part(body[10:], more=False)
    await slow_task
    assert slow.status == 429 and "in flight" in slow.json()["error"], slow.sent
    fast.send_part(body[-10:], more=False)
    await fast_task
    assert fast.status == 200, fast.sent
    assert flight.requests == 0 and flight.bytes == 0


async def test_a_compressed_body_holds_the_limit_only_while_it_inflates(plane: DataPlane, gate: Gate) -> None:
    """What it inflates to is not known from its head: while it inflates it holds the body
    limit more, so other requests' room is never overdrawn; once inflated, what it holds is
    its inflated size, for as long as it waits."""
    flight = InFlight(100, LIMIT + (1 << 20))
    app = FastInferApp(unreachable, InferEndpoint(plane, LIMIT, flight=flight))
    body = infer_body(HOLD)
    compressed = Exchange.of(gzip.compress(body), {"content-encoding": "gzip"})
    task = asyncio.create_task(call(app, compressed))
    await eventually(gate.held.is_set, "the inflated request is in the engine")
    assert flight.bytes == len(body)
    another = Exchange.of(gzip.compress(infer_body(1.0)), {"content-encoding": "gzip"})
    queued = asyncio.create_task(call(app, another))  # room for the limit beside the first: let in
    await eventually(lambda: flight.bytes == len(body) + len(infer_body(1.0)), "both hold their inflated bodies")
    gate.released.set()
    await asyncio.gather(task, queued)
    assert compressed.json()["outputs"][0]["data"] == [HOLD]
    assert another.json()["outputs"][0]["data"] == [1.0]
    assert flight.requests == 0 and flight.bytes == 0
    # no room for the limit beside what others hold: refused before it inflates
    small = InFlight(100, 1 << 20)
    hold = small.hold(1)
    refused = await call(FastInferApp(unreachable, InferEndpoint(plane, LIMIT, flight=small)),
                         Exchange.of(gzip.compress(infer_body(1.0)), {"content-encoding": "gzip"}))
    assert refused.status == 429, refused.sent
    assert small.bytes == 1
    hold.release()


def test_a_hold_grows_within_the_bound_and_lets_go_of_what_it_no_longer_holds() -> None:
    flight = InFlight(10, 100)
    first = flight.hold(60)
    second = flight.hold(30)
    second.hold_to(40)
    assert flight.bytes == 100
    with pytest.raises(ServerBusy):
        second.hold_to(41)
    assert (flight.bytes, second.nbytes) == (100, 40)
    first.hold_to(10)
    assert flight.bytes == 50
    first.release()
    second.hold_to(10_000)  # alone, it grows past the bound, as a lone request is let in past it
    assert flight.bytes == 10_000
    second.release()
    assert (flight.requests, flight.bytes) == (0, 0)


async def test_a_lone_request_larger_than_the_byte_budget_is_served(plane: DataPlane) -> None:
    app = FastInferApp(unreachable, InferEndpoint(plane, LIMIT, flight=InFlight(max_bytes=8)))
    assert (await call(app, Exchange.of(infer_body(1.0)))).status == 200


async def test_every_front_end_takes_from_the_one_in_flight_bound(plane: DataPlane, gate: Gate) -> None:
    """A v2 request holds the server's only place in flight: an OpenAI embeddings call is
    refused 429 in OpenAI's shape before its body is read, and a gRPC infer call with
    RESOURCE_EXHAUSTED (ServerBusy) before its tensors are decoded. Once it is answered, both
    bounds are free again."""
    flight = InFlight(1)
    app = create_app(plane, flight=flight)
    task, _ = await held(app, gate)  # type: ignore[arg-type]
    embeddings = await call(app, Exchange.of(b'{"model": "spin", "input": "x"}', path="/v1/embeddings"))
    assert embeddings.status == 429, embeddings.sent
    assert embeddings.headers["retry-after"] == "1"
    assert embeddings.json()["error"]["code"] == "rate_limit_exceeded"
    assert embeddings.receive_calls == 0, "the body of a refused request was read"
    servicer = InferenceServicer(plane, flight=flight)
    request = InferCall(pb.ModelInferRequest(model_name="spin").SerializeToString())
    with pytest.raises(ServerBusy):
        await servicer._infer(request, None, None, time.perf_counter_ns())
    gate.released.set()
    await task
    assert flight.requests == 0 and flight.bytes == 0
    with pytest.raises(InvalidInput):  # let in now: refused for what it is (no inputs), not for room
        await servicer._infer(request, None, None, time.perf_counter_ns())
    assert flight.requests == 0 and flight.bytes == 0


async def test_a_stopping_server_at_its_bound_says_503_not_429(plane: DataPlane, gate: Gate) -> None:
    """A 429 tells the client to retry here in a second, where no server will be: once a stop
    is asked for, every front end says 503 (UNAVAILABLE), as it does with room to spare."""
    flight = InFlight(1)
    app = create_app(plane, flight=flight)
    task, _ = await held(app, gate)  # type: ignore[arg-type]
    plane.begin_stop()
    refused = await call(app, Exchange.of(infer_body(1.0)))
    assert refused.status == 503 and "shutting down" in refused.json()["error"], refused.sent
    waiting = await call(app, Exchange.of(infer_body(1.0), {"expect": "100-continue"}))
    assert waiting.status == 503 and waiting.headers["connection"] == "close"
    embeddings = await call(app, Exchange.of(b'{"model": "spin", "input": "x"}', path="/v1/embeddings"))
    assert embeddings.status == 503, embeddings.sent
    with pytest.raises(Unavailable, match="shutting down"):
        await InferenceServicer(plane, flight=flight)._infer(
            InferCall(pb.ModelInferRequest(model_name="spin").SerializeToString()), None, None, time.perf_counter_ns())
    gate.released.set()
    await task


async def test_a_client_waiting_for_100_continue_is_refused_with_connection_close(
    plane: DataPlane, gate: Gate
) -> None:
    """It may never send the body it announced; its connection cannot be reused."""
    app = FastInferApp(unreachable, InferEndpoint(plane, LIMIT, flight=InFlight(1)))
    task, _ = await held(app, gate)
    refused = await call(app, Exchange.of(infer_body(1.0), {"expect": "100-continue"}))
    assert_busy(refused)
    assert refused.headers["connection"] == "close"
    gate.released.set()
    await task


class SlowBody(Exchange):
    """A client whose body arrives 300 ms after its head."""

    async def receive(self) -> dict[str, Any]:
        if self.receive_calls == 0:
            await asyncio.sleep(0.3)
        return await super().receive()


async def test_a_timeout_counts_from_the_requests_head_not_from_its_parsed_body(plane: DataPlane) -> None:
    """The client waits from when it sent the request: a 100 ms timeout whose body took 300 ms to
    arrive has passed before the request could run, and is answered 504, not run."""
    app = FastInferApp(unreachable, InferEndpoint(plane, LIMIT))
    body = infer_body(1.0, timeout=100_000)
    late = await call(app, SlowBody([{"type": "http.request", "body": body, "more_body": False}],
                                    {"content-length": str(len(body))}))
    assert late.status == 504, late.sent
    assert "deadline passed" in late.json()["error"]
    in_time = await call(app, SlowBody([{"type": "http.request", "body": infer_body(2.0, timeout=2_000_000),
                                         "more_body": False}]))
    assert in_time.status == 200, in_time.sent


async def test_a_full_queue_refuses_before_the_body_is_parsed(
    root: Path, gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_spin_model(root, "spin", dynamic_batching={"max_queue_delay_microseconds": 0,
                                                     "default_queue_policy": {"max_queue_size": 1}})
    repository = ModelRepository(root)
    await repository.load("spin")
    plane = DataPlane(repository)
    app = FastInferApp(unreachable, InferEndpoint(plane, LIMIT))
    try:
        running, _ = await held(app, gate)
        queued = asyncio.create_task(call(app, Exchange.of(infer_body(1.0))))
        model = repository.get("spin")
        await eventually(lambda: model.queue_depth == 1, "one request waits in the queue")
        parsed: list[bytes] = []
        real = v2_infer.parse_request
        monkeypatch.setattr(v2_infer, "parse_request", lambda body, length: parsed.append(body) or real(body, length))
        refused = await call(app, Exchange.of(infer_body(2.0)))
        assert refused.status == 429 and refused.headers["retry-after"] == "1"
        assert "queue of this model is full" in refused.json()["error"]
        assert parsed == [], "a request refused for a full queue was parsed"
        assert plane.statistics("spin", None)["model_stats"][0]["failures"]["queue_full"] == 1
        gate.released.set()
        assert (await running).status == 200 and (await queued).status == 200
    finally:
        gate.released.set()
        await repository.unload_all()


def for_starlette(exchange: Exchange) -> Exchange:
    """The scope keys a framework route reads, beyond what the bare endpoint needs."""
    exchange.scope.update(query_string=b"", http_version="1.1", scheme="http", root_path="",
                          server=("127.0.0.1", 8000))
    return exchange


async def test_control_plane_bodies_are_capped(plane: DataPlane) -> None:
    app = create_app(plane)
    big = b"{" + b" " * CONTROL_BODY_BYTES + b"}"
    declared = await call(app, Exchange.of(big, {"content-type": "application/json"}, path="/v2/repository/index"))
    assert declared.status == 413 and "control plane" in declared.json()["error"]
    assert declared.receive_calls == 0
    half = len(big) // 2
    chunked = for_starlette(Exchange(
        [{"type": "http.request", "body": big[:half], "more_body": True},
         {"type": "http.request", "body": big[half:], "more_body": False}],
        {"content-type": "application/json"},
        path="/v2/repository/index",
    ))
    await call(app, chunked)
    assert chunked.status == 413 and "control plane" in chunked.json()["error"]
    small = await call(app, for_starlette(Exchange.of(b"{}", {"content-type": "application/json"},
                                                      path="/v2/repository/index")))
    assert small.status == 200


def nested_body(items: int) -> bytes:
    """Under 1 MiB of JSON that is slow to decode: one nested list per value."""
    return orjson.dumps({"inputs": [{"name": "x", "shape": [items, 1], "datatype": "FP32", "data": [[0]] * items}]})


async def test_a_big_body_under_1_mib_does_not_stall_the_event_loop(plane: DataPlane) -> None:
    """A ticker records the longest gap between its ticks while the request is handled: with
    the decode on the loop, the gap is the whole decode; off the loop, the longest single call
    that holds the GIL (orjson's parse, a slice of numpy's conversion) and a GIL switch. Both
    sides are the best of two, as this machine's other work can stretch either."""
    body = nested_body(200_000)
    assert len(body) < 1 << 20
    work_s = min(_timed(lambda: decode_request(body)) for _ in range(2))
    assert work_s > 0.03, f"the body decodes in {work_s * 1e3:.1f} ms: too fast to show a stall"
    app = FastInferApp(unreachable, InferEndpoint(plane, LIMIT))
    stalls = []
    for _ in range(2):
        refused, stall_s = await longest_gap_while(call(app, Exchange.of(body)))
        assert refused.status == 400 and "batch size 200000" in refused.json()["error"]
        stalls.append(stall_s)
    assert min(stalls) < work_s / 2, f"the loop stalled {min(stalls) * 1e3:.1f} ms for {work_s * 1e3:.1f} ms of decoding"


async def longest_gap_while(work: Coroutine[Any, Any, T]) -> tuple[T, float]:
    """What `work` returns, and the longest the event loop went without a turn meanwhile."""
    longest = 0.0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal longest
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            longest = max(longest, now - last)
            last = now

    ticks = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    try:
        result = await work
    finally:
        stop.set()
        await ticks
    return result, longest


async def test_a_full_server_refuses_a_grpc_message_before_parsing_it(plane: DataPlane, gate: Gate) -> None:
    """A message of millions of strings holds the event loop (and the GIL) while protobuf parses
    it: the refusals that need only its size come first, so a busy server spends nothing on it."""
    flight = InFlight(1)
    task, _ = await held(create_app(plane, flight=flight), gate)  # type: ignore[arg-type]
    servicer = InferenceServicer(plane, flight=flight)
    not_a_message = InferCall(b"\xff" * 100)
    with pytest.raises(ServerBusy):
        await servicer._infer(not_a_message, None, None, time.perf_counter_ns())
    gate.released.set()
    await task
    with pytest.raises(InvalidInput, match="not a ModelInferRequest"):
        await servicer._infer(not_a_message, None, None, time.perf_counter_ns())
    assert flight.requests == 0 and flight.bytes == 0


async def test_a_streamed_call_refused_before_parsing_is_answered_with_its_id(
    plane: DataPlane, gate: Gate,
) -> None:
    """A stream's client matches answers to requests by id: a call refused for room still names
    its id and model, read from the message without its tensors."""
    flight = InFlight(1)
    task, _ = await held(create_app(plane, flight=flight), gate)  # type: ignore[arg-type]
    answers: asyncio.Queue[Any] = asyncio.Queue()

    class Context:
        def time_remaining(self) -> None:
            return None

    message = pb.ModelInferRequest(model_name="spin", id="first").SerializeToString()
    await InferenceServicer(plane, flight=flight)._stream_one(message, Context(), answers)  # type: ignore[arg-type]
    answer = answers.get_nowait()
    assert answer.error_message == BUSY_MESSAGE
    assert (answer.infer_response.id, answer.infer_response.model_name) == ("first", "spin")
    gate.released.set()
    await task


class _StreamContext:
    """What ModelStreamInfer asks of its call's context, for a client with no token and no deadline."""

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def time_remaining(self) -> None:
        return None


async def test_a_stream_whose_client_reads_no_answers_is_read_no_further_than_its_share(plane: DataPlane) -> None:
    """A request of a stream held its place until it finished, not until its answer was sent: a
    client that sent and never read had its answers queued without bound (the server grew by 10 MB
    a second), and one stream could hold every place in flight. It holds a quarter of them, each
    until its answer is sent."""
    flight = InFlight(8)
    share = stream_share(flight.max_requests)
    assert share == 2 and stream_share(512) == 128 and stream_share(1) == 1
    request = pb.ModelInferRequest(model_name="spin", id="s")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 1])
    tensor.contents.fp32_contents.append(3.0)
    message = request.SerializeToString()
    sent = 0

    async def messages() -> AsyncIterator[bytes]:
        nonlocal sent
        while True:
            sent += 1
            yield message

    stream = InferenceServicer(plane, flight=flight).ModelStreamInfer(messages(), _StreamContext())  # type: ignore[arg-type]
    try:
        first = await asyncio.wait_for(stream.__anext__(), 10)
        assert list(first.infer_response.outputs[0].shape) == [1, 1] and not first.error_message
        await asyncio.sleep(0.3)  # the client reads nothing more
        assert sent <= share + 1, sent  # its share, and one message read that waits for a place
        await eventually(lambda: flight.requests == 0, "each request ran and gave back its place in flight")
        read_before = sent
        for _ in range(20):  # reading again, it is read again
            answer = await asyncio.wait_for(stream.__anext__(), 10)
            assert answer.infer_response.id == "s" and not answer.error_message, answer
        await eventually(lambda: sent >= read_before + 20, "a message read for each answer sent")
    finally:
        await stream.aclose()


async def test_a_streamed_request_cancelled_before_its_answer_gives_its_place_back() -> None:
    """Its answer will never be sent, which is when a place is otherwise given back."""
    stream = _Stream(1)
    await stream.room.acquire()
    task = asyncio.create_task(asyncio.sleep(10))
    stream.running.add(task)
    task.add_done_callback(stream.finished)
    task.cancel()
    await asyncio.wait_for(stream.room.acquire(), 5)
    assert not stream.running


def _timed(work: Callable[[], Any]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


async def test_a_grpc_call_whose_deadline_passed_on_arrival_is_counted_as_a_deadline(plane: DataPlane) -> None:
    """Refused before it reaches the batcher, it is counted as the batcher counts one it drops."""
    servicer = InferenceServicer(plane, flight=InFlight(4))
    request = pb.ModelInferRequest(model_name="spin")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 1])
    tensor.contents.fp32_contents.append(1.0)
    with pytest.raises(DeadlineExceeded):
        await servicer._infer(InferCall(request.SerializeToString()), 0.0001, None, time.perf_counter_ns())
    assert plane.statistics("spin", None)["model_stats"][0]["failures"] == {"deadline": 1}
