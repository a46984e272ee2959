"""The link's wire format (`server.link`): frames, tensors in them or in an arena, errors.

A frame is two little-endian u32 lengths, a JSON header and a payload of raw bytes; never a
pickle. A tensor is described in its frame's header by its name, datatype, shape and where its
bytes are: in the payload, or in a slot of the sender's shared-memory arena (`server.arena`).
A typed error crosses by its class name and message and is raised again as itself.
"""

from __future__ import annotations

import functools
import struct
from typing import Any, NamedTuple

import numpy as np
import orjson

from server.arena import MIN_SLOT, Arena
from server.errors import BatchlineError, InvalidInput, QueueFull
from server.protocol.binary import tensor_from_bytes, tensor_to_bytes
from server.protocol.datatypes import BYTES, numpy_dtype
from server.scheduler.request import RequestRecord

_LENGTHS = struct.Struct("<II")  # header bytes, payload bytes
MAX_HEADER_BYTES = 16 << 20  # a header names tensors and parameters: a larger one is refused as it is made
MAX_MESSAGE_CHARS = 64 << 10  # an error's message crosses cut to this (one may quote a client's huge name)
INLINE = "i"  # a tensor's bytes in the frame's payload
IN_ARENA = "s"  # ... in a slot of the sender's arena

Tensor = tuple[str, str, np.ndarray]  # name, datatype, array


# How a header describes one tensor: [name, datatype, shape, where (INLINE or IN_ARENA), start
# (a payload offset, or an arena slot), length]; a list, as JSON keeps it.
TensorMeta = list[Any]


class Frame(NamedTuple):
    """One message on a link: its header, and the raw bytes its tensors (or a body) take (a
    tuple: made for every call and answer, it costs half a frozen dataclass)."""

    header: dict[str, Any]
    payload: memoryview


_VIEW_SOURCE_BYTES = 64 << 10  # a payload views a source this small, or one it is half of at least


class FrameReader:
    """Cuts a byte stream into frames; what arrives short waits for the rest. A frame's payload
    is a view of the bytes read, not a copy, where it is most of them (or they are few): a view
    keeps its whole source alive, and a small request's must not hold a large one's megabytes
    while it waits for its batch. A frame split across reads is gathered as its pieces come and
    joined once, when its last piece does (not once per piece: a frame of megabytes arrives in
    many)."""

    def __init__(self) -> None:
        self._pending = bytearray()  # the start of a frame still short
        self._needed = 0  # the bytes `_pending` must reach before a frame can be cut from it

    def feed(self, data: bytes) -> list[Frame]:
        pending = self._pending
        if pending:
            pending += data
            if len(pending) < self._needed:
                return []
            data = bytes(pending)
            pending.clear()
        view = memoryview(data)
        frames = []
        start = 0
        size = len(data)
        while size - start >= _LENGTHS.size:
            header_bytes, payload_bytes = _LENGTHS.unpack_from(data, start)
            if header_bytes > MAX_HEADER_BYTES:
                raise ValueError(f"a link header of {header_bytes} bytes: the stream is out of step")
            end = start + _LENGTHS.size + header_bytes + payload_bytes
            if size < end:
                break
            body = start + _LENGTHS.size
            header = orjson.loads(data[body:body + header_bytes])  # from bytes: faster than from a view
            payload = view[body + header_bytes:end]  # `data` is immutable: a view of it holds
            if size > _VIEW_SOURCE_BYTES and 2 * payload_bytes < size:
                payload = memoryview(payload.tobytes())
            frames.append(Frame(header, payload))
            start = end
        rest = size - start
        if rest:
            pending += view[start:]
            # its lengths were read (the loop stopped at its end), or they are still to come
            self._needed = end - start if rest >= _LENGTHS.size else _LENGTHS.size
        return frames


def frame_bytes(header: dict[str, Any], payload: list[bytes | memoryview] | None = None) -> list[bytes | memoryview]:
    """The pieces of one frame, to write in one call. InvalidInput for a header that cannot
    cross (what a client sent, in parameters or names, nested too deep for the encoder or too
    large for the far side's reader): its own call is refused, not the link."""
    try:
        head = orjson.dumps(header)
    except TypeError as exc:  # orjson: nesting past its limit
        raise InvalidInput(f"the request cannot be passed on to the server process: {exc}") from None
    if len(head) > MAX_HEADER_BYTES:
        raise InvalidInput(f"the request's parameters and names take {len(head)} bytes encoded; at most "
                           f"{MAX_HEADER_BYTES} can be passed on to the server process")
    parts = payload or []
    return [_LENGTHS.pack(len(head), sum(len(p) for p in parts)), head, *parts]


def pack_tensors(tensors: list[Tensor], arena: Arena | None) -> tuple[list[TensorMeta], list[bytes], list[int]]:
    """Each tensor's meta, the inline payload, and the arena slots taken: large numeric tensors
    go into `arena` (the sender frees the slots when the peer is done with them). Nothing is
    left taken when this raises."""
    metas: list[TensorMeta] = []
    payload: list[bytes] = []
    slots: list[int] = []
    inline = 0
    try:
        for name, datatype, array in tensors:
            shape = list(array.shape)
            if arena is not None and datatype != BYTES and array.nbytes >= MIN_SLOT:
                offset = arena.allocate(array.nbytes)
                if offset is not None:
                    slots.append(offset)
                    target = np.frombuffer(arena.slot(offset, array.nbytes), dtype=array.dtype).reshape(array.shape)
                    np.copyto(target, array)
                    metas.append([name, datatype, shape, IN_ARENA, offset, array.nbytes])
                    continue
            data = tensor_to_bytes(array, datatype)
            metas.append([name, datatype, shape, INLINE, inline, len(data)])
            payload.append(data)
            inline += len(data)
    except BaseException:
        free_slots(arena, slots)
        raise
    return metas, payload, slots


def unpack_tensors(metas: list[TensorMeta], payload: memoryview, arena: Arena | None, copy: bool) -> list[Tensor]:
    """The tensors a frame names. `copy`: arrays of their own rather than views of the sender's
    arena (whose slot is freed once read). A numeric tensor is viewed as its sender packed it,
    without the checks a client's bytes get: the sender built it from checked input or from
    the model's outputs (a mismatch, a bug, is a ValueError from numpy). BOOL is the exception:
    its bytes are read as 0 or 1 whatever the sender held."""
    tensors: list[Tensor] = []
    for name, datatype, shape, where, start, length in metas:
        if where == IN_ARENA:
            if arena is None:
                raise ValueError("a tensor in shared memory on a link without a mapped arena")
            raw = arena.slot(start, length)
        else:
            raw = payload[start:start + length]
        if datatype in (BYTES, "BOOL"):
            array = tensor_from_bytes(raw, datatype, shape, name)
        else:
            array = np.frombuffer(raw, dtype=numpy_dtype(datatype)).reshape(shape)
        if copy and where == IN_ARENA:
            array = array.copy()
        tensors.append((name, datatype, array))
    return tensors


def arena_slots(metas: list[TensorMeta]) -> list[int]:
    """The arena slots a header's tensors take."""
    return [meta[4] for meta in metas if meta[3] == IN_ARENA]


def free_slots(arena: Arena | None, slots: list[int]) -> None:
    if arena is not None:
        for offset in slots:
            arena.free(offset)


@functools.cache
def _error_classes() -> dict[str, type[BatchlineError]]:
    found: dict[str, type[BatchlineError]] = {}
    pending: list[type[BatchlineError]] = [BatchlineError]
    while pending:
        cls = pending.pop()
        found[cls.__name__] = cls
        pending.extend(cls.__subclasses__())
    return found


def error_header(call: int, error: BaseException) -> dict[str, Any]:
    """The answer to a call that failed: a server error by name, anything else without detail."""
    if isinstance(error, BatchlineError):
        retry = error.retry_after_s if isinstance(error, QueueFull) else None
        message = error.message if len(error.message) <= MAX_MESSAGE_CHARS else error.message[:MAX_MESSAGE_CHARS] + "..."
        return {"i": call, "e": [type(error).__name__, message, retry]}
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
