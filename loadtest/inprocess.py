"""The server's own cost per request, without a network: the real app (data plane, batcher,
engine) driven in-process by concurrent clients, and the CPU time it took per request, all
threads together. No network and no load generator share the core (and through the app or the
protocol, no kernel), so a change of a few percent shows where a run over sockets on a shared
machine drowns it in noise.

  --through app        the door's decision and the infer endpoint called directly, as the
                       protocol calls them: the server's Python path, without uvicorn
  --through protocol   the server's HTTP protocol (uvicorn's httptools parser and the door in
                       front of the app) fed whole requests by in-memory connections, each
                       sending its next request when its answer is written
  --through link       both ends of the link a front-end process (--http-workers) calls the
                       server process over, in this one process over a Unix socket: each call
                       the decoded tensors of a request, as a front end sends them (no HTTP)
  --through plane      the same decoded tensors started on the data plane directly, as the
                       server process's end of the link starts them: the link's own cost is
                       what --through link costs more than this
  --through frontend   the HTTP protocol of a front-end process (--http-workers) fed as through
                       the protocol, its link to this process's data plane over a Unix socket:
                       a front end's and the server process's work for a request together
  --answer engine      the model's engine, as served
  --answer zeros       the engine answers zeros of its outputs' shapes at once: the data plane
                       (admission, batching, the instance thread and back) without compute
  --answer parsed      a constant answer once the body is parsed, checked and its tensors built:
                       the HTTP path alone, no data plane (not through the link: no HTTP there)

The process takes the server's garbage-collector settings (server/heap.py), as `batchline serve`
does; without them a run measures the collector more than the server.

    taskset -c 0 python -m loadtest.inprocess --model-repository /tmp/mlprepo --model mlp --clients 64
    taskset -c 0 python -m loadtest.inprocess --model-repository /tmp/mlprepo --through protocol --answer parsed
    taskset -c 0 python -m loadtest.inprocess --model-repository /tmp/mlprepo --through link --answer zeros
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadtest import payloads
from server.asgi.disconnect import DISCONNECT_EXTENSION

THROUGH = ("app", "protocol", "link", "plane", "frontend")
ANSWER_WITHIN_S = 10.0  # once the run stops, each client's call in flight is answered within this
ANSWERS = ("engine", "zeros", "parsed")


class Failed(RuntimeError):
    """The server answered a request of the run with something other than 200 (a refusal, on
    the link), or left one unanswered."""


@dataclass
class _Load:
    """What the clients of one run share: requests answered, whether to stop, the first failure."""

    served: int = 0
    stop: bool = False
    failure: str | None = None

    def fail(self, why: str) -> None:
        self.failure = self.failure or why
        self.stop = True


async def measure(
    repository: Path, model: str, clients: int, seconds: float, through: str = "app", answer: str = "engine",
) -> dict[str, float]:
    """req/s and CPU microseconds per request, over `seconds` after a second of warm-up; Failed
    when any answer was not a 200 (or a connection closed), a call over the link was refused,
    or a client's call went unanswered for ANSWER_WITHIN_S once the run stopped."""
    from prometheus_client import CollectorRegistry

    from server.dataplane import DataPlane
    from server.heap import HeapPolicy
    from server.http.app import create_app
    from server.http.door import Door
    from server.repository import ModelRepository

    refused = _refusal(through, answer)
    if refused is not None:
        raise ValueError(refused)
    thresholds = gc.get_threshold()
    heap = HeapPolicy().install()
    try:
        plane = DataPlane(ModelRepository(repository, 1))  # one engine thread, as the pinned server runs
        with _answered_after_parse() if answer == "parsed" else contextlib.nullcontext():
            app = create_app(plane, metrics=CollectorRegistry())
        door = Door.of(app)
        assert door is not None
        plane.start([model])
        try:
            return await _run(plane, app, door, model, clients, seconds, through, answer, repository, heap)
        finally:
            await plane.stop()
    finally:  # the process's collector as it was, whatever happened: a test process goes on
        heap.uninstall()
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def _refusal(through: str, answer: str) -> str | None:
    """Why a run cannot go this way, or None."""
    if through not in THROUGH or answer not in ANSWERS:
        return f"through one of {THROUGH}, answer one of {ANSWERS}"
    if through in ("link", "plane") and answer == "parsed":
        return f"--through {through} has no HTTP to parse: answer engine or zeros"
    if through == "frontend" and answer == "parsed":
        return "--through frontend parses in the front end and answers from the data plane: answer engine or zeros"
    return None


async def _run(plane: Any, app: Any, door: Any, model: str, clients: int, seconds: float, through: str, answer: str,
               repository: Path, heap: Any) -> dict[str, float]:
    while not plane.server_ready():
        if plane.repository.versions(model) and not plane.model_ready(model, None):
            raise Failed(f"{model} did not load: {plane.repository.versions(model)[0].reason}")
        await asyncio.sleep(0.05)
    if answer == "zeros":
        _answer_zeros(plane.repository.get(model, None))
    heap.settle()
    bodies = [r.body for r in payloads.build_requests(model, 1, False, 32, repository)]
    load = _Load()
    connections: list[_Connection] = []
    async with contextlib.AsyncExitStack() as stack:
        if through == "app":
            waits = answer != "parsed"  # a constant answer never waits: each client then yields after each call
            tasks = [asyncio.create_task(_client(door, model, bodies, i, load, waits)) for i in range(clients)]
        elif through == "link":
            calls = [_decoded(body) for body in bodies]
            link = await stack.enter_async_context(_linked(plane))
            tasks = [asyncio.create_task(_link_client(link, model, calls, i, load)) for i in range(clients)]
        elif through == "frontend":
            tasks = []
            link = await stack.enter_async_context(_linked(plane))
            front_end, front_door = await stack.enter_async_context(_front_end(link))
            connections = _connect(front_end, front_door, model, bodies, clients, load)
        elif through == "plane":
            calls = [_decoded(body) for body in bodies]
            tasks = [asyncio.create_task(_plane_client(plane, model, calls, i, load)) for i in range(clients)]
        else:
            tasks = []
            connections = _connect(app, door, model, bodies, clients, load)
        return await _timed(plane, model, clients, seconds, load, tasks, connections)


async def _timed(plane: Any, model: str, clients: int, seconds: float, load: _Load, tasks: list[asyncio.Task[None]],
                 connections: list[_Connection]) -> dict[str, float]:
    await asyncio.sleep(1.0)
    count, cpu, wall, batches = load.served, time.process_time(), time.perf_counter(), _batches(plane, model)
    await asyncio.sleep(seconds)
    count, cpu, wall = load.served - count, time.process_time() - cpu, time.perf_counter() - wall
    items, runs = (after - before for after, before in zip(_batches(plane, model), batches, strict=True))
    closed = sum(c.is_closing() for c in connections)
    load.stop = True
    finished, unanswered = await asyncio.wait(tasks, timeout=ANSWER_WITHIN_S) if tasks else (set(), set())
    for task in unanswered:
        task.cancel()
    if unanswered:
        load.fail(f"{len(unanswered)} of {clients} clients were not answered within {ANSWER_WITHIN_S:g} s")
    for task in finished:
        task.result()  # a client's own error, raised as it is
    await asyncio.sleep(0.1)  # the protocol's requests in flight finish
    if closed:
        load.fail(f"{closed} of {clients} connections were closed by the server during the run")
    if load.failure is not None:
        raise Failed(load.failure)
    return {"req_s": count / wall, "cpu_us_per_request": cpu / max(count, 1) * 1e6, "requests": count,
            "items_per_batch": items / max(runs, 1)}


def _batches(plane: Any, model: str) -> tuple[int, int]:
    """The items the model has run and the batches they ran in, so far."""
    stats = plane.statistics(model, None)["model_stats"][0]
    return stats["inference_count"], stats["execution_count"]


async def _client(door: Any, model: str, bodies: list[bytes], first: int, load: _Load, waits: bool) -> None:
    index = first
    while not load.stop:
        await _one(door, model, bodies[index % len(bodies)], load)
        index += 1
        load.served += 1
        if not waits:
            await asyncio.sleep(0)


async def _one(door: Any, model: str, body: bytes, load: _Load) -> None:
    """One call the way the server's HTTP protocol makes it: the door decides, the endpoint answers."""
    from server.http.door import Admitted

    scope = {"type": "http", "method": "POST", "path": f"/v2/models/{model}/infer", "query_string": b"",
             "headers": [(b"host", b"local"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "http_version": "1.1", "scheme": "http", "root_path": "",
             "extensions": {DISCONNECT_EXTENSION: []}}
    decision = door.decide(scope)
    if not isinstance(decision, Admitted):
        load.fail(f"the door did not let the call in: {decision!r}")
        return
    answered = asyncio.Event()
    sent = False
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await door.app_for(decision)(scope, receive, send)
    answered.set()
    if status != 200:
        load.fail(f"the server answered {status}")


@contextlib.asynccontextmanager
async def _linked(plane: Any) -> AsyncIterator[Any]:
    """A front end's link to this process's data plane, over a Unix socket in a temporary folder."""
    import functools

    from server.http.v2_infer import infer_v2
    from server.link import LinkClient, PlaneLink

    with tempfile.TemporaryDirectory(prefix="batchline-inprocess-") as folder:
        raw = functools.partial(infer_v2, plane)
        server = await asyncio.get_running_loop().create_unix_server(
            lambda: PlaneLink(plane, raw), str(Path(folder) / "link.sock"))
        link = None
        try:
            link = await LinkClient.connect(str(Path(folder) / "link.sock"), lambda: None)
            yield link
        finally:
            if link is not None:
                link.close()
            server.close()
            await server.wait_closed()


@contextlib.asynccontextmanager
async def _front_end(link: Any) -> AsyncIterator[tuple[Any, Any]]:
    """The app of one front-end process over `link`, with its door: as `batchline serve
    --http-workers 1` starts it, but for the other routes, which nobody calls here."""
    from server.http.door import Door
    from server.http.forward import ForwardApp
    from server.http.worker_process import front_end_app
    from server.settings import ServerSettings

    forward = ForwardApp("/nonexistent/batchline-inprocess.sock")
    try:
        app = front_end_app(ServerSettings(), link, forward, 1)
        yield app, Door.of(app)
    finally:
        await forward.close()


def _decoded(body: bytes) -> list[tuple[str, str, np.ndarray]]:
    """A request's input tensors as a front end sends them once it has parsed the body."""
    from server.errors import BatchlineError
    from server.protocol.v2 import build_tensors, parse_request

    try:
        decoded = build_tensors(parse_request(body, None))
    except BatchlineError as exc:
        raise Failed(f"a request body does not decode: {exc.message}") from exc
    return [(name, datatype, array) for name, (datatype, array) in decoded.inputs.items()]


async def _link_client(link: Any, model: str, calls: list[list[tuple[str, str, np.ndarray]]], first: int,
                       load: _Load) -> None:
    from server.errors import BatchlineError

    index = first
    while not load.stop:
        try:
            await link.infer(model, None, calls[index % len(calls)], {}, None, None, time.perf_counter_ns())
        except Exception as exc:  # noqa: BLE001 - a refusal, or an error with no type of the server's
            load.fail(f"the server process refused a call: {exc.message if isinstance(exc, BatchlineError) else exc}")
            return
        index += 1
        load.served += 1


async def _plane_client(plane: Any, model: str, calls: list[list[tuple[str, str, np.ndarray]]], first: int,
                        load: _Load) -> None:
    """Calls as the server process's end of the link starts them (server.link.PlaneLink._start)."""
    from server.errors import BatchlineError

    index = first
    while not load.stop:
        inputs = calls[index % len(calls)]
        try:
            served = plane.admit(model, None)
            batch_size = plane.check_inputs(served, {n: (d, list(a.shape)) for n, d, a in inputs})
            await plane.start_call(served, {n: (d, a) for n, d, a in inputs}, {}, None, None,
                                   time.perf_counter_ns(), batch_size).answer()
        except BatchlineError as exc:
            load.fail(f"the data plane refused a call: {exc.message}")
            return
        index += 1
        load.served += 1


class _Connection(asyncio.Transport):
    """A client's keep-alive connection in memory: its next request goes in once the server has
    written the whole answer to the last (its head, then content-length bytes)."""

    def __init__(self, requests: list[bytes], first: int, load: _Load) -> None:
        super().__init__()
        self._requests = requests
        self._next = first
        self._load = load
        self._closing = False
        self._owed = 0  # body bytes of the answer being written still to come
        self.protocol: Any = None

    def send_next(self) -> None:
        if not self._load.stop and not self._closing:
            request = self._requests[self._next % len(self._requests)]
            self._next += 1
            self.protocol.data_received(request)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        data = bytes(data)
        if not self._owed:
            head, _, body = data.partition(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                self._load.fail(f"the server answered {head[:200]!r}")
                return
            lengths = [line for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
            self._owed = int(lengths[0].partition(b":")[2]) if lengths else 0
            data = body
        self._owed -= len(data)
        if self._owed <= 0:
            self._owed = 0
            self._load.served += 1
            asyncio.get_running_loop().call_soon(self.send_next)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        self._closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


def _connect(app: Any, door: Any, model: str, bodies: list[bytes], clients: int, load: _Load) -> list[_Connection]:
    """`clients` connections to the server's HTTP protocol, each sending its first request."""
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    from server.http.door import door_protocol

    protocol = door_protocol(door)
    config = Config(app, http=protocol, lifespan="off", access_log=False, proxy_headers=False, log_level="warning")
    config.load()
    state = ServerState()
    requests = [f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: local\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n".encode() + body for body in bodies]
    connections = []
    for first in range(clients):
        connection = _Connection(requests, first, load)
        connection.protocol = protocol(config=config, server_state=state, app_state={})
        connection.protocol.connection_made(connection)
        asyncio.get_running_loop().call_soon(connection.send_next)
        connections.append(connection)
    return connections


@contextlib.contextmanager
def _answered_after_parse() -> Iterator[None]:
    """Apps created meanwhile answer every infer call with a constant, once its body is parsed,
    checked against the model and its tensors built."""
    import orjson

    from server.http import v2_infer
    from server.protocol.v2 import build_tensors, parse_request

    constant = orjson.dumps({"model_name": "constant", "model_version": "1", "outputs": []})

    async def parsed_only(plane: Any, name: str, version: str | None, body: bytes, header_length: int | None,
                          record: Any = None, received_ns: int | None = None) -> tuple[bytes, int | None]:
        served = plane.admit(name, version)
        parsed = parse_request(body, header_length)
        plane.check_inputs(served, {d.name: (d.datatype, d.shape) for d in parsed.inputs})
        build_tensors(parsed, plane.shared_memory.read_inputs)
        return constant, None

    class Answered:
        """A call answered at once, as the inline path takes a started one (v2_infer.Started)."""

        def __init__(self) -> None:
            self.future = asyncio.get_running_loop().create_future()
            self.future.set_result({})

        @property
        def call(self) -> Answered:
            return self

        def withdraw(self) -> None:
            pass

        def answer_inline(self, name: str, results: Any) -> tuple[bytes, int | None]:
            return constant, None

    def parsed_inline(plane: Any, name: str, version: str | None, body: bytes, header_length: int | None,
                      record: Any, received_ns: int) -> Answered:
        served = plane.admit(name, version)
        parsed = parse_request(body, header_length)
        plane.check_inputs(served, {d.name: (d.datatype, d.shape) for d in parsed.inputs})
        build_tensors(parsed, plane.shared_memory.read_inputs)
        return Answered()

    real, real_inline = v2_infer.infer_v2, v2_infer.start_inline
    v2_infer.infer_v2 = parsed_only  # type: ignore[assignment]
    v2_infer.start_inline = parsed_inline  # type: ignore[assignment]
    try:
        yield
    finally:
        v2_infer.infer_v2, v2_infer.start_inline = real, real_inline  # type: ignore[assignment]


def _answer_zeros(version: Any) -> None:
    """Every instance of the model answers zeros of its outputs' shapes, without running. An
    output of a variable size has no shape to answer with: such a model is refused."""
    from server.protocol.datatypes import numpy_dtype

    config = version.config
    varying = [t.name for t in config.outputs if -1 in t.dims]
    if varying:
        raise ValueError(f"--answer zeros needs outputs of fixed shapes; {', '.join(varying)} varies")
    outputs = [(t.source_name, numpy_dtype(t.datatype), list(t.dims)) for t in config.outputs]

    def zeros(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = [next(iter(inputs.values())).shape[0]] if config.batched else []
        return {name: np.zeros([*rows, *dims], dtype) for name, dtype, dims in outputs}

    for instance in version.instances:
        instance.pipeline.engine.run = zeros


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.inprocess", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", type=Path, default=payloads.MODELS)
    parser.add_argument("--model", choices=sorted(payloads.SPECS), default="mlp")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--through", choices=THROUGH, default="app")
    parser.add_argument("--answer", choices=ANSWERS, default="engine")
    args = parser.parse_args(argv)
    refused = _refusal(args.through, args.answer)
    if refused is not None:
        parser.error(refused)
    import uvloop

    try:
        result = uvloop.run(measure(args.model_repository, args.model, args.clients, args.seconds, args.through,
                                    args.answer))
    except Failed as failed:
        print(f"inprocess: {failed}", file=sys.stderr)
        return 1
    print(f"{result['req_s']:,.0f} req/s, {result['cpu_us_per_request']:.1f} us CPU per request (all threads), "
          f"{args.clients} clients through the {args.through}, answer: {args.answer}, {result['requests']:,} requests, "
          f"{result['items_per_batch']:.1f} items a batch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
