"""The bare infer endpoint at the ASGI level: body limits, Content-Encoding, the binary header
length, and clients that leave. Scripted `receive`, recording `send`, a real data plane over a
real (tiny) model whose engine the test can hold busy.
"""

from __future__ import annotations

import asyncio
import gzip
import struct
import threading
import tracemalloc
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pytest

from server.config import ModelConfig
from server.dataplane import DataPlane
from server.errors import InvalidInput
from server.http import infer, v2_infer
from server.http.app import create_app
from server.http.auth import AccessPolicy
from server.http.infer import MAX_GZIP_MEMBERS, FastInferApp, InferEndpoint, _decompressed
from server.metrics import build_registry, exposition
from tests.unit.http.conftest import HOLD, Exchange, Gate, infer_body
from tests.unit.waiting import eventually

LIMIT = 4096


async def unreachable(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError(f"{scope['path']} should have been served by the infer endpoint")


@pytest.fixture
def app(plane: DataPlane) -> FastInferApp:
    return FastInferApp(unreachable, InferEndpoint(plane, LIMIT))


async def call(app: Callable[..., Any], exchange: Exchange) -> Exchange:
    await asyncio.wait_for(app(exchange.scope, exchange.receive, exchange.send), 30)
    return exchange


def assert_error(exchange: Exchange, status: int, *words: str) -> None:
    """The KServe error shape: exactly {"error": "<message>"}, JSON, with the status asked."""
    assert exchange.status == status, exchange.sent
    assert exchange.headers["content-type"] == "application/json"
    document = exchange.json()
    assert list(document) == ["error"] and isinstance(document["error"], str)
    for word in words:
        assert word in document["error"], document["error"]


def stats(plane: DataPlane) -> dict[str, Any]:
    return plane.statistics("spin", None)["model_stats"][0]


def chunks(body: bytes, size: int) -> list[dict[str, Any]]:
    """The body as a stream of http.request messages, as a chunked upload arrives."""
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    return [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]


# --- 413 ------------------------------------------------------------------------------------


async def test_a_declared_length_over_the_limit_is_413_before_reading_the_body(app: FastInferApp, gate: Gate) -> None:
    exchange = Exchange([{"type": "http.request", "body": b"x" * 10, "more_body": True}],
                        {"content-length": str(LIMIT + 1)})
    await call(app, exchange)
    assert_error(exchange, 413, str(LIMIT))
    assert exchange.receive_calls == 0, "the body was read although its declared length is refused"
    assert gate.ran() == []


async def test_a_streamed_body_that_passes_the_limit_is_413_and_reading_stops(
    app: FastInferApp, plane: DataPlane, gate: Gate
) -> None:
    body = infer_body(1.0) + b" " * (3 * LIMIT)  # valid JSON, only too long
    exchange = Exchange(chunks(body, 1000))  # no Content-Length: transfer-encoding chunked
    await call(app, exchange)
    assert_error(exchange, 413, str(LIMIT))
    assert exchange.receive_calls == LIMIT // 1000 + 1, "reading went on past the limit"
    assert gate.ran() == [] and stats(plane)["failures"] == {}


async def test_a_streamed_body_within_the_limit_is_served(app: FastInferApp) -> None:
    exchange = await call(app, Exchange(chunks(infer_body(1.0, 2.0), 7)))
    assert exchange.status == 200, exchange.sent
    assert exchange.json()["outputs"][0]["data"] == [1.0, 2.0]


@pytest.mark.parametrize("encoding, compress", [("gzip", gzip.compress), ("deflate", zlib.compress)])
async def test_a_body_that_passes_the_limit_only_once_decompressed_is_413(
    app: FastInferApp, gate: Gate, encoding: str, compress: Callable[[bytes], bytes]
) -> None:
    body = compress(infer_body(1.0) + b" " * (3 * LIMIT))
    assert len(body) < LIMIT
    exchange = await call(app, Exchange.of(body, {"content-encoding": encoding}))
    assert_error(exchange, 413, "decompressed", str(LIMIT))
    assert gate.ran() == []


async def test_decompression_stops_at_the_limit_instead_of_inflating_a_bomb(plane: DataPlane) -> None:
    """A small gzip body may inflate to gigabytes: the server must give up at the limit, not
    after allocating everything (here 64 MiB from a body of about 64 KiB)."""
    limit = 128 << 10
    bomb = gzip.compress(b" " * (64 << 20), compresslevel=9)
    assert len(bomb) < limit
    app = FastInferApp(unreachable, InferEndpoint(plane, limit))
    tracemalloc.start()
    try:
        exchange = await call(app, Exchange.of(bomb, {"content-encoding": "gzip"}))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert_error(exchange, 413, "decompressed")
    assert peak < 16 << 20, f"decompressing allocated {peak >> 20} MiB for a limit of {limit >> 10} KiB"


async def test_a_large_compressed_body_is_inflated_off_the_event_loop(
    plane: DataPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inflating megabytes takes long enough to stall every other request on the loop."""
    threads: list[str] = []
    real = zlib.decompressobj

    def watched(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    small_body, large_body = gzip.compress(infer_body(1.0)), gzip.compress(infer_body(1.0) + b" " * 4096)
    assert len(small_body) < len(large_body)
    monkeypatch.setattr(infer.zlib, "decompressobj", watched)
    # inline only what cannot inflate past the threshold: deflate expands at most 1032 times
    monkeypatch.setattr(v2_infer, "INLINE_DECODE_BYTES", len(small_body) * 1032)
    app = FastInferApp(unreachable, InferEndpoint(plane, 1 << 20))
    small = await call(app, Exchange.of(small_body, {"content-encoding": "gzip"}))
    large = await call(app, Exchange.of(large_body, {"content-encoding": "gzip"}))
    assert small.status == large.status == 200
    main = threading.main_thread().name
    assert threads[0] == main and threads[-1] != main, threads


# --- Content-Encoding ------------------------------------------------------------------------


def raw_deflate(data: bytes) -> bytes:
    """RFC 1951 without the zlib wrapper: what some clients send as "deflate"."""
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


ENCODINGS: list[tuple[str | None, Callable[[bytes], bytes]]] = [
    (None, lambda b: b),
    ("identity", lambda b: b),
    ("gzip", gzip.compress),
    ("GZip", gzip.compress),
    ("x-gzip", gzip.compress),  # RFC 9110 8.4.1.3: recipients should treat it as gzip
    ("gzip", lambda b: gzip.compress(b[:10]) + gzip.compress(b[10:])),  # two members, as `cat a.gz b.gz`
    ("gzip", lambda b: b"".join(gzip.compress(b[i:i + 1]) for i in range(len(b)))),  # a member a byte
    ("deflate", zlib.compress),  # RFC 9110: zlib-wrapped; tritonclient and curl send this
    ("deflate", raw_deflate),  # bare deflate: some clients do
]


@pytest.mark.parametrize("encoding, compress", ENCODINGS)
async def test_every_supported_content_encoding_is_served(
    app: FastInferApp, encoding: str | None, compress: Callable[[bytes], bytes]
) -> None:
    headers = {"content-encoding": encoding} if encoding else {}
    exchange = await call(app, Exchange.of(compress(infer_body(3.0, 4.0)), headers))
    assert exchange.status == 200, exchange.sent
    assert exchange.json()["outputs"][0]["data"] == [3.0, 4.0]


@pytest.mark.parametrize("encoding", ["br", "zstd", "gzip, br", "compress"])
async def test_an_unsupported_content_encoding_is_400(app: FastInferApp, gate: Gate, encoding: str) -> None:
    exchange = await call(app, Exchange.of(infer_body(1.0), {"content-encoding": encoding}))
    assert_error(exchange, 400, "Content-Encoding")
    assert gate.ran() == []


def _bad_crc(data: bytes) -> bytes:
    packed = bytearray(gzip.compress(data))
    packed[-8] ^= 0xFF
    return bytes(packed)


CORRUPT: list[tuple[str, bytes]] = [
    ("gzip", b"this is not gzip at all"),
    ("gzip", b"\x1f\x8b\x08\x00" + b"\x00" * 20),  # a gzip header, then rubbish
    ("gzip", gzip.compress(infer_body(1.0))[:-12]),  # truncated
    ("gzip", _bad_crc(infer_body(1.0))),
    ("gzip", gzip.compress(infer_body(1.0)) + b"trailing rubbish"),
    ("gzip", b""),
    ("deflate", b"this is not deflate at all"),
    ("deflate", zlib.compress(infer_body(1.0))[:-6]),  # truncated
    ("deflate", raw_deflate(infer_body(1.0))[:-3]),  # truncated, bare
    ("deflate", b""),
]


def test_a_gzip_body_of_many_members_is_refused_before_it_costs() -> None:
    """Each member's end copied the rest of the body: 200,000 members of 21 bytes (4 MB) took
    7 s, holding the interpreter from the event loop. Past MAX_GZIP_MEMBERS it is a 400; up to
    it, each member's end copies a piece of the body at most."""
    member = gzip.compress(b" ", mtime=0)
    with pytest.raises(InvalidInput, match=f"more than {MAX_GZIP_MEMBERS} members"):
        _decompressed(member * 200_000, "gzip", 64 << 20)
    assert _decompressed(member * MAX_GZIP_MEMBERS, "gzip", 64 << 20) == b" " * MAX_GZIP_MEMBERS


@pytest.mark.parametrize("encoding, body", CORRUPT)
async def test_a_corrupt_compressed_body_is_400_never_500(
    app: FastInferApp, gate: Gate, encoding: str, body: bytes
) -> None:
    exchange = await call(app, Exchange.of(body, {"content-encoding": encoding}))
    assert_error(exchange, 400, encoding)
    assert gate.ran() == []


# --- Inference-Header-Content-Length ---------------------------------------------------------


def binary_body(value: float) -> tuple[bytes, int]:
    header = orjson.dumps({"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32",
                                       "parameters": {"binary_data_size": 4}}]})
    return header + struct.pack("<f", value), len(header)


async def test_a_binary_body_with_its_header_length_is_served(app: FastInferApp) -> None:
    body, length = binary_body(6.0)
    exchange = await call(app, Exchange.of(body, {"inference-header-content-length": str(length)}))
    assert exchange.status == 200, exchange.sent
    assert exchange.json()["outputs"][0]["data"] == [6.0]


@pytest.mark.parametrize("length", ["abc", "-1", "1.5", "", "0x10", "1 2", "999999999999999999999999"])
async def test_a_bad_inference_header_content_length_is_400(app: FastInferApp, gate: Gate, length: str) -> None:
    body, _ = binary_body(6.0)
    exchange = await call(app, Exchange.of(body, {"inference-header-content-length": length}))
    assert_error(exchange, 400, "Inference-Header-Content-Length")
    assert gate.ran() == []


async def test_a_header_length_beyond_the_body_is_400(app: FastInferApp, gate: Gate) -> None:
    body, _ = binary_body(6.0)
    exchange = await call(app, Exchange.of(body, {"inference-header-content-length": str(len(body) + 1)}))
    assert_error(exchange, 400, "Inference-Header-Content-Length")
    assert gate.ran() == []


# --- clients that leave ---------------------------------------------------------------------


async def test_a_disconnect_while_the_body_arrives_sends_and_queues_nothing(
    app: FastInferApp, plane: DataPlane, gate: Gate
) -> None:
    body = infer_body(5.0)
    exchange = Exchange([*chunks(body, 8)[:2], {"type": "http.disconnect"}])
    await call(app, exchange)
    assert exchange.sent == []
    model = plane.repository.get("spin")
    assert model.queue_depth == 0 and model.pending_requests == 0
    assert gate.ran() == [] and stats(plane)["failures"] == {}


async def test_a_disconnect_while_queued_drops_the_request_before_compute(
    app: FastInferApp, plane: DataPlane, gate: Gate
) -> None:
    model = plane.repository.get("spin")
    busy = Exchange.of(infer_body(HOLD))
    busy_task = asyncio.create_task(call(app, busy))
    await eventually(gate.held.is_set, "the first request holds the only instance")
    leaving = Exchange.of(infer_body(5.0))
    leaving_task = asyncio.create_task(call(app, leaving))
    await eventually(lambda: model.queue_depth == 1, "the second request is queued")
    await eventually(lambda: leaving.receive_calls == 2, "the endpoint watches the queued request's connection")
    assert model.pending_requests == 2, "one computing, one queued"
    leaving.disconnect()
    await asyncio.wait_for(leaving_task, 10)
    assert leaving.sent == []
    assert model.queue_depth == 0 and model.pending_requests == 1
    assert stats(plane)["failures"] == {"cancelled": 1}
    metrics = exposition(build_registry(plane.repository)).decode()
    assert 'batchline_requests_total{model="spin",outcome="cancelled",version="1"} 1.0' in metrics
    gate.released.set()
    await asyncio.wait_for(busy_task, 10)
    assert busy.status == 200
    assert gate.ran() == [HOLD], "the engine ran the request of a client that had left"
    assert model.pending_requests == 0


class SlowSend(Exchange):
    """A transport whose writes yield to the loop, as a socket under back-pressure does."""

    async def send(self, message: dict[str, Any]) -> None:
        await super().send(message)
        await asyncio.sleep(0)


class ResultAsClientLeaves:
    """A model whose result comes back in the very moment its client disconnects."""

    config = ModelConfig.model_validate({
        "name": "spin", "engine": "onnxruntime", "max_batch_size": 8,
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [1]}],
    })
    version = 1
    ready = True
    every_output = (("y", "FP32"),)

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange

    def get(self, name: str, version: str | None = None) -> ResultAsClientLeaves:
        return self

    def start_request(
        self, inputs: dict[str, Any], parameters: Any, record: Any = None, received_ns: Any = None,
        checked_batch_size: Any = None, items_a_part: Any = None,
    ) -> asyncio.Future[dict[str, np.ndarray]]:
        result: asyncio.Future[dict[str, np.ndarray]] = asyncio.get_running_loop().create_future()

        async def answer_as_the_client_leaves() -> None:
            await eventually(lambda: self.exchange.receive_calls == 2, "the endpoint watches the connection")
            result.set_result({"y": inputs["x"][1]})
            self.exchange.disconnect()  # seen in the same loop turn as the result

        self.answering = asyncio.ensure_future(answer_as_the_client_leaves())
        return result


async def test_a_disconnect_as_the_result_arrives_never_cancels_the_answer() -> None:
    """Once the result is in hand, the endpoint answers; a late disconnect must not cancel the
    handler while it writes (uvicorn would log the CancelledError as an application error)."""
    exchange = SlowSend.of(infer_body(2.0))
    app = FastInferApp(unreachable, InferEndpoint(DataPlane(ResultAsClientLeaves(exchange)), LIMIT))  # type: ignore[arg-type]
    task = asyncio.create_task(app(exchange.scope, exchange.receive, exchange.send))
    await asyncio.wait({task}, timeout=10)
    assert task.done() and not task.cancelled(), "the handler was cancelled after its result arrived"
    assert task.exception() is None
    assert exchange.status == 200 and exchange.json()["outputs"][0]["data"] == [2.0]


class NeverAnswers:
    """A model whose request is still running when the server's grace period runs out."""

    config = ResultAsClientLeaves.config
    version = 1
    ready = True
    every_output = ResultAsClientLeaves.every_output

    def __init__(self) -> None:
        self.entered = asyncio.Event()

    def get(self, name: str, version: str | None = None) -> NeverAnswers:
        return self

    def start_request(
        self, inputs: dict[str, Any], parameters: Any, record: Any = None, received_ns: Any = None,
        checked_batch_size: Any = None, items_a_part: Any = None,
    ) -> asyncio.Future[dict[str, np.ndarray]]:
        self.entered.set()
        return asyncio.get_running_loop().create_future()  # never answered


async def test_a_request_cut_off_by_the_end_of_the_grace_period_is_told_503_not_500() -> None:
    """uvicorn cancels the handlers still running when its graceful shutdown times out: the
    client is still connected and gets a 503 in the error shape, not uvicorn's 500 and a logged
    traceback."""
    exchange = Exchange.of(infer_body(2.0))
    model = NeverAnswers()
    app = FastInferApp(unreachable, InferEndpoint(DataPlane(model), LIMIT))  # type: ignore[arg-type]
    task = asyncio.create_task(app(exchange.scope, exchange.receive, exchange.send))
    await asyncio.wait_for(model.entered.wait(), 10)
    task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")  # as uvicorn does
    await asyncio.wait({task}, timeout=10)
    assert task.done() and not task.cancelled() and task.exception() is None
    assert_error(exchange, 503, "stopped before this request was answered")


class LoadsForever:
    """A repository whose load is still warming up when the server's grace period runs out."""

    changes = 0

    def __init__(self) -> None:
        self.entered = asyncio.Event()

    async def load(self, name: str, config_override: str | None = None) -> None:
        self.entered.set()
        await asyncio.Event().wait()


@pytest.mark.parametrize("stopping", [True, False])
async def test_a_load_cut_off_by_the_end_of_the_grace_period_is_told_503_not_500(stopping: bool) -> None:
    """It was answered a plain-text 500 by uvicorn, with 'Exception in ASGI application' and a
    traceback in the log. Only a stop's cut-off is: another cancellation (a timeout around the
    app) stays one."""
    repository = LoadsForever()
    plane = DataPlane(repository)  # type: ignore[arg-type]
    exchange = Exchange.of(b"{}", {"content-type": "application/json", "host": "127.0.0.1"},
                           path="/v2/repository/models/m/load")
    app = FastInferApp(create_app(plane, access=AccessPolicy(model_control=True)), InferEndpoint(plane, LIMIT))
    task = asyncio.create_task(app(exchange.scope, exchange.receive, exchange.send))
    await asyncio.wait_for(repository.entered.wait(), 10)
    if stopping:
        plane.begin_stop()
    task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")  # as uvicorn does
    await asyncio.wait({task}, timeout=10)
    if stopping:
        assert task.done() and not task.cancelled() and task.exception() is None
        assert_error(exchange, 503, "the server stopped before this call ended")
    else:
        assert task.cancelled() and exchange.sent == []


@pytest.mark.parametrize("path", ["/v2/repository/index", "/v2/systemsharedmemory/region/r/register"])
async def test_a_client_that_leaves_while_a_control_route_reads_its_body_logs_nothing(
    plane: DataPlane, path: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """Not an error of the server's: no traceback per such client, and nothing escapes the app."""
    leaving = Exchange([{"type": "http.request", "body": b'{"ready": ', "more_body": True},
                        {"type": "http.disconnect"}], {"content-type": "application/json", "content-length": "100"},
                       path=path)
    with caplog.at_level("WARNING"):
        await asyncio.wait_for(create_app(plane)(leaving.scope, leaving.receive, leaving.send), 10)
    assert leaving.status == 499
    assert [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")] == []
