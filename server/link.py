"""The boundary between HTTP front-end processes and the server process (`--http-workers`).

A front-end process parses and encodes; the server process admits, batches and computes, so
batches form across every front end and one process owns each device's instances. Each front
end holds one Unix-socket connection to the server process and multiplexes its calls on it, in
the wire format of `server.link_frames`; the frames of one loop turn go out in one write.

Shared memory: each side owns an arena (`server.arena`) that the other maps at the handshake
(hello, hello, mapped); a tensor of MIN_SLOT bytes or more crosses in a slot of its sender's
arena. The front end frees its input slots when the answer comes: every call is answered,
a cancelled one too, and only once nothing reads its inputs any more: a cancel drops a call
still queued, and one already computing (or in admission on a worker thread) runs to its end
and is answered then, its outputs read by nobody. The server process frees an output slot
when the front end says it has read it (`f`, on its next frame). A side whose arena the other
could not map sends everything inline.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from server.arena import Arena
from server.dataplane import Call, DataPlane
from server.errors import BatchlineError, Cancelled, Unavailable
from server.link_frames import (
    Frame,
    FrameReader,
    Tensor,
    arena_slots,
    error_from,
    error_header,
    fill_record,
    frame_bytes,
    free_slots,
    pack_tensors,
    record_fields,
    unpack_tensors,
)
from server.scheduler.admission import REQUEST_OPTIONS
from server.scheduler.request import RequestRecord

logger = logging.getLogger(__name__)

ARENA_BYTES = 32 << 20  # each side's arena, per front end; a tensor that finds no slot goes inline
GONE = "the server process is gone; this front end is stopping"
CANCELLED = "the call was cancelled"

# A call the server process decodes itself: (model, version, body, header length, record, received_ns).
RawInfer = Callable[[str, str | None, bytes, int | None, RequestRecord | None, int],
                    Coroutine[Any, Any, tuple[bytes, int | None]]]


class _Stream(asyncio.Protocol):
    """One end of a link: frames in, frames out."""

    def __init__(self) -> None:
        self._reader = FrameReader()
        self.transport: asyncio.Transport | None = None
        self._outgoing: list[bytes | memoryview] = []  # frames to write at the end of this loop turn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._reader.feed(data)
        except ValueError:
            logger.exception("a link sent a frame out of step; closing it")
            if self.transport is not None:
                self.transport.close()
            return
        for frame in frames:
            self.frame_received(frame)

    def frame_received(self, frame: Frame) -> None:
        raise NotImplementedError

    def send(self, header: dict[str, Any], payload: list[bytes] | None = None) -> None:
        """Queue a frame; the frames of one loop turn go out in one write (a system call per
        batch of answers, not per answer)."""
        if not self._outgoing:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outgoing.extend(frame_bytes(header, payload))  # type: ignore[arg-type]

    def _flush(self) -> None:
        outgoing, self._outgoing = self._outgoing, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(outgoing)


class PlaneLink(_Stream):
    """The server process's end of one front end's link: each call runs on the data plane.

    An infer call is started on the data plane as its frame arrives and answered from its
    future's done callback, without a task of its own (a task awaiting a future costs several
    microseconds, a callback under one). Every outcome (outputs, error, cancel) is answered."""

    def __init__(self, plane: DataPlane, infer_raw: RawInfer) -> None:
        super().__init__()
        self._plane = plane
        self._infer_raw = infer_raw
        # calls not yet answered, by id: each one's future, and how to stop it once its caller gave up
        self._calls: dict[int, tuple[asyncio.Future[Any], Callable[[], object]]] = {}
        self._peer_arena: Arena | None = None  # the front end's: inputs
        self._arena: Arena | None = None  # this side's: outputs, once the front end has mapped it

    def frame_received(self, frame: Frame) -> None:
        header = frame.header
        free_slots(self._arena, header.get("f", ()))
        kind = header.get("k")
        if kind == "infer":
            self._start(header, frame.payload)
        elif kind == "raw":
            self._start_raw(header, frame.payload)
        elif kind == "cancel":
            running = self._calls.get(header["i"])
            if running is not None:
                running[1]()  # answered by its done callback: at once if dropped, else when it ends
        elif kind == "hello":
            self._hello(header)
        elif kind == "mapped" and self._arena is not None:
            self._arena.forget_file()  # mapped there, or never to be: either way no file is left
            if not header.get("outputs_mapped"):
                self._arena = None

    def _hello(self, header: dict[str, Any]) -> None:
        if header.get("arena"):
            try:
                self._peer_arena = Arena.attach(header["arena"])
                self._peer_arena.forget_file()
            except (OSError, ValueError) as exc:
                logger.warning("a front end's shared memory could not be mapped (%s): its tensors come inline", exc)
        try:
            self._arena = Arena.create(ARENA_BYTES, "batchline-out")
        except OSError as exc:
            logger.warning("no shared memory for a front end's outputs (%s): they go inline", exc)
        self.send({"k": "hello", "arena": self._arena.path if self._arena else None,
                   "inputs_mapped": self._peer_arena is not None})

    def _start(self, header: dict[str, Any], payload: memoryview) -> None:
        """Start a decoded call on the data plane; a refusal is answered at once."""
        call = header["i"]
        record = RequestRecord() if header.get("r") else None
        plane = self._plane
        try:
            inputs = unpack_tensors(header["in"], payload, self._peer_arena, copy=False)
            model = plane.admit(header["m"], header["v"])
            if record is not None:
                record.model_version = model.version
            batch_size = plane.check_inputs(model, {n: (d, list(a.shape)) for n, d, a in inputs})
            started = plane.start_call(
                model, {n: (d, a) for n, d, a in inputs}, header["p"], header["o"], record, header["t"], batch_size)
        except Exception as exc:  # noqa: BLE001 - every call is answered, so its input slots are freed
            self._answer_failure(call, exc)
            return
        self._calls[call] = (started.future, started.withdraw)
        started.future.add_done_callback(functools.partial(self._answer, call, started, model.version, record))

    def _start_raw(self, header: dict[str, Any], payload: memoryview) -> None:
        """Start a call this process decodes itself (it names the client's shared memory, whose
        regions are registered here): in a task, as decoding may go off the loop."""
        call = header["i"]
        record = RequestRecord() if header.get("r") else None
        task = asyncio.get_running_loop().create_task(self._infer_raw(
            header["m"], header["v"], bytes(payload), header["h"], record, header["t"]))
        self._calls[call] = (task, task.cancel)  # its inputs are its own copy: it may stop anywhere
        task.add_done_callback(functools.partial(self._answer_raw, call, record))

    def _answer(
        self, call: int, started: Call, version: int, record: RequestRecord | None, future: asyncio.Future[Any],
    ) -> None:
        if not self._still_owed(call, future):
            return
        failed = _failure(future)
        if failed is not None:
            self._answer_failure(call, failed)
            return
        slots: list[int] = []
        try:
            metas, data, slots = pack_tensors(started.outputs(future.result()), self._arena)  # freed once read there
            reply: dict[str, Any] = {"i": call, "out": metas, "ver": version}
            if record is not None:
                reply["rec"] = record_fields(record)
            self.send(reply, data)
        except BaseException as exc:  # noqa: BLE001 - cancelled too: every call is answered
            free_slots(self._arena, slots)  # taken for an answer that could not go out
            self._answer_failure(call, exc)

    def _answer_raw(self, call: int, record: RequestRecord | None, task: asyncio.Task[tuple[bytes, int | None]]) -> None:
        if not self._still_owed(call, task):
            return
        failed = _failure(task)
        if failed is not None:
            self._answer_failure(call, failed)
            return
        try:
            content, binary_header_length = task.result()
            reply: dict[str, Any] = {"i": call, "raw": binary_header_length}
            if record is not None:
                reply["rec"] = record_fields(record)
            self.send(reply, [content])
        except BaseException as exc:  # noqa: BLE001 - every call is answered
            self._answer_failure(call, exc)

    def _still_owed(self, call: int, future: asyncio.Future[Any]) -> bool:
        """Whether a call that just finished is still to be answered (not, once the link is lost:
        its outcome is then only read, so no error goes "never retrieved" into the log)."""
        if self._calls.pop(call, None) is not None:
            return True
        if not future.cancelled():
            future.exception()
        return False

    def _answer_failure(self, call: int, error: BaseException) -> None:
        cancelled = isinstance(error, asyncio.CancelledError)
        self.send(error_header(call, Cancelled(CANCELLED) if cancelled else error))
        if not cancelled and not isinstance(error, BatchlineError):
            logger.error("a call from a front end failed", exc_info=error)

    def connection_lost(self, exc: Exception | None) -> None:
        """The front end is gone: its calls are dropped (nobody is left to answer)."""
        calls, self._calls = self._calls, {}
        for running, _ in calls.values():  # no front end is left to reuse its inputs' memory
            running.cancel()
        if self._arena is not None:
            self._arena.forget_file()  # a front end that died before the handshake ended
        self.transport = None


class LinkCall:
    """A call sent over the link: its future gives the decoded answer (or the call's typed
    error), and `withdraw` stops it in the server process for a caller that gave up."""

    __slots__ = ("_link", "future", "id")

    def __init__(self, link: LinkClient, call: int, future: asyncio.Future[Any]) -> None:
        self._link = link
        self.id = call
        self.future = future

    def withdraw(self) -> None:
        """Its caller gave up: cancelled there if still running (an answer that comes anyway
        has its outputs released unread)."""
        self.future.cancel()
        self._link.cancel(self.id)

    async def answer(self) -> Any:
        """The decoded answer, once it comes; a caller cancelled meanwhile withdraws the call.
        Raised from here, the error's traceback holds this frame, and the frame would hold the
        error back through the future: a cycle keeping the caller's frames (the request's body
        and tensors) until a rare full collection, were they not let go first (as Call.answer)."""
        future = self.future
        try:
            return await future
        except asyncio.CancelledError:
            self._link.cancel(self.id)
            del self, future
            raise
        except BaseException:
            del self, future
            raise


# What an answer's frame is decoded into, on arrival: the outputs of an infer call, the body of a raw one.
_Decode = Callable[[Frame], Any]


class LinkClient(_Stream):
    """A front end's end of its link: calls out, each answer decoded on arrival and handed to
    its call's future."""

    def __init__(self, on_lost: Callable[[], None]) -> None:
        super().__init__()
        self._on_lost = on_lost
        self._next = 0
        # calls not yet answered, by id: the future, the input slots to free, how to decode the answer
        self._pending: dict[int, tuple[asyncio.Future[Any], list[int], _Decode]] = {}
        self._arena: Arena | None = None  # this side's: inputs
        self._peer_arena: Arena | None = None  # the server process's: outputs
        self._released: list[int] = []  # output slots read, to tell the server process on the next frame
        self._release_scheduled = False
        self._hello: asyncio.Future[Frame] | None = None
        self.lost = False

    @classmethod
    async def connect(cls, path: str, on_lost: Callable[[], None]) -> LinkClient:
        loop = asyncio.get_running_loop()
        _, link = await loop.create_unix_connection(lambda: cls(on_lost), path)
        await link._greet()
        return link

    async def _greet(self) -> None:
        """hello (this side's arena) -> hello (the server process's, and whether it mapped
        this one) -> mapped (whether this side mapped the server process's)."""
        try:
            self._arena = Arena.create(ARENA_BYTES, "batchline-in")
        except OSError as exc:
            logger.warning("no shared memory for this front end's inputs (%s): they go inline", exc)
        self._hello = asyncio.get_running_loop().create_future()
        try:
            self.send({"k": "hello", "arena": self._arena.path if self._arena else None})
            answer = (await self._hello).header
        finally:
            if self._arena is not None:
                self._arena.forget_file()  # mapped by the server process, or never to be
        if self._arena is not None and not answer.get("inputs_mapped"):
            self._arena = None
        if answer.get("arena"):
            try:
                self._peer_arena = Arena.attach(answer["arena"])
            except (OSError, ValueError) as exc:
                logger.warning("the server process's shared memory could not be mapped (%s): outputs come inline", exc)
        self.send({"k": "mapped", "outputs_mapped": self._peer_arena is not None})

    def frame_received(self, frame: Frame) -> None:
        """An answer: decoded now, its outputs copied out of the server process's arena and
        their slots released, then handed to its call's future (unread if nobody waits)."""
        header = frame.header
        if header.get("k") == "hello":
            if self._hello is not None and not self._hello.done():
                self._hello.set_result(frame)
            return
        waiting = self._pending.pop(header["i"], None)
        if waiting is None:
            return
        future, slots, decode = waiting
        free_slots(self._arena, slots)  # the server process is done with this call's inputs
        try:
            if future.done():  # nobody waits: its outputs are read by nobody
                return
            if "e" in header:
                future.set_exception(error_from(header["e"]))
                return
            try:
                answer = decode(frame)
            except Exception as exc:  # noqa: BLE001 - the caller meets it, as any error of its call
                future.set_exception(exc)
                del future, waiting  # the error's traceback holds this frame: no cycle through them
            else:
                future.set_result(answer)
        finally:
            self._release(header)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.lost = True
        for future, slots, _ in self._pending.values():
            free_slots(self._arena, slots)
            if not future.done():
                future.set_exception(Unavailable(GONE))
        self._pending.clear()
        if self._hello is not None and not self._hello.done():
            self._hello.set_exception(Unavailable(GONE))
        self._on_lost()

    def start(
        self, model: str, version: str | None, inputs: list[Tensor], parameters: dict[str, Any],
        outputs: list[str] | None, record: RequestRecord | None, received_ns: int,
    ) -> LinkCall:
        """One decoded call, sent now to run in the server process; its future gives the model
        version that served it and its outputs, or its typed error. Of the request's parameters
        only those admission reads cross. A front end's small calls are answered from this
        future's callback, with no task (server/http/infer.py)."""
        if self.lost:
            raise Unavailable(GONE)
        options = {name: parameters[name] for name in REQUEST_OPTIONS if name in parameters}
        metas, payload, slots = pack_tensors(inputs, self._arena)
        header = {"k": "infer", "m": model, "v": version, "in": metas, "p": options, "o": outputs,
                  "r": record is not None, "t": received_ns}
        return self._send_call(header, payload, slots, functools.partial(self._outputs, record))

    async def infer(
        self, model: str, version: str | None, inputs: list[Tensor], parameters: dict[str, Any],
        outputs: list[str] | None, record: RequestRecord | None, received_ns: int,
    ) -> tuple[int, list[Tensor]]:
        """`start`, awaited."""
        answer: tuple[int, list[Tensor]] = await self.start(
            model, version, inputs, parameters, outputs, record, received_ns).answer()
        return answer

    async def infer_raw(
        self, model: str, version: str | None, body: bytes, header_length: int | None,
        record: RequestRecord | None, received_ns: int,
    ) -> tuple[bytes, int | None]:
        """One call the server process decodes and encodes itself (it names the client's shared memory)."""
        if self.lost:
            raise Unavailable(GONE)
        header = {"k": "raw", "m": model, "v": version, "h": header_length, "r": record is not None, "t": received_ns}
        answer: tuple[bytes, int | None] = await self._send_call(
            header, [body], [], functools.partial(_raw_answer, record)).answer()
        return answer

    def _outputs(self, record: RequestRecord | None, frame: Frame) -> tuple[int, list[Tensor]]:
        """An infer call's answer: the version that served it and its outputs, copied out of
        the server process's arena (their slots are released as the frame is done with)."""
        header = frame.header
        answer = unpack_tensors(header["out"], frame.payload, self._peer_arena, copy=True)
        if record is not None and "rec" in header:
            fill_record(record, header["rec"])
        return header["ver"], answer

    def _send_call(self, header: dict[str, Any], payload: list[bytes], slots: list[int], decode: _Decode) -> LinkCall:
        call = self._next
        self._next += 1
        header["i"] = call
        if self._released:
            header["f"] = self._released
            self._released = []
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        try:
            self.send(header, payload)
        except BaseException:  # a header that cannot cross: this call is refused
            free_slots(self._arena, slots)
            self._still_to_release(header.pop("f", []))
            raise
        self._pending[call] = (future, slots, decode)
        return LinkCall(self, call, future)

    def cancel(self, call: int) -> None:
        """Stop a call in the server process, if it still runs there; its answer comes all the
        same (every call is answered), and frees its inputs' slots here."""
        if call in self._pending and not self.lost:
            self.send({"k": "cancel", "i": call})

    def _release(self, header: dict[str, Any]) -> None:
        """The output slots of this answer are read."""
        self._still_to_release(arena_slots(header.get("out", ())))

    def _still_to_release(self, offsets: list[int]) -> None:
        """Output slots to tell the server process are read: on the next frame, or at the end of
        this loop turn when none goes out."""
        if not offsets:
            return
        self._released.extend(offsets)
        if not self._release_scheduled:
            self._release_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_released)

    def _flush_released(self) -> None:
        self._release_scheduled = False
        if self._released:
            self.send({"k": "release", "f": self._released})
            self._released = []

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _failure(done: asyncio.Future[Any]) -> BaseException | None:
    """A finished call's error (a CancelledError if it was cancelled), read without raising it:
    raised here, its traceback would hold the frame that holds the future, which holds it."""
    if done.cancelled():
        return asyncio.CancelledError()
    return done.exception()


def _raw_answer(record: RequestRecord | None, frame: Frame) -> tuple[bytes, int | None]:
    """A raw call's answer: the response body the server process encoded, and its binary header length."""
    if record is not None and "rec" in frame.header:
        fill_record(record, frame.header["rec"])
    return bytes(frame.payload), frame.header["raw"]
