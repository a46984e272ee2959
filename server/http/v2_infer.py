"""One KServe v2 infer call over HTTP: body bytes in, response bytes out, through the data plane.

The cheap refusals come first, each before any work that grows with the request: the model
(404, 503) and its queue (429) before the body is parsed; names, datatypes, shapes and the batch
size (400) before any tensor is built. Work that grows with a request runs on a worker thread
above a size, so one big request never stalls the event loop every other request shares.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from typing import NamedTuple

import numpy as np

from server.dataplane import Call, DataPlane, Output
from server.errors import BatchlineError, QueueFull
from server.link import LinkCall, LinkClient
from server.model import ModelVersion
from server.protocol.binary import tensor_bytes
from server.protocol.v2 import DecodedRequest, ParsedRequest, build_tensors, encode_response, parse_request
from server.scheduler.request import RequestRecord
from server.shared_memory import Window, write_outputs

# Measured worst cases inline (orjson, one core): 16 KiB of JSON, nested or many tiny strings,
# ~1 ms to parse and build; 64 KiB of JSON outputs ~0.5 ms to encode; 1 MiB of binary outputs,
# one copy, ~0.1 ms.
INLINE_DECODE_BYTES = 16 << 10
INLINE_ENCODE_JSON_BYTES = 64 << 10
OFFLOAD_BYTES = 1 << 20


async def infer_v2(
    plane: DataPlane,
    name: str,
    version: str | None,
    body: bytes,
    header_length: int | None,
    record: RequestRecord | None = None,
    received_ns: int | None = None,
) -> tuple[bytes, int | None]:
    """The response body of one call, and its binary header length (None: all JSON); its
    `timeout` counts from `received_ns`, when its head arrived (None: now)."""
    try:
        model = plane.admit(name, version)
    except BatchlineError as exc:
        # the access log line still names its request; not under overload, where refusing is all
        if record is not None and not isinstance(exc, QueueFull):
            record.request_id = await asyncio.to_thread(_request_id, body, header_length)
        raise
    parsed = await _parsed(body, header_length)
    batch_size = _checked(plane, model, parsed, record)
    if parsed.decode_bytes > INLINE_DECODE_BYTES:
        decoded = await asyncio.to_thread(build_tensors, parsed, plane.shared_memory.read_inputs)
    else:
        decoded = build_tensors(parsed, plane.shared_memory.read_inputs)
    del parsed  # the JSON's own lists and numbers, copied into arrays now: freed before the wait, not after
    started = _start(plane, model, decoded, record, received_ns, batch_size)
    outputs = await started.call.answer()
    return await _encoded(name, model.version, decoded, outputs, started.targets)


class Started(NamedTuple):
    """A call started on the data plane, with what its answer is encoded from."""

    call: Call
    version: int
    decoded: DecodedRequest
    targets: dict[str, Window]  # outputs asked for in the client's shared memory

    def answer_inline(self, name: str, results: dict[str, np.ndarray]) -> tuple[bytes, int | None] | None:
        """The answer from the call's `results`, as `infer_v2` returns it; None when its outputs
        are too big to encode on the event loop (`encoded` encodes them on a thread)."""
        return _encoded_now(name, self.version, self.decoded, self.call.outputs(results), self.targets)

    async def encoded(self, name: str, results: dict[str, np.ndarray]) -> tuple[bytes, int | None]:
        return await _encoded(name, self.version, self.decoded, self.call.outputs(results), self.targets)


def start_inline(
    plane: DataPlane,
    name: str,
    version: str | None,
    body: bytes | bytearray,
    header_length: int | None,
    record: RequestRecord | None,
    received_ns: int,
) -> Started | None:
    """`infer_v2` up to the call's start, on the event loop, for a body of at most
    INLINE_DECODE_BYTES: the caller answers from the call's future, with no task of its own.
    None when the tensors are too big to build here (BYTES in the client's shared memory):
    `infer_v2` is the way for it. Refusals raise, as from `infer_v2`."""
    try:
        model = plane.admit(name, version)
    except BatchlineError as exc:
        if record is not None and not isinstance(exc, QueueFull):
            record.request_id = _request_id(body, header_length)
        raise
    parsed = parse_request(body, header_length)
    if parsed.decode_bytes > INLINE_DECODE_BYTES:
        return None
    batch_size = _checked(plane, model, parsed, record)
    decoded = build_tensors(parsed, plane.shared_memory.read_inputs)
    del parsed
    return _start(plane, model, decoded, record, received_ns, batch_size)


def _checked(plane: DataPlane, model: ModelVersion, parsed: ParsedRequest, record: RequestRecord | None) -> int:
    """The batch size, once names, datatypes and shapes are checked (400 before any tensor)."""
    if record is not None:
        record.model_version = model.version
        record.request_id = parsed.id
    return plane.check_inputs(model, {d.name: (d.datatype, d.shape) for d in parsed.inputs})


def _start(
    plane: DataPlane,
    model: ModelVersion,
    decoded: DecodedRequest,
    record: RequestRecord | None,
    received_ns: int | None,
    batch_size: int,
) -> Started:
    wanted = decoded.outputs
    targets = {} if wanted is None else plane.shared_memory.output_targets(
        {o.name: o.region for o in wanted if o.region is not None})
    call = plane.start_call(
        model, decoded.inputs, decoded.parameters, None if wanted is None else [o.name for o in wanted], record,
        received_ns, batch_size,
    )
    return Started(call, model.version, decoded, targets)


async def infer_v2_remote(
    link: LinkClient,
    name: str,
    version: str | None,
    body: bytes,
    header_length: int | None,
    record: RequestRecord | None = None,
    received_ns: int | None = None,
) -> tuple[bytes, int | None]:
    """`infer_v2` in a front-end process (`--http-workers`): the body is parsed and the answer
    encoded here, the call runs in the server process. A call that names the client's shared
    memory goes there whole: the regions are registered there."""
    received = time.perf_counter_ns() if received_ns is None else received_ns
    parsed = await _parsed(body, header_length)
    if _names_shared_memory(parsed):
        return await link.infer_raw(name, version, body, header_length, record, received)
    if record is not None:
        record.request_id = parsed.id
    if parsed.decode_bytes > INLINE_DECODE_BYTES:
        decoded = await asyncio.to_thread(build_tensors, parsed)
    else:
        decoded = build_tensors(parsed)
    del parsed  # as in infer_v2: freed before the wait
    # the call is not kept in a local: the error it raises holds this frame, which would hold the call
    # and, through its future, the error: a cycle keeping the body and tensors till a full collection
    served, outputs = await _sent(link, name, version, decoded, record, received).call.answer()
    return await _encoded(name, served, decoded, outputs, {})


class Sent(NamedTuple):
    """A call sent to the server process (`--http-workers`), with what its answer is encoded
    from: its call's future gives the version that served it and its outputs."""

    call: LinkCall
    decoded: DecodedRequest

    def answer_inline(self, name: str, answer: tuple[int, list[Output]]) -> tuple[bytes, int | None] | None:
        """As `Started.answer_inline`, from the server process's answer."""
        version, outputs = answer
        return _encoded_now(name, version, self.decoded, outputs, {})

    async def encoded(self, name: str, answer: tuple[int, list[Output]]) -> tuple[bytes, int | None]:
        version, outputs = answer
        return await _encoded(name, version, self.decoded, outputs, {})


def start_inline_remote(
    link: LinkClient,
    name: str,
    version: str | None,
    body: bytes | bytearray,
    header_length: int | None,
    record: RequestRecord | None,
    received_ns: int,
) -> Sent | None:
    """`infer_v2_remote` up to the call's sending, on the event loop, for a body of at most
    INLINE_DECODE_BYTES, as `start_inline` is for `infer_v2`. None for a call that names the
    client's shared memory, or whose tensors are too big to build here: `infer_v2_remote` is
    the way for it."""
    parsed = parse_request(body, header_length)
    if parsed.decode_bytes > INLINE_DECODE_BYTES or _names_shared_memory(parsed):
        return None
    if record is not None:
        record.request_id = parsed.id
    decoded = build_tensors(parsed)
    del parsed
    return _sent(link, name, version, decoded, record, received_ns)


# An infer call started inline, either way: on this process's data plane, or sent to the server process's.
InlineStarted = Started | Sent


def _sent(
    link: LinkClient, name: str, version: str | None, decoded: DecodedRequest, record: RequestRecord | None,
    received_ns: int,
) -> Sent:
    wanted = decoded.outputs
    call = link.start(name, version, [(n, datatype, array) for n, (datatype, array) in decoded.inputs.items()],
                      decoded.parameters, None if wanted is None else [o.name for o in wanted], record, received_ns)
    return Sent(call, decoded)


def _names_shared_memory(parsed: ParsedRequest) -> bool:
    """Whether a call reads or writes the client's shared memory (whose regions are registered
    in the server process alone)."""
    return any(d.region is not None for d in parsed.inputs) or any(o.region is not None for o in parsed.outputs or ())


async def _parsed(body: bytes | bytearray, header_length: int | None) -> ParsedRequest:
    if len(body) > INLINE_DECODE_BYTES:
        return await asyncio.to_thread(_parse_without_gc, body, header_length)
    return parse_request(body, header_length)


async def _encoded(
    name: str, version: int, decoded: DecodedRequest, outputs: list[Output], targets: dict[str, Window],
) -> tuple[bytes, int | None]:
    answer = _encoded_now(name, version, decoded, outputs, targets)
    if answer is not None:
        return answer
    return await asyncio.to_thread(_answer, name, version, decoded.id, with_binary_flags(outputs, decoded), targets)


def _encoded_now(
    name: str, version: int, decoded: DecodedRequest, outputs: list[Output], targets: dict[str, Window],
) -> tuple[bytes, int | None] | None:
    """The answer, encoded on the event loop; None when its outputs are too big to encode there."""
    tensors = with_binary_flags(outputs, decoded)
    if _encodes_inline(tensors, targets):
        return _answer(name, version, decoded.id, tensors, targets)
    return None


def _encodes_inline(tensors: list[tuple[str, str, np.ndarray, bool]], targets: dict[str, Window]) -> bool:
    """Whether encoding (and writing outputs to shared memory) is short enough for the loop."""
    json_bytes = binary_bytes = 0
    for output, _, array, as_binary in tensors:
        if as_binary or output in targets:
            binary_bytes += tensor_bytes(array)
        else:
            json_bytes += tensor_bytes(array)
    return json_bytes <= INLINE_ENCODE_JSON_BYTES and binary_bytes <= OFFLOAD_BYTES


def _answer(
    name: str, version: int, request_id: str | None, tensors: list[tuple[str, str, np.ndarray, bool]],
    targets: dict[str, Window],
) -> tuple[bytes, int | None]:
    """Write the outputs asked for in shared memory there, then encode the answer."""
    written = write_outputs([tensor[:3] for tensor in tensors], targets) if targets else None
    return encode_response(name, version, request_id, tensors, written)


def with_binary_flags(outputs: list[Output], request: DecodedRequest) -> list[tuple[str, str, np.ndarray, bool]]:
    """Each output with whether it goes back as binary data: its own `binary_data` parameter,
    else the request's `binary_data_output`."""
    flags = {o.name: o.binary for o in request.outputs} if request.outputs is not None else {}
    tensors = []
    for name, datatype, array in outputs:
        binary = flags.get(name)
        tensors.append((name, datatype, array, request.binary_output if binary is None else binary))
    return tensors


_gc_lock = threading.Lock()
_gc_pauses = 0
_gc_was_enabled = False


def _parse_without_gc(body: bytes | bytearray, header_length: int | None) -> ParsedRequest:
    """parse_request with the cyclic GC paused. orjson holds the GIL for the whole parse, so a
    worker thread alone does not free the loop; most of a nested body's parse time is the
    collections its hundred thousand fresh lists trigger (measured: 200k lists, ~200 ms with
    GC, ~30 ms without). The pause is process-wide and counted, so overlapping parses nest."""
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        return parse_request(body, header_length)
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


def _request_id(body: bytes | bytearray, header_length: int | None) -> str | None:
    """The request's id for the access log of a refused request, best effort (a worker thread:
    the body was never parsed, and a big one is not parsed on the loop for a log line)."""
    try:
        request = _parse_without_gc(body, header_length)
    except BatchlineError:
        return None
    return request.id
