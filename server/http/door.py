"""Refusals the HTTP protocol answers itself, before uvicorn makes an ASGI task for them.

Under overload most requests are refused, and what a refusal costs is what the server has left
to serve the rest: on one core, an ASGI 429 costs about as much as a whole request cycle of the
framework (a task, the app's layers, two sends). The door looks at a request's head as uvicorn
parsed it and, for an infer call the server would refuse with a 429 anyway (in-flight bounds,
or a full queue), writes the constant answer to the socket at once; its body is discarded as it
arrives, and the connection is kept (closed for a client waiting for 100 Continue, which may
never send its body, and for one that asked to close). An infer call it lets in goes straight
to the infer endpoint with what the door read (the model, the headers, the body bytes it will
hold): the access gate and the router in front of the endpoint would only ask again. Everything
else, and every request the access gate would refuse (401 comes before 429), goes the usual way.
An admitted call of at most 16 KiB, sent as is, whose body comes whole in the same read as its
head (what clients of small models send) is answered inline: started on the data plane (in a
front-end process, sent to the server process's) from the parser's callback and answered from
its future's, with no ASGI task (InferEndpoint.answered_inline); its start asks the model's
queue in the same turn, so the door leaves that to it. One whose body comes in later reads is
asked by the door then (a full queue refuses it at once, the rest of its body dropped) and takes
the endpoint's task, whose body timeout refuses a client that stops part-way.

The same protocol offers the app a way to write a whole response in one piece
(server/asgi/respond.py), which the infer route takes for its answers and errors (and the
control plane for its 413); the endpoint's own 429, rare once the door refuses first, still
goes as two ASGI messages.

This subclasses uvicorn's httptools protocol and relies on its request cycle: its state
(`response_started`, `response_complete`, `keep_alive`, `disconnected`,
`waiting_for_100_continue`), its `flow`, `transport`, `default_headers`, `message_event` and
`on_response`, its `body` and `more_body`, and `send` being the cycle's own method; the
protocol's `tasks`, where an inline call stands for its task (uvicorn waits for them on a
graceful stop and cancels what is left when it times out); and its keep-alive timer
(`timeout_keep_alive_task`, `timeout_keep_alive`, `timeout_keep_alive_handler`, the reads and
answers that call `_unset_keepalive_if_required` and `on_response_complete`), which the door
arms once per idle spell rather than once per request. uvicorn is pinned in pyproject, and
the tests drive keep-alive, pipelining, 100-continue, HTTP/1.0 and shutdown through a real
uvicorn.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from server.asgi.disconnect import DISCONNECT_EXTENSION, disconnect_callbacks
from server.asgi.respond import RESPOND_EXTENSION, Headers, body_headers, send_messages
from server.asgi.types import ASGIApp, Scope, Send
from server.errors import BatchlineError, QueueFull
from server.http.auth import AccessGate
from server.http.infer import (
    BUSY,
    BUSY_BODY,
    INFER_PATH,
    FastInferApp,
    InferEndpoint,
    WriteWhole,
    content_length,
    inline,
)
from server.protocol.v2 import encode_error

if TYPE_CHECKING:
    from uvicorn._types import ASGI3Application

WHOLE_BYTES = 64 << 10  # a body up to this is joined to its head (one write); a larger one is written apart
# A request's line and headers (or a chunked body's trailers) past this are refused (431) and the
# connection closed: the parser joins a long line or value piece by piece, and 400 MB of one
# header held the loop for 88 s.
MAX_HEAD_BYTES = 64 << 10
# A request's line and headers still coming this long after the idle timer first finds them
# unfinished are refused (408) and the connection closed, as nginx's client_header_timeout does: a
# client sending its head a byte now and then would otherwise hold its connection for ever.
HEAD_TIMEOUT_S = 30.0
# Requests a connection may have queued behind the one being answered. The parser takes a whole
# read at once (256 KiB: thousands of small requests), and each queued request holds its state
# (about 900 bytes): 100 connections pipelining GETs they never read held 570 MB. Past this, the
# rest of the read is dropped, and the connection closes after the queued requests' answers; a
# client that pipelines retries what went unanswered (RFC 9112, 9.3.2).
MAX_PIPELINED = 64
# After those answers the server closes its side and reads on, dropping what comes, this long at
# most before it closes: closed with bytes unread, a connection is reset, and a reset can lose
# answers the client has not read yet (as nginx's lingering close).
LINGER_S = 2.0
_EXPECT = b"expect"
_MAX_CACHED_BODIES = 256


class Refused(NamedTuple):
    """A 429 to answer now: its body, its Retry-After, and whether the connection closes."""

    body: bytes
    retry_after: str
    close: bool


class Admitted(NamedTuple):
    """An infer call the access gate lets through and the bounds have room for, with what the
    door read of its head: the protocol hands it to the endpoint directly, past the app's layers
    that would only ask again."""

    model: str
    version: str | None
    headers: dict[bytes, bytes]
    reserved: int  # the body bytes it holds while in flight (InferEndpoint.reservation)
    inline: bool  # answered without a task once its body is in (InferEndpoint.answered_inline)


class Door:
    """Decides, from a request's head alone, which infer calls are refused before the app, and
    which go straight to the infer endpoint."""

    def __init__(self, gate: AccessGate, endpoint: InferEndpoint) -> None:
        self._gate = gate
        self._endpoint = endpoint
        self._bodies: dict[str, bytes] = {}  # a full queue's message -> its encoded error body

    @classmethod
    def of(cls, app: Any) -> Door | None:
        """The door of an app `create_app` built (None for any other ASGI app)."""
        if isinstance(app, AccessGate) and isinstance(app.app, FastInferApp):
            return cls(app, app.app.endpoint)
        return None

    def decide(self, scope: Scope) -> Refused | Admitted | None:
        """A 429 to answer now; an infer call for the endpoint; or None: not an infer call, or
        one the gate refuses (401 comes before 429), which the app answers."""
        if scope["method"] != "POST":
            return None
        match = INFER_PATH.fullmatch(scope["path"])
        if match is None or not self._gate.admits_data(scope):  # an infer call is a data route
            return None
        headers = dict(scope["headers"])
        endpoint = self._endpoint
        length = content_length(headers)
        reserved = endpoint.reservation(length)
        plane = endpoint.plane
        if not endpoint.flight.has_room(reserved):
            if plane is not None and plane.stopping:
                return Admitted(match["model"], match["version"], headers, reserved, False)  # its 503, not a 429
            return self._refused(scope, match["model"], headers, BUSY_BODY, "1")
        admitted = Admitted(match["model"], match["version"], headers, reserved,
                            endpoint.answers_inline and inline(headers, length))
        if admitted.inline:
            return admitted  # its start asks the model's queue in this same turn; `queue_refusal` if its body comes later
        refused = self.queue_refusal(admitted, scope)
        return admitted if refused is None else refused

    def queue_refusal(self, call: Admitted, scope: Scope) -> Refused | None:
        """A 429 to answer now for a call whose model's queue is full; None for any other (the
        queues are in the server process, which refuses there; or 404 and 503, which the
        endpoint answers, its access log line with the request's id)."""
        plane = self._endpoint.plane
        if plane is None:
            return None
        try:
            plane.admit(call.model, call.version)
        except QueueFull as exc:
            return self._refused(scope, call.model, call.headers, self._queue_full_body(exc), exc.retry_after)
        except BatchlineError:
            pass
        return None

    def _refused(self, scope: Scope, model: str, headers: dict[bytes, bytes], body: bytes, retry_after: str) -> Refused:
        self._endpoint.log_refusal(scope, model, BUSY, time.perf_counter_ns())
        return Refused(body, retry_after, headers.get(_EXPECT, b"").lower() == b"100-continue")

    def app_for(self, call: Admitted) -> ASGIApp:
        """The ASGI app that answers an admitted call: the endpoint, given what the door read."""
        return functools.partial(self._endpoint.admitted, call.model, call.version, call.headers, call.reserved)

    def answered_inline(
        self, call: Admitted, scope: Scope, body: bytes | bytearray, write: WriteWhole, running: set[Any],
    ) -> bool:
        """Answer an admitted `inline` call, its whole body in, without a task; False when it
        must take `app_for`'s way after all (InferEndpoint.answered_inline)."""
        return self._endpoint.answered_inline(call.model, call.version, call.headers, call.reserved, scope, body,
                                              write, running)

    def _queue_full_body(self, error: QueueFull) -> bytes:
        body = self._bodies.get(error.message)
        if body is None:
            body = encode_error(error.message)
            if len(self._bodies) < _MAX_CACHED_BODIES:
                self._bodies[error.message] = body
        return body


def door_protocol(door: Door) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with `door` in front of the app."""

    class DoorProtocol(HttpToolsProtocol):
        _last_started: RequestResponseCycle | None = None  # the latest request started, either way
        _inline: tuple[RequestResponseCycle, Admitted] | None = None  # an inline call waiting for its body
        _answering = False  # within an inline call's start, where an answer given at once completes later
        _in_message = False  # from a request's first byte to its end
        _begun = 0  # requests begun on this connection
        _bodies = 0  # pieces of body read on this connection
        _head_bytes = 0  # read of the unfinished request since its last piece of body: head, or trailers
        _idle_since: float | None = None  # when the last answer completed with nothing read since (loop time)
        _head_timed = 0  # the request (by `_begun`) whose unfinished head the idle timer found last
        _dropping = False  # MAX_PIPELINED were queued: what follows them is dropped, and the connection closed

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # as uvicorn's
            """uvicorn's, and the idle timer armed: a connection that sends no request is closed
            as one idle after its answers is."""
            super().connection_made(transport)
            self._idle_since = self.loop.time()
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self._keep_alive_due)

        def data_received(self, data: bytes) -> None:
            """Counted a read at a time, after the parser has it, so the parser has taken at most
            a read more than the limit when the head is refused. A read that began a request
            from idle counts whole; one where a piece of body came, or a request began after
            others (pipelined in the same read), counts from the next read on: a request's
            body, and requests that follow each other, never add up."""
            if self._dropping:  # past MAX_PIPELINED: nothing more is parsed on this connection
                self._unset_keepalive_if_required()
                return
            idle = not self._in_message
            begun, bodies = self._begun, self._bodies
            super().data_received(data)
            if self._inline is not None:
                # Its body did not come whole with its head: refused now if its model's queue is
                # full (the rest of its body dropped), else the task's way, which times out a body
                # that stops part-way.
                cycle, call = self._inline
                self._inline = None
                refused = door.queue_refusal(call, _asgi(cycle))
                if refused is None:
                    self._start_task(cycle, call)
                else:
                    self._refuse(cycle, refused)
            if not self._in_message or self.transport.is_closing() or self._dropping:
                return
            began = self._begun - begun
            if self._bodies != bodies or began > 1 or (began == 1 and not idle):
                self._head_bytes = 0
            elif began == 1:
                self._head_bytes = len(data)
            else:
                self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse_head()

        def on_message_begin(self) -> None:
            self._begun += 1
            self._in_message = True
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            """uvicorn's: the request's cycle, started or queued; none past MAX_PIPELINED queued,
            and none after (reading stays paused while requests are queued)."""
            if self._dropping:
                return
            if len(self.pipeline) >= MAX_PIPELINED:
                self._dropping = True
                return
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if self._dropping:
                return
            self._bodies += 1
            super().on_body(body)

        def _refuse_head(self, status: int = 431) -> None:
            """431 (too long) or 408 (too slow), and close; only a close while an answer of this
            connection is still due (its own, for trailers; or one pipelined before it, lost with
            the connection: a client sending such a head behind its own requests gets no more
            answers)."""
            if self.cycle is None or self.cycle.response_complete:
                if status == 431:
                    body = encode_error(f"the request's line and headers exceed {MAX_HEAD_BYTES} bytes")
                else:
                    body = encode_error(f"the request's line and headers did not come whole within {HEAD_TIMEOUT_S:g} s")
                self.transport.write(b"".join([
                    *_head(status, self.server_state.default_headers, body_headers(body, {}), False), body]))
            self.transport.close()

        def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
            self._last_started = cycle
            # A client that does not read its answers gets no more written for it here: the app's
            # path waits for the socket to drain, and pauses reading meanwhile.
            scope: Scope = cycle.scope  # type: ignore[assignment]  # as _asgi, less a call a request
            decision = None if self.flow.write_paused else door.decide(scope)
            if isinstance(decision, Admitted) and decision.inline and app is self.app:
                self._inline = (cycle, decision)  # answered when its body is whole, in this read
                if not cycle.more_body:  # a pipelined request, read whole while the one before ran
                    self._answer_inline()
                return
            if not isinstance(decision, Refused):
                extensions = scope.setdefault("extensions", {})
                extensions[DISCONNECT_EXTENSION] = []  # see connection_lost
                # HttpFrontEnd turns uvicorn's access log off (the server writes its own), so
                # what uvicorn's send would have logged is not missed
                extensions[RESPOND_EXTENSION] = _respond_whole
                # (`app` is not the server's own when uvicorn answers 503 for its concurrency limit)
                if isinstance(decision, Admitted) and app is self.app:
                    app = door.app_for(decision)
                super()._start_asgi_task(cycle, app)
                return
            self._refuse(cycle, decision)

        def _refuse(self, cycle: RequestResponseCycle, refused: Refused) -> None:
            """Write the 429 now; what follows of the body is dropped as it comes."""
            body, retry_after, close = refused
            close = close or not cycle.keep_alive
            cycle.response_started = cycle.response_complete = True
            headers = body_headers(body, {"Retry-After": retry_after})
            self.transport.write(b"".join([*_head(BUSY, self.server_state.default_headers, headers, not close), body]))
            if close:
                self.transport.close()
            self.loop.call_soon(self._complete_later, cycle)

        def on_message_complete(self) -> None:
            """Read on once a body is whole, as after a small one. Its last part, past uvicorn's
            high-water mark, paused reading, and only the app's next `receive` resumes it: an
            endpoint with the whole body asks no more, so a client that left went unnoticed and
            its queued call ran. A pipelined request waiting its turn keeps reading paused, as
            uvicorn has it. An inline call waiting for its body is answered now."""
            self._in_message = False
            if self._dropping:
                return
            super().on_message_complete()
            if not self.pipeline:
                self.flow.resume_reading()
            if self._inline is not None and self._inline[0] is self.cycle:
                self._answer_inline()

        def _answer_inline(self) -> None:
            """Start the inline call whose body is whole (Door.answered_inline); the client
            leaving is told through the same callbacks as a task's (see connection_lost). One
            whose tensors turn out too big for the loop takes the task after all, its body
            already read."""
            cycle, call = self._inline  # type: ignore[misc]
            self._inline = None
            scope: Scope = cycle.scope  # type: ignore[assignment]  # as _asgi, less a call a request
            scope.setdefault("extensions", {})[DISCONNECT_EXTENSION] = []
            self._answering = True
            try:
                taken = door.answered_inline(call, scope, cycle.body,
                                             functools.partial(self._write_inline, cycle), self.tasks)
            finally:
                self._answering = False
            if not taken:
                self._start_task(cycle, call)

        def _write_inline(self, cycle: RequestResponseCycle, status: int, headers: Headers, body: bytes) -> None:
            """An inline call's answer. One given at once (a 400, a 404, a 429) is written from
            within the parser's callbacks, or from uvicorn's completion of the request before:
            it completes at the next turn, as a refusal at the door does. Completing it there
            would start the next pipelined request from within this one, request after request
            (hundreds pipelined overflowed the stack), and arm the keep-alive timer under a
            request that follows in the same read."""
            if not self._answering:
                _write_whole(cycle, status, headers, body)
            elif _write_whole(cycle, status, headers, body, complete=False):
                self.loop.call_soon(self._complete_later, cycle)

        def _start_task(self, cycle: RequestResponseCycle, call: Admitted) -> None:
            """The endpoint's task for an admitted call (Door.app_for), as for one not inline."""
            extensions = _asgi(cycle).setdefault("extensions", {})
            extensions[DISCONNECT_EXTENSION] = []
            extensions[RESPOND_EXTENSION] = _respond_whole
            super()._start_asgi_task(cycle, cast("ASGI3Application", door.app_for(call)))  # see _asgi

        def _unset_keepalive_if_required(self) -> None:
            """uvicorn's way, called on every read, cancels the idle timer that each answer
            arms: a timer made and cancelled per request (2.3 us here, a few percent of a small
            call). Here a read only marks the connection busy; the one timer armed stays, and
            when it fires (`_keep_alive_due`) closes the connection only if it has been idle
            for the whole keep-alive timeout since its last answer."""
            self._idle_since = None

        def on_response_complete(self) -> None:
            """uvicorn's: count it, start the next pipelined request; with none, read on, and the
            connection is idle from now: the idle timer is armed unless it is already. uvicorn
            reads on before the next pipelined request too: a client pipelining without reading
            its answers then brought a read's worth of requests (hundreds) for every answer,
            queued with their state, and the server's memory grew by a gigabyte in seconds."""
            self.server_state.total_requests += 1
            if self.transport.is_closing():
                return
            self._idle_since = None
            if self.pipeline:
                cycle, app = self.pipeline.pop()
                if not self.pipeline and not self._dropping:  # the last queued: its body may still be coming
                    self.flow.resume_reading()  # (and its client leaving)
                self._start_asgi_task(cycle, app)
                return  # with more queued, reading stays paused, as uvicorn paused it for them
            if self._dropping:  # the queued are answered: what came after them was not, nor will be
                self._linger()
                return
            self.flow.resume_reading()
            self._idle_since = self.loop.time()
            if self.timeout_keep_alive_task is None:
                self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self._keep_alive_due)

        def _linger(self) -> None:
            """End the connection without a reset: the server's side closed (the client reads its
            answers, then the end), what still comes read and dropped, then closed."""
            self._stop_idle_timer()
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.flow.resume_reading()
            self.loop.call_later(LINGER_S, self.transport.close)

        def _keep_alive_due(self) -> None:
            """Close a connection idle for the keep-alive timeout; one idle for less waits the
            rest of it; one with a request under way waits for its answer to arm the timer, and
            one whose request's head is still coming, HEAD_TIMEOUT_S more for it (`_time_head`)."""
            self.timeout_keep_alive_task = None
            if self._idle_since is None:
                if (self._in_message and not self.flow.read_paused  # paused: the server, not the client, waits
                        and not (self.cycle is not None and self.cycle.scope is self.scope)):
                    self._time_head()  # (uvicorn makes a request's cycle, with its scope, once its head is read)
                return
            left = self._idle_since + self.timeout_keep_alive - self.loop.time()
            if left > 0:
                self.timeout_keep_alive_task = self.loop.call_later(left, self._keep_alive_due)
            else:
                self.timeout_keep_alive_handler()

        def _time_head(self) -> None:
            """A head still coming: 408 if it was already when the timer last fired, else
            HEAD_TIMEOUT_S more for it. Nothing per request: the one idle timer does it."""
            if self._head_timed == self._begun:
                self._refuse_head(408)
            else:
                self._head_timed = self._begun
                self.timeout_keep_alive_task = self.loop.call_later(HEAD_TIMEOUT_S, self._keep_alive_due)

        def handle_websocket_upgrade(self) -> None:
            """The connection passes to another protocol: the idle timer goes with this one."""
            self._stop_idle_timer()
            super().handle_websocket_upgrade()

        def _stop_idle_timer(self) -> None:
            if self.timeout_keep_alive_task is not None:
                self.timeout_keep_alive_task.cancel()
                self.timeout_keep_alive_task = None

        def connection_lost(self, exc: Exception | None) -> None:
            """Tell the requests of this connection that wait on their work that the client left
            (server/asgi/disconnect.py): they are dropped at once, with no task per request
            watching for it. The idle timer goes with the connection."""
            cycles = {id(c): c for c in (self.cycle, self._last_started) if c is not None}
            self._stop_idle_timer()
            super().connection_lost(exc)
            for cycle in cycles.values():
                if not cycle.response_complete:
                    for client_left in list(disconnect_callbacks(_asgi(cycle)) or ()):
                        client_left()
                # What uvicorn does as a request's task ends: an inline call has none, and its
                # cycle's `on_response` (this protocol's method) would keep the connection in a
                # reference cycle, left for a rare collection.
                cycle.on_response = _nothing

        def _complete_later(self, cycle: RequestResponseCycle) -> None:
            """Complete a response written while the parser ran, as if it completed later, as
            it does through the app: by then the parser has seen the rest of its read, and a
            request that followed owns the connection."""
            if self._last_started is cycle:
                self.on_response_complete()  # the next pipelined request, or the keep-alive timer
            else:  # a later request runs already: it starts what is pipelined when it is answered
                self.server_state.total_requests += 1

    return DoorProtocol


def _asgi(cycle: RequestResponseCycle) -> Scope:
    """A cycle's scope as the ASGI mapping the server's code reads. uvicorn types it as its own
    TypedDict of an HTTP scope (and an app as taking one): the same mapping, typed apart."""
    return cycle.scope  # type: ignore[return-value]


def _nothing() -> None:
    pass


async def _respond_whole(send: Send, status: int, headers: Headers, body: bytes) -> None:
    """What uvicorn's two sends of a response do (flow control, keep-alive, completion), in one
    write; a body over WHOLE_BYTES goes in a second write rather than be copied. `headers` come
    from the app's own code (server/asgi/respond.py says what they hold), so they are not checked
    against uvicorn's patterns. The request cycle is found through `send`, the cycle's own
    method, rather than held in the scope: that would make a reference cycle of every request,
    left for the garbage collector instead of freed at once. A HEAD request's answer goes
    uvicorn's way, which writes its head alone (the client reads no body after it)."""
    cycle = getattr(send, "__self__", None)
    if not isinstance(cycle, RequestResponseCycle) or cycle.scope["method"] == "HEAD":
        await send_messages(send, status, headers, body)  # a layer wrapped send, or HEAD: its way
        return
    if cycle.flow.write_paused and not cycle.disconnected:
        await cycle.flow.drain()
    if cycle.response_started and not cycle.disconnected:
        raise RuntimeError("a response was already started for this request")
    _write_whole(cycle, status, headers, body)


def _write_whole(
    cycle: RequestResponseCycle, status: int, headers: Headers, body: bytes, complete: bool = True,
) -> bool:
    """Write a whole response for `cycle` now and, unless told not to, complete it as uvicorn's
    sends would (keep-alive, the next pipelined request); nothing for a client that left (False).
    An inline answer writes without waiting for the socket to drain: the connection has no other
    answer due (reading stays paused while one is), so the kernel's buffer holds one at most."""
    if cycle.disconnected:
        return False
    keep_alive = cycle.keep_alive
    head = _head(status, cycle.default_headers, headers, keep_alive)
    cycle.response_started = cycle.response_complete = True
    cycle.waiting_for_100_continue = False
    if len(body) <= WHOLE_BYTES:
        cycle.transport.write(b"".join([*head, body]))
    else:  # joining would copy it, on the event loop: megabytes of binary outputs
        cycle.transport.write(b"".join(head))
        cycle.transport.write(body)
    cycle.message_event.set()
    if not keep_alive:
        cycle.transport.close()
    if complete:
        cycle.on_response()
    return True


def _head(status: int, default_headers: list[tuple[bytes, bytes]], headers: Headers, keep_alive: bool) -> list[bytes]:
    """A response's status line and header lines, uvicorn's default headers first, and the blank
    line; `connection: close` when the connection ends with it."""
    lines = [STATUS_LINE[status], _default_lines(default_headers)]
    for name, value in headers:  # a loop, not a generator: every answer comes here
        lines += (name, b": ", value, b"\r\n")
    lines.append(b"\r\n" if keep_alive else b"connection: close\r\n\r\n")
    return lines


_default_head: tuple[list[tuple[bytes, bytes]], bytes] = ([], b"")


def _default_lines(default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """uvicorn's default headers (server, date) as header lines, joined once per list: uvicorn
    replaces the list when the date changes, once a second, and never changes one in place.
    The list is held, so another one cannot take its identity."""
    global _default_head
    held, lines = _default_head
    if held is not default_headers:
        lines = b"".join(name + b": " + value + b"\r\n" for name, value in default_headers)
        _default_head = (default_headers, lines)
    return lines
