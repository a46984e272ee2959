"""The infer route as a bare ASGI endpoint: the hot path skips the framework entirely.

FastAPI's routing, middleware and request objects cost more per call than a small model's
inference; here a request is a path match, a body read, one data-plane call and one write
(server/asgi/respond.py).
A client that disconnects while its request waits has the request cancelled before compute.

The server's own HTTP protocol (server/http/door.py) answers the commonest call, a small body
that came whole with its head, without even the ASGI task: `answered_inline` starts it on the
data plane from the parser's callback and answers from its future's (about a tenth less CPU a
request, measured: docs/benchmarks.md). Every other call, and every call under another ASGI
server, goes through `admitted`'s task, with its body timeouts and inflating.

Overload is refused at the door: past the server's bounds on requests in flight, or on the
bytes their bodies hold (`InFlight`, shared with the other front ends), a request is answered
429 with a constant body before its body is read (uvicorn then reads and discards the body,
keeping the connection; a client that waits for 100 Continue is answered with
`connection: close`, as it may never send the body).
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

from server.access_log import AccessLog
from server.asgi.body import read_body
from server.asgi.disconnect import CUT_OFF, disconnect_callbacks, unless_client_leaves
from server.asgi.lengths import TOO_LONG, declared_length
from server.asgi.respond import JSON, Headers, body_headers, send_messages, send_response
from server.asgi.types import ASGIApp, Message, Receive, Scope, Send
from server.dataplane import STOPPING, DataPlane
from server.errors import Cancelled, InvalidInput, PayloadTooLarge, RequestTimeout, Unavailable
from server.http import v2_infer
from server.http.errors import error_parts
from server.inflight import BUSY_MESSAGE, Hold, InFlight, body_reservation
from server.protocol.v2 import encode_error
from server.scheduler.request import RequestRecord

INFER_PATH = re.compile(r"/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer")
HEADER_LENGTH = "Inference-Header-Content-Length"
_HEADER_LENGTH_KEY = HEADER_LENGTH.lower().encode()
_BINARY = b"application/octet-stream"
CLIENT_CLOSED = 499  # nginx's status for a client that left first: logged, never sent
CONTROL_CUT_OFF = "the server stopped before this call ended (its grace period for calls in flight ran out)"
BUSY = 429
# The refusal under overload is a constant: no encoding, no allocation per refused request.
BUSY_BODY = encode_error(BUSY_MESSAGE)
_BUSY_HEADERS = body_headers(BUSY_BODY, {"Retry-After": "1"})
_BUSY_CLOSE_HEADERS = [*_BUSY_HEADERS, (b"connection", b"close")]
_BUSY_START = {"type": "http.response.start", "status": BUSY, "headers": _BUSY_HEADERS}
_BUSY_CLOSE_START = {"type": "http.response.start", "status": BUSY, "headers": _BUSY_CLOSE_HEADERS}
_BUSY_END = {"type": "http.response.body", "body": BUSY_BODY}
_EXPECT = b"expect"
_CONTENT_LENGTH = b"content-length"
_CONTENT_ENCODING = b"content-encoding"

# Control-plane bodies (repository index, load, unload) are a small JSON object at most.
CONTROL_BODY_BYTES = 64 << 10


# One infer call's answer from its body: (model, version, body, Inference-Header-Content-Length,
# access log record, when its head arrived) -> (response body, its binary header length or None).
Answer = Callable[[str, str | None, bytes, int | None, RequestRecord | None, int], Awaitable[tuple[bytes, int | None]]]
# The same call started on the event loop, answered from its future (None: `Answer`'s way for it).
StartInline = Callable[[str, str | None, bytes | bytearray, int | None, RequestRecord | None, int], "v2_infer.InlineStarted | None"]


class InferEndpoint:
    """The infer route over `plane`; or, in a front-end process (`--http-workers`), with no
    plane of its own, over `answer` and `start_inline`, which send each call to the server
    process."""

    def __init__(
        self,
        plane: DataPlane | None,
        max_body_bytes: int,
        access_log: AccessLog | None = None,
        flight: InFlight | None = None,
        answer: Answer | None = None,
        start_inline: StartInline | None = None,
    ) -> None:
        self.plane = plane  # None: no queues here to refuse at the door from
        if answer is None:
            if plane is None:
                raise ValueError("an infer endpoint needs a data plane or an answer")
            answer = functools.partial(v2_infer.infer_v2, plane)
            start_inline = functools.partial(v2_infer.start_inline, plane)
        self._answer = answer
        self._start_inline = start_inline  # None: every call takes `admitted`'s task
        self._limit = max_body_bytes
        self._access_log = access_log or AccessLog()
        self.flight = flight or InFlight()  # shared with the server's other front ends

    async def __call__(self, scope: Scope, receive: Receive, send: Send, model: str, version: str | None) -> None:
        headers = dict(scope["headers"])
        await self.admitted(model, version, headers, self.reservation(content_length(headers)), scope, receive, send)

    async def admitted(
        self,
        model: str,
        version: str | None,
        headers: dict[bytes, bytes],
        reserved: int,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        """Answer a call past the access gate, whose head has been read: its `headers` as a dict
        and the body bytes it `reserved` (what `reservation` says of them). The server's HTTP
        protocol calls this directly for the calls its door lets in (server/http/door.py)."""
        started = time.perf_counter_ns()
        hold = self.flight.try_hold(reserved, arriving=True)  # one check: the door's earlier one may be stale by now
        if hold is None:
            await self._refuse_busy(scope, send, headers, model, started)
            return
        try:
            record = RequestRecord() if self._access_log.enabled else None
            status = await self._respond(scope, headers, hold, receive, send, model, version, record, started)
        finally:
            hold.release()
        self._log(scope, model, status, started, record)

    def answered_inline(
        self,
        model: str,
        version: str | None,
        headers: dict[bytes, bytes],
        reserved: int,
        scope: Scope,
        body: bytes | bytearray,
        write: WriteWhole,
        running: set[Any],
    ) -> bool:
        """Answer a call past the door whose whole body is in (at most INLINE_DECODE_BYTES, as
        sent: `inline` says which calls), with no task and no coroutine: it starts on the data
        plane here (in a front-end process, it is sent to the server process's) and is answered
        from its future's callback through `write`. The client leaving is learnt from the
        scope's disconnect callbacks, as `admitted` learns it. While it waits it is in `running`
        (uvicorn's tasks), whose `cancel()` cuts it off with a 503 when the server's graceful
        stop runs out of time, as a task is. False, with nothing started, for a call whose
        tensors are too big to build on the event loop (BYTES in the client's shared memory),
        for one a front end sends whole to the server process (it names the client's shared
        memory), and for every call of an endpoint made with an `answer` but no `start_inline`:
        `admitted` answers it."""
        if self._start_inline is None:
            return False
        started_ns = time.perf_counter_ns()
        hold = self.flight.try_hold(reserved)
        if hold is None:
            status, head, content = self._busy(headers)
            write(status, head, content)
            self.log_refusal(scope, model, status, started_ns)
            return True
        record = RequestRecord() if self._access_log.enabled else None
        try:
            started = self._start_inline(model, version, body, _header_length(headers), record, started_ns)
        except Exception as exc:  # noqa: BLE001 - answered in v2's shape, an unknown one as 500
            hold.release()
            status, content, extra = error_parts(exc)
            write(status, body_headers(content, extra, JSON), content)
            self._log(scope, model, status, started_ns, record)
            return True
        if started is None:
            hold.release()
            return False
        where = (_peer(scope), scope["path"]) if record is not None else _NOWHERE  # for its access log line
        answer = _InlineAnswer(self._access_log, model, started, hold, record, write, disconnect_callbacks(scope),
                               running, where, started_ns)
        started.call.future.add_done_callback(answer.finished)
        return True

    @property
    def answers_inline(self) -> bool:
        """Whether small calls can be answered inline (`answered_inline`)."""
        return self._start_inline is not None

    def reservation(self, length: int | None) -> int:
        """The body bytes a request holds from its head on (server/inflight.py), given its
        declared length (`content_length`)."""
        return body_reservation(length, self._limit)

    def log_refusal(self, scope: Scope, model: str, status: int, started: int) -> None:
        """The access log line of a request refused before its body was read."""
        if self._access_log.enabled:
            self._log(scope, model, status, started, RequestRecord())

    async def _refuse_busy(
        self, scope: Scope, send: Send, headers: dict[bytes, bytes], model: str, started: int
    ) -> None:
        """429 + Retry-After without reading the body; 503 once the server is stopping (another
        replica serves it, where a retry here in a second finds no server). A client waiting for
        100 Continue may never send its body, so its connection is closed rather than left out
        of step."""
        expects = headers.get(_EXPECT, b"").lower() == b"100-continue"
        if self.plane is not None and self.plane.stopping:
            status, head, content = self._busy(headers)
            await send_messages(send, status, [*head, (b"connection", b"close")] if expects else head, content)
            self.log_refusal(scope, model, status, started)
            return
        await send(_BUSY_CLOSE_START if expects else _BUSY_START)
        await send(_BUSY_END)
        self.log_refusal(scope, model, BUSY, started)

    def _busy(self, headers: dict[bytes, bytes]) -> tuple[int, Headers, bytes]:
        """The refusal of a call with no room in flight: 429, or 503 once the server is stopping."""
        if self.plane is not None and self.plane.stopping:
            status, content, extra = error_parts(Unavailable(STOPPING))
            return status, body_headers(content, extra, JSON), content
        return BUSY, _BUSY_HEADERS, BUSY_BODY

    def _log(self, scope: Scope, model: str, status: int, started: int, record: RequestRecord | None) -> None:
        if record is not None:
            self._access_log.write(_peer(scope), scope["path"], model, status, started, record)

    async def _respond(
        self,
        scope: Scope,
        headers: dict[bytes, bytes],
        hold: Hold,
        receive: Receive,
        send: Send,
        model: str,
        version: str | None,
        record: RequestRecord | None,
        received_ns: int,
    ) -> int:
        """Answer one infer call; the status sent, or CLIENT_CLOSED when the client left first
        (one access log line per request, dropped ones included)."""
        try:
            body = await self._body(headers, hold, receive)
            header_length = _header_length(headers)
        except Cancelled:
            return CLIENT_CLOSED  # the client is gone; nobody to answer
        except RequestTimeout as exc:  # sent as ASGI's messages: the server then honours its Connection: close
            status, content, extra = error_parts(exc)
            await send_messages(send, status, body_headers(content, extra, JSON), content)
            return status
        except Exception as exc:  # noqa: BLE001 - every failure is answered in v2's shape, an unknown one as 500
            return await _send(scope, send, *error_parts(exc))
        outcome = await unless_client_leaves(
            receive, lambda: self._answer(model, version, body, header_length, record, received_ns),
            scope,
        )
        if outcome is None:
            return CLIENT_CLOSED  # the client left; its request was dropped, nobody to answer
        # Its place is given back before the answer is written: writing it starts a request
        # pipelined behind it, which the bound must have room for.
        hold.release()
        if isinstance(outcome, BaseException):
            return await _send(scope, send, *error_parts(outcome))
        content, binary_header_length = outcome
        await send_response(scope, send, 200, _answer_headers(content, binary_header_length), content)
        return 200

    async def _body(self, headers: dict[bytes, bytes], hold: Hold, receive: Receive) -> bytes:
        """The body, inflated when it has a Content-Encoding: while it inflates, the request holds
        the body limit more (what it may inflate to), then what it inflated to."""
        limit = self._limit
        body = await read_body(receive, limit, content_length(headers), hold)
        encoding = headers.get(_CONTENT_ENCODING, b"identity").decode("latin-1").strip().lower()
        if encoding in _IDENTITY:
            return body
        hold.hold_to(hold.nbytes + limit)
        if len(body) * _MAX_DEFLATE_RATIO > v2_infer.INLINE_DECODE_BYTES:  # it may inflate to megabytes
            inflated = await asyncio.to_thread(_decompressed, body, encoding, limit)
        else:
            inflated = _decompressed(body, encoding, limit)
        hold.hold_to(len(inflated))
        return inflated


# A whole response, written at once: status, headers (content-length among them), body.
WriteWhole = Callable[[int, Headers, bytes], None]


def content_length(headers: dict[bytes, bytes]) -> int | None:
    """A request's declared body length (None: none, or not a number)."""
    return declared_length(headers.get(_CONTENT_LENGTH))


def inline(headers: dict[bytes, bytes], length: int | None) -> bool:
    """Whether a call past the door can be answered inline (`InferEndpoint.answered_inline`)
    once its body is in: a declared `length` (`content_length`) small enough to parse on the
    event loop, sent as is, with no 100 Continue awaited. Every other call takes the task of
    `admitted`."""
    return (length is not None and length <= v2_infer.INLINE_DECODE_BYTES and _CONTENT_ENCODING not in headers
            and _EXPECT not in headers)


class _InlineAnswer:
    """The answer of a call `answered_inline` started: written when its future completes, or
    dropped, its place in flight given back, when its client leaves first. It holds no reference
    to the request's scope, and takes itself out of the scope's disconnect callbacks when done:
    a request leaves no reference cycle for the garbage collector."""

    __slots__ = (
        "_access_log",
        "_callbacks",
        "_done",
        "_hold",
        "_model",
        "_record",
        "_running",
        "_started",
        "_started_ns",
        "_where",
        "_write",
    )

    def __init__(
        self,
        access_log: AccessLog,
        model: str,
        started: v2_infer.InlineStarted,
        hold: Hold,
        record: RequestRecord | None,
        write: WriteWhole,
        callbacks: list[Callable[[], None]] | None,
        running: set[Any],
        where: tuple[str, str],
        started_ns: int,
    ) -> None:
        self._access_log = access_log
        self._model = model
        self._started = started
        self._hold = hold
        self._record = record
        self._write = write
        self._callbacks = callbacks
        self._running = running
        self._where = where  # the client and the path, for the access log line (with a record)
        self._started_ns = started_ns
        self._done = False
        if callbacks is not None:
            callbacks.append(self.client_left)
        running.add(self)

    def finished(self, future: asyncio.Future[Any]) -> None:
        """Its call's future is done: its result is what the started call answers from (the
        model's outputs here, or the server process's answer in a front end)."""
        if self._done:  # its client left, or the stop cut it off: nobody to tell of an error
            if not future.cancelled():
                future.exception()  # read, or asyncio logs it as never retrieved
            return
        if future.cancelled():  # not by its client, who is still here: the server is stopping
            self._answer_error(Unavailable(STOPPING))
            return
        error = future.exception()  # read, not raised: a raised error's traceback would hold this frame
        if error is not None:
            self._answer_error(error)
            return
        try:
            answer = self._started.answer_inline(self._model, future.result())
        except Exception as exc:  # noqa: BLE001 - answered in v2's shape, an unknown one as 500
            self._answer_error(exc)
            return
        if answer is None:  # outputs too big to encode on the event loop
            task = asyncio.get_running_loop().create_task(self._encode(future.result()))
            _ENCODING.add(task)
            task.add_done_callback(_ENCODING.discard)
            return
        self._answer(answer)

    def client_left(self) -> None:
        """Its client left first: dropped if still queued (one computing runs to its end)."""
        if self._done:
            return
        self._started.call.withdraw()
        self._end(CLIENT_CLOSED)

    def cancel(self, msg: Any = None) -> None:
        """The server's graceful stop ran out of time for it: the client, still waiting, is told
        503 (as a task cut off is, server/asgi/disconnect.py), and the call dropped if queued;
        at the loop's next turn, as a task's cancellation lands: uvicorn is iterating the set
        this call is taken out of."""
        asyncio.get_running_loop().call_soon(self._cut_off)

    def _cut_off(self) -> None:
        if self._done:
            return
        self._started.call.withdraw()
        self._answer_error(Unavailable(CUT_OFF))

    async def _encode(self, results: Any) -> None:
        try:
            answer = await self._started.encoded(self._model, results)
        except Exception as exc:  # noqa: BLE001 - answered in v2's shape
            self._answer_error(exc)
            return
        self._answer(answer)

    def _answer(self, answer: tuple[bytes, int | None]) -> None:
        content, binary_header_length = answer
        self._respond(200, _answer_headers(content, binary_header_length), content)

    def _answer_error(self, error: BaseException) -> None:
        status, content, extra = error_parts(error)
        self._respond(status, body_headers(content, extra, JSON), content)

    def _respond(self, status: int, headers: Headers, body: bytes) -> None:
        """Write the answer, once, unless the client left or the stop cut the call off first.
        Its place in flight is given back first: writing it starts a request pipelined behind
        it, which the bound must have room for."""
        if self._done:
            return
        self._end(status)
        self._write(status, headers, body)

    def _end(self, status: int) -> None:
        self._done = True
        self._running.discard(self)
        self._hold.release()
        if self._callbacks is not None:
            self._callbacks.remove(self.client_left)
            self._callbacks = None
        record = self._record
        if record is not None:
            client, path = self._where
            self._access_log.write(client, path, self._model, status, self._started_ns, record)


def _answer_headers(content: bytes, binary_header_length: int | None) -> Headers:
    """The headers of an infer answer: JSON, or binary data after a JSON header of the given length."""
    if binary_header_length is None:
        return body_headers(content, None, JSON)
    return body_headers(content, {HEADER_LENGTH: str(binary_header_length)}, _BINARY)


def _peer(scope: Scope) -> str:
    """The client's address as the access log writes it."""
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"


_NOWHERE = ("", "")  # no access log line is written
_ENCODING: set[asyncio.Task[None]] = set()  # inline answers encoding big outputs on a thread, kept till done

_IDENTITY = ("identity", "")
_MAX_DEFLATE_RATIO = 1032  # deflate's largest expansion: a 1 KiB body can inflate to ~1 MiB
_GZIP_WBITS = 16 + zlib.MAX_WBITS
# A gzip body may hold several members, one after another (`cat a.gz b.gz`); a client's holds one
# or a few. Each member's end copied the rest of the body: 200,000 members of 21 bytes (4 MB)
# took 7 s, holding the interpreter from the event loop, and 64 MiB of them would take hours.
MAX_GZIP_MEMBERS = 1024
_INFLATE_FEED = 64 << 10  # the body is given to the inflater a piece at a time: what a member's end copies


def _decompressed(body: bytes, encoding: str, limit: int) -> bytes:
    """The body without its Content-Encoding, refused as soon as it passes `limit`: a body of
    kilobytes can inflate to gigabytes, so it is never inflated further than the limit."""
    if encoding in ("gzip", "x-gzip"):  # RFC 9110 8.4.1.3: x-gzip is gzip
        return _inflate(body, _GZIP_WBITS, "gzip", limit)
    if encoding == "deflate":
        # RFC 9110 means the zlib format (what tritonclient, curl and browsers send), but some
        # clients send bare deflate; accept both, as browsers and urllib3 do for responses.
        try:
            return _inflate(body, zlib.MAX_WBITS, "deflate", limit)
        except InvalidInput as wrapped:
            try:
                return _inflate(body, -zlib.MAX_WBITS, "deflate", limit)
            except InvalidInput:
                raise wrapped from None
    raise InvalidInput(f"unsupported Content-Encoding {encoding!r}; use gzip or deflate")


def _inflate(body: bytes, wbits: int, name: str, limit: int) -> bytes:
    """Inflate every member of `body` (gzip allows several, one after another, up to
    MAX_GZIP_MEMBERS), fed _INFLATE_FEED bytes at a time, in steps that never produce more than
    the limit allows. An inflater that stops short of its output bound has taken all it was
    given, or ended its member with the rest of that piece unused."""
    out = bytearray()
    view = memoryview(body)
    position = 0  # where the body not yet given to an inflater starts
    inflater = zlib.decompressobj(wbits)
    members = 1
    try:
        while True:
            if inflater.eof:
                position -= len(inflater.unused_data)
                if position == len(view):
                    return bytes(out)
                if wbits != _GZIP_WBITS:
                    raise InvalidInput(f"the body is not valid {name}: data follows the end of the compressed stream")
                members += 1
                if members > MAX_GZIP_MEMBERS:
                    raise InvalidInput(f"the body is not valid {name} here: it holds more than {MAX_GZIP_MEMBERS} "
                                       "members; compress it as one")
                inflater = zlib.decompressobj(wbits)
            if position == len(view):
                raise InvalidInput(f"the body is not valid {name}: it ends before the compressed stream does")
            piece = view[position:position + _INFLATE_FEED]
            position += len(piece)
            out += inflater.decompress(piece, limit + 1 - len(out))
            if len(out) > limit:
                raise PayloadTooLarge(f"the decompressed request body exceeds the limit of {limit} bytes")
    except zlib.error as exc:
        raise InvalidInput(f"the body is not valid {name}: {exc}") from exc


def _header_length(headers: dict[bytes, bytes]) -> int | None:
    raw = headers.get(_HEADER_LENGTH_KEY)
    if raw is None:
        return None
    length = declared_length(raw)
    if length is None or length >= TOO_LONG:
        raise InvalidInput(f"{HEADER_LENGTH} must be a non-negative integer, got {raw.decode('latin-1')[:40]!r}")
    return length


async def _send(
    scope: Scope, send: Send, status: int, body: bytes, extra: dict[str, str] | None, content_type: bytes = JSON
) -> int:
    await send_response(scope, send, status, body_headers(body, extra, content_type), body)
    return status


class FastInferApp:
    """Routes POST .../infer to the bare endpoint and everything else to the FastAPI app, whose
    POST bodies (the control plane's small JSON objects) are capped at CONTROL_BODY_BYTES, but
    for those under `own_bodies`: routes that bound their own bodies (OpenAI's /v1, whose
    embeddings bodies run to the server's body limit)."""

    def __init__(
        self,
        app: ASGIApp,
        endpoint: InferEndpoint,
        control_body_bytes: int = CONTROL_BODY_BYTES,
        own_bodies: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.endpoint = endpoint
        self._control_limit = control_body_bytes
        self._own_bodies = own_bodies

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            match = INFER_PATH.fullmatch(scope["path"])
            if match is not None:
                await self.endpoint(scope, receive, send, match["model"], match["version"])
                return
            if scope["path"].startswith(self._own_bodies):
                await self.app(scope, receive, send)
                return
            await self._control(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _control(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A control-plane POST: 413 at once for a declared length over the limit; otherwise
        the body is counted as the app reads it, and PayloadTooLarge (413) raised past it."""
        limit = self._control_limit
        declared = declared_length(dict(scope["headers"]).get(_CONTENT_LENGTH))
        if declared is not None and declared > limit:
            await _send(scope, send, *error_parts(PayloadTooLarge(_control_too_large(limit))))
            return
        size = 0

        async def counted() -> Message:
            nonlocal size
            message = await receive()
            size += len(message.get("body", b""))
            if size > limit:
                raise PayloadTooLarge(_control_too_large(limit))
            return message

        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except asyncio.CancelledError:
            if started or self.endpoint.plane is None or not self.endpoint.plane.stopping:
                raise
            # uvicorn's graceful stop ran out of time for a load still building or warming up
            # (the load goes on to its end): the client, still waiting, is told 503 in the
            # protocol's shape, where uvicorn answered a plain-text 500 and logged a traceback
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()
            await _send(scope, send, *error_parts(Unavailable(CONTROL_CUT_OFF)))


def _control_too_large(limit: int) -> str:
    return f"the request body exceeds the control plane's limit of {limit} bytes"
