"""The boundary between HTTP front-end processes and the server process (`--http-workers`).

A front-end process parses and encodes; the server process admits, batches and computes, so
batches form across every front end and one process owns each device's instances. Each front
end holds one Unix-socket connection to the server process and multiplexes its calls on it.

A message is a frame: two lengths, a small JSON header and a payload of raw tensor bytes; never
a pickle. A tensor of MIN_SLOT bytes or more crosses in shared memory instead: each side owns
an arena (`server.arena`) the other has mapped, writes the tensor into a slot of its own and
names the slot. The front end frees its input slots when the answer comes (the server process
is then done with them, a cancelled call included: every call is answered); the server process
frees an output slot when the front end says it has read it (`f` on its next frame).

Errors cross by name and are raised again as the same typed errors, so each front end maps them
to its statuses as it would in one process.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from server.arena import MIN_SLOT, Arena
from server.dataplane import DataPlane, Output
from server.errors import BatchlineError, Cancelled, QueueFull, Unavailable
from server.protocol.binary import tensor_from_bytes, tensor_to_bytes
from server.protocol.datatypes import BYTES
from server.scheduler.request import RequestRecord

logger = logging.getLogger(__name__)

_LENGTHS = struct.Struct("<II")  # header bytes, payload bytes
MAX_HEADER_BYTES = 16 << 20  # a header names tensors and parameters: never near this
ARENA_BYTES = 32 << 20  # each side's arena, per front end; a tensor that finds no slot goes inline
GONE = "the server process is gone; this front end is stopping"

# A tensor as it crosses: name, datatype, shape, and where its bytes are: ["i", start, length]
# in the payload, or ["s", offset, length] in the sender's arena.
TensorMeta = list[Any]


@dataclass(frozen=True)
class Frame:
    header: dict[str, Any]
    payload: memoryview


class FrameReader:
    """Cuts a byte stream into frames; what arrives short waits for the rest."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        self._buffer += data
        frames = []
        start = 0
        buffer = self._buffer
        while len(buffer) - start >= _LENGTHS.size:
            header_bytes, payload_bytes = _LENGTHS.unpack_from(buffer, start)
            if header_bytes > MAX_HEADER_BYTES:
                raise ValueError(f"a link header of {header_bytes} bytes: the stream is out of step")
            end = start + _LENGTHS.size + header_bytes + payload_bytes
            if len(buffer) < end:
                break
            body = start + _LENGTHS.size
            header = orjson.loads(bytes(buffer[body:body + header_bytes]))
            payload = bytes(buffer[body + header_bytes:end])  # its own bytes: the buffer moves on
            frames.append(Frame(header, memoryview(payload)))
            start = end
        if start:
            del buffer[:start]
        return frames


def frame_bytes(header: dict[str, Any], payload: list[bytes | memoryview] | None = None) -> list[bytes | memoryview]:
    """The pieces of one frame, to write in one call."""
    head = orjson.dumps(header)
    parts = payload or []
    return [_LENGTHS.pack(len(head), sum(len(p) for p in parts)), head, *parts]


def pack_tensors(
    tensors: list[Output], arena: Arena | None, slots: list[int],
) -> tuple[list[TensorMeta], list[bytes | memoryview]]:
    """Each tensor's meta and the inline payload; large numeric tensors go into `arena`, their
    slots appended to `slots` (the sender frees them when the peer is done)."""
    metas: list[TensorMeta] = []
    payload: list[bytes | memoryview] = []
    inline = 0
    for name, datatype, array in tensors:
        shape = list(array.shape)
        if arena is not None and datatype != BYTES and array.nbytes >= MIN_SLOT:
            offset = arena.allocate(array.nbytes)
            if offset is not None:
                slots.append(offset)
                target = np.frombuffer(arena.slot(offset, array.nbytes), dtype=array.dtype).reshape(array.shape)
                np.copyto(target, array)
                metas.append([name, datatype, shape, "s", offset, array.nbytes])
                continue
        data = tensor_to_bytes(array, datatype)
        metas.append([name, datatype, shape, "i", inline, len(data)])
        payload.append(data)
        inline += len(data)
    return metas, payload


def unpack_tensors(metas: list[TensorMeta], payload: memoryview, arena: Arena | None, copy: bool) -> list[Output]:
    """The tensors a frame names. `copy`: arrays of their own rather than views of the sender's
    arena (whose slot is freed once read)."""
    tensors: list[Output] = []
    for name, datatype, shape, where, start, length in metas:
        if where == "s":
            if arena is None:
                raise ValueError("a tensor in shared memory on a link without an arena")
            raw = arena.slot(start, length)
            array = tensor_from_bytes(raw, datatype, shape, name)
            if copy:
                array = array.copy()
        else:
            array = tensor_from_bytes(payload[start:start + length], datatype, shape, name)
        tensors.append((name, datatype, array))
    return tensors


def _error_classes() -> dict[str, type[BatchlineError]]:
    found: dict[str, type[BatchlineError]] = {}
    pending: list[type[BatchlineError]] = [BatchlineError]
    while pending:
        cls = pending.pop()
        found[cls.__name__] = cls
        pending.extend(cls.__subclasses__())
    return found


def error_header(call: int, error: BaseException) -> dict[str, Any]:
    if isinstance(error, BatchlineError):
        retry = error.retry_after_s if isinstance(error, QueueFull) else None
        return {"i": call, "e": [type(error).__name__, error.message, retry]}
    return {"i": call, "e": [None, "the server process failed this call; see its log", None]}


def error_from(described: list[Any]) -> Exception:
    """The typed error a header describes, as the server process raised it."""
    name, message, retry = described
    cls = _error_classes().get(name) if name else None
    if cls is None:
        return RuntimeError(message)
    if issubclass(cls, QueueFull):
        return cls(message, retry if retry is not None else 1.0)
    return cls(message)


def record_fields(record: RequestRecord) -> list[Any]:
    return [record.request_id, record.model_version, record.queue_ns, record.compute_ns, record.tokens]


def fill_record(record: RequestRecord, fields: list[Any]) -> None:
    request_id, record.model_version, record.queue_ns, record.compute_ns, record.tokens = fields
    if record.request_id is None:
        record.request_id = request_id


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

    def send(self, header: dict[str, Any], payload: list[bytes | memoryview] | None = None) -> None:
        """Queue a frame; the frames of one loop turn go out in one write (a system call per
        batch of answers, not per answer)."""
        if not self._outgoing:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outgoing.extend(frame_bytes(header, payload))

    def _flush(self) -> None:
        outgoing, self._outgoing = self._outgoing, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(outgoing)


class PlaneLink(_Stream):
    """The server process's end of one front end's link: each call runs on the data plane."""

    def __init__(self, plane: DataPlane, infer_raw: RawInfer) -> None:
        super().__init__()
        self._plane = plane
        self._infer_raw = infer_raw
        self._calls: dict[int, asyncio.Task[None]] = {}
        self._peer_arena: Arena | None = None  # the front end's: inputs
        self._arena: Arena | None = None  # this side's: outputs

    def frame_received(self, frame: Frame) -> None:
        header = frame.header
        for offset in header.get("f", ()):
            if self._arena is not None:
                self._arena.free(offset)
        kind = header.get("k")
        if kind == "infer" or kind == "raw":
            call = header["i"]
            work = self._infer(header, frame.payload) if kind == "infer" else self._raw(header, frame.payload)
            self._calls[call] = asyncio.get_running_loop().create_task(work)
        elif kind == "cancel":
            task = self._calls.get(header["i"])
            if task is not None:
                task.cancel()
        elif kind == "hello":
            self._hello(header)

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

    async def _infer(self, header: dict[str, Any], payload: memoryview) -> None:
        call = header["i"]
        record = RequestRecord() if header.get("r") else None
        plane = self._plane
        try:
            inputs = unpack_tensors(header["in"], payload, self._peer_arena, copy=False)
            model = plane.admit(header["m"], header["v"])
            if record is not None:
                record.model_version = model.version
            batch_size = plane.check_inputs(model, {n: (d, list(a.shape)) for n, d, a in inputs})
            outputs = await plane.infer(
                model, {n: (d, a) for n, d, a in inputs}, header["p"], header["o"], record, header["t"], batch_size)
            slots: list[int] = []
            metas, data = pack_tensors(outputs, self._arena, slots)
        except BaseException as exc:  # noqa: BLE001 - every call is answered, so its input slots are freed
            self.send(error_header(call, exc if not isinstance(exc, asyncio.CancelledError)
                                   else Cancelled("the call was cancelled")))
            if not isinstance(exc, (BatchlineError, asyncio.CancelledError)):
                logger.error("a call from a front end failed", exc_info=exc)
            return
        finally:
            self._calls.pop(call, None)
        reply: dict[str, Any] = {"i": call, "out": metas, "ver": model.version}
        if record is not None:
            reply["rec"] = record_fields(record)
        self.send(reply, data)

    async def _raw(self, header: dict[str, Any], payload: memoryview) -> None:
        """A call this process decodes itself: one that names the client's shared memory, whose
        regions are registered here."""
        call = header["i"]
        record = RequestRecord() if header.get("r") else None
        try:
            content, binary_header_length = await self._infer_raw(
                header["m"], header["v"], bytes(payload), header["h"], record, header["t"])
        except BaseException as exc:  # noqa: BLE001 - every call is answered
            self.send(error_header(call, exc if not isinstance(exc, asyncio.CancelledError)
                                   else Cancelled("the call was cancelled")))
            if not isinstance(exc, (BatchlineError, asyncio.CancelledError)):
                logger.error("a call from a front end failed", exc_info=exc)
            return
        finally:
            self._calls.pop(call, None)
        reply = {"i": call, "raw": binary_header_length}
        if record is not None:
            reply["rec"] = record_fields(record)
        self.send(reply, [content])

    def connection_lost(self, exc: Exception | None) -> None:
        """The front end is gone: its calls are dropped (nobody is left to answer)."""
        for task in self._calls.values():
            task.cancel()
        self._calls.clear()
        self.transport = None


RawInfer = Callable[[str, "str | None", bytes, "int | None", "RequestRecord | None", int], Any]


class LinkClient(_Stream):
    """A front end's end of its link: calls out, answers back to whoever awaits them."""

    def __init__(self, on_lost: Callable[[], None]) -> None:
        super().__init__()
        self._on_lost = on_lost
        self._next = 0
        self._pending: dict[int, tuple[asyncio.Future[Frame], list[int]]] = {}
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
        try:
            self._arena = Arena.create(ARENA_BYTES, "batchline-in")
        except OSError as exc:
            logger.warning("no shared memory for this front end's inputs (%s): they go inline", exc)
        self._hello = asyncio.get_running_loop().create_future()
        self.send({"k": "hello", "arena": self._arena.path if self._arena else None})
        answer = (await self._hello).header
        if self._arena is not None:
            self._arena.forget_file()  # mapped by the server process, or never to be
            if not answer.get("inputs_mapped"):
                self._arena = None
        if answer.get("arena"):
            try:
                self._peer_arena = Arena.attach(answer["arena"])
                self._peer_arena.forget_file()
            except (OSError, ValueError) as exc:
                logger.warning("the server process's shared memory could not be mapped (%s)", exc)
                self._peer_arena = None

    @property
    def outputs_in_shared_memory(self) -> bool:
        return self._peer_arena is not None

    def frame_received(self, frame: Frame) -> None:
        header = frame.header
        if header.get("k") == "hello":
            if self._hello is not None and not self._hello.done():
                self._hello.set_result(frame)
            return
        waiting = self._pending.pop(header["i"], None)
        if waiting is None:
            return
        future, slots = waiting
        if self._arena is not None:
            for offset in slots:  # the server process is done with this call's inputs
                self._arena.free(offset)
        if not future.done():
            future.set_result(frame)
        else:
            self._release(header)  # nobody waits: its outputs are read by nobody

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.lost = True
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(Unavailable(GONE))
        self._pending.clear()
        if self._hello is not None and not self._hello.done():
            self._hello.set_exception(Unavailable(GONE))
        self._on_lost()

    async def infer(
        self, model: str, version: str | None, inputs: list[Output], parameters: dict[str, Any],
        outputs: list[str] | None, record: RequestRecord | None, received_ns: int,
    ) -> tuple[int, list[Output]]:
        """One decoded call, run in the server process: the model version that served it and
        its outputs, or its typed error."""
        slots: list[int] = []
        metas, payload = pack_tensors(inputs, self._arena, slots)
        header = {"k": "infer", "m": model, "v": version, "in": metas, "p": parameters, "o": outputs,
                  "r": record is not None, "t": received_ns}
        frame = await self._call(header, payload, slots)
        try:
            answer = unpack_tensors(frame.header["out"], frame.payload, self._peer_arena, copy=True)
        finally:
            self._release(frame.header)
        if record is not None and "rec" in frame.header:
            fill_record(record, frame.header["rec"])
        return frame.header["ver"], answer

    async def infer_raw(
        self, model: str, version: str | None, body: bytes, header_length: int | None,
        record: RequestRecord | None, received_ns: int,
    ) -> tuple[bytes, int | None]:
        """One call the server process decodes and encodes itself (it names the client's shared memory)."""
        header = {"k": "raw", "m": model, "v": version, "h": header_length, "r": record is not None, "t": received_ns}
        frame = await self._call(header, [body], [])
        if record is not None and "rec" in frame.header:
            fill_record(record, frame.header["rec"])
        return bytes(frame.payload), frame.header["raw"]

    async def _call(self, header: dict[str, Any], payload: list[bytes | memoryview], slots: list[int]) -> Frame:
        if self.lost:
            raise Unavailable(GONE)
        call = self._next
        self._next += 1
        header["i"] = call
        if self._released:
            header["f"] = self._released
            self._released = []
        future: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        self._pending[call] = (future, slots)
        self.send(header, payload)
        try:
            frame = await future
        except asyncio.CancelledError:
            if call in self._pending:  # the server process still runs it: stop it there too
                self.send({"k": "cancel", "i": call})
            raise
        if "e" in frame.header:
            raise error_from(frame.header["e"])
        return frame

    def _release(self, header: dict[str, Any]) -> None:
        """Tell the server process the output slots of this answer are read: on the next frame,
        or soon when none goes out."""
        offsets = [meta[4] for meta in header.get("out", ()) if meta[3] == "s"]
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
