"""Triton's `inference.GRPCInferenceService` over the data plane: one method per RPC, thin.

Every call passes the access gate first; every failure becomes its status in `errors.py`. An
infer call runs the cheap refusals before any tensor is decoded, as over HTTP: the server's
bounds on requests in flight and the bytes they hold (shared with HTTP), before its message is
parsed (it arrives as bytes: server/grpc/frontend.py); then the model and its queue, then
names, datatypes, shapes and the batch size. The call's deadline becomes the request's, so the
batcher drops it unrun (and says so) rather than computing an answer nobody waits for; a
cancelled call is dropped before compute.

ModelStreamInfer reads requests as they come and answers each when it is done, in the order
they finish (each answer carries its request's id), with at most the in-flight bound of one
stream running at once: past it, the stream is read no further until one finishes. A request
that finds the server-wide bound full (other streams and front ends count too) is answered
with its error in the stream at once, as a unary call gets RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf import json_format
from grpc._cython import cygrpc  # type: ignore[attr-defined]  # ExecuteBatchError: grpc has no public name for it

from server.access_log import AccessLog
from server.dataplane import DataPlane
from server.errors import DeadlineExceeded, ModelNotFound
from server.grpc import codec
from server.grpc.access import CallGate, Policy
from server.grpc.errors import retry_after, status_of
from server.grpc.protos import grpc_service_pb2 as pb
from server.grpc.protos import grpc_service_pb2_grpc as pb_grpc
from server.grpc.protos import model_config_pb2
from server.inflight import InFlight
from server.protocol.binary import tensor_bytes
from server.scheduler.request import RequestRecord
from server.shared_memory import Window, write_outputs

T = TypeVar("T")

SERVICE_NAME = "inference.GRPCInferenceService"
SERVICE = f"/{SERVICE_NAME}/"
# Typed contents are lists: past this many elements (or bytes of raw BYTES) decoding takes
# about a millisecond, so it runs on a worker thread. Raw numbers are zero-copy at any size.
INLINE_DECODE_COST = 16 << 10
OFFLOAD_ENCODE_BYTES = 1 << 20  # outputs past a MiB are copied into the answer on a thread
_STREAM_END = object()
DEADLINE_MARGIN_US = 5_000


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self, plane: DataPlane, policy: Policy | None = None, access_log: AccessLog | None = None,
        flight: InFlight | None = None,
    ) -> None:
        self._plane = plane
        self._gate = CallGate(policy)
        self._access_log = access_log or AccessLog()
        self._flight = flight or InFlight()  # the server's, shared with its other front ends
        self.in_flight = 0  # this front end's infer requests between arrival and answer, unary and streamed
        self._streams: set[_Stream] = set()

    # -- health, metadata, configuration, statistics -------------------------------------------

    async def ServerLive(self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext) -> Any:
        return await self._call(context, "ServerLive", lambda: pb.ServerLiveResponse(live=self._plane.server_live()))

    async def ServerReady(self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext) -> Any:
        return await self._call(context, "ServerReady",
                                lambda: pb.ServerReadyResponse(ready=self._plane.server_ready()))

    async def ModelReady(self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext) -> Any:
        def ready() -> pb.ModelReadyResponse:
            try:
                return pb.ModelReadyResponse(ready=self._plane.model_ready(request.name, request.version or None))
            except ModelNotFound:  # as Triton: not ready, rather than an error
                return pb.ModelReadyResponse(ready=False)

        return await self._call(context, "ModelReady", ready)

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext) -> Any:
        return await self._call(context, "ServerMetadata",
                                lambda: pb.ServerMetadataResponse(**self._plane.server_metadata()))

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext) -> Any:
        def metadata() -> pb.ModelMetadataResponse:
            document = self._plane.model_metadata(request.name, request.version or None)
            return json_format.ParseDict(document, pb.ModelMetadataResponse())

        return await self._call(context, "ModelMetadata", metadata)

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext) -> Any:
        def config() -> pb.ModelConfigResponse:
            document = self._plane.model_config(request.name, request.version or None)
            # the fields Triton's schema has; ours alone (e.g. max_batch_tokens) are HTTP's only
            parsed = json_format.ParseDict(document, model_config_pb2.ModelConfig(), ignore_unknown_fields=True)
            return pb.ModelConfigResponse(config=parsed)

        return await self._call(context, "ModelConfig", config)

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: grpc.aio.ServicerContext) -> Any:
        def statistics() -> pb.ModelStatisticsResponse:
            document = self._plane.statistics(request.name or None, request.version or None)
            # Triton's fields; ours (failures by reason, dispatch reasons, ...) are in HTTP's /stats
            return json_format.ParseDict(document, pb.ModelStatisticsResponse(), ignore_unknown_fields=True)

        return await self._call(context, "ModelStatistics", statistics)

    # -- repository ------------------------------------------------------------------------------

    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: grpc.aio.ServicerContext) -> Any:
        async def index() -> pb.RepositoryIndexResponse:
            entries = await self._plane.repository_index(request.ready)
            return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**e) for e in entries])

        return await self._call(context, "RepositoryIndex", index)

    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest,
                                  context: grpc.aio.ServicerContext) -> Any:
        async def load() -> pb.RepositoryModelLoadResponse:
            await self._plane.load(request.model_name, codec.plain_parameters(request.parameters))
            return pb.RepositoryModelLoadResponse()

        return await self._call(context, "RepositoryModelLoad", load)

    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest,
                                    context: grpc.aio.ServicerContext) -> Any:
        async def unload() -> pb.RepositoryModelUnloadResponse:
            await self._plane.unload(request.model_name)
            return pb.RepositoryModelUnloadResponse()

        return await self._call(context, "RepositoryModelUnload", unload)

    # -- system shared memory ----------------------------------------------------------------

    async def SystemSharedMemoryStatus(self, request: pb.SystemSharedMemoryStatusRequest,
                                       context: grpc.aio.ServicerContext) -> Any:
        def status() -> pb.SystemSharedMemoryStatusResponse:
            response = pb.SystemSharedMemoryStatusResponse()
            for region in self._plane.shared_memory.status(request.name or None):
                response.regions[region["name"]].CopyFrom(
                    pb.SystemSharedMemoryStatusResponse.RegionStatus(**region))
            return response

        return await self._call(context, "SystemSharedMemoryStatus", status)

    async def SystemSharedMemoryRegister(self, request: pb.SystemSharedMemoryRegisterRequest,
                                         context: grpc.aio.ServicerContext) -> Any:
        def register() -> pb.SystemSharedMemoryRegisterResponse:
            self._plane.shared_memory.register(request.name, request.key, request.offset, request.byte_size)
            return pb.SystemSharedMemoryRegisterResponse()

        return await self._call(context, "SystemSharedMemoryRegister", register)

    async def SystemSharedMemoryUnregister(self, request: pb.SystemSharedMemoryUnregisterRequest,
                                           context: grpc.aio.ServicerContext) -> Any:
        def unregister() -> pb.SystemSharedMemoryUnregisterResponse:
            self._plane.shared_memory.unregister(request.name or None)
            return pb.SystemSharedMemoryUnregisterResponse()

        return await self._call(context, "SystemSharedMemoryUnregister", unregister)

    # -- what this server does not do ------------------------------------------------------------

    async def CudaSharedMemoryStatus(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _unimplemented(context, "CUDA shared-memory tensors are")

    async def CudaSharedMemoryRegister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _unimplemented(context, "CUDA shared-memory tensors are")

    async def CudaSharedMemoryUnregister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _unimplemented(context, "CUDA shared-memory tensors are")

    async def TraceSetting(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _unimplemented(context, "trace settings are")

    async def LogSettings(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _unimplemented(context, "log settings are")

    # -- inference -------------------------------------------------------------------------------

    async def ModelInfer(self, message: bytes, context: grpc.aio.ServicerContext) -> Any:
        """`message`: the ModelInferRequest as received (server/grpc/frontend.py)."""
        started = time.perf_counter_ns()
        record = RequestRecord() if self._access_log.enabled else None
        call = InferCall(message)
        del message  # the call holds it until it is parsed
        try:
            refusal = self._gate.refusal("ModelInfer", context.invocation_metadata())
            if refusal is not None:
                raise refusal
            response = await self._infer(call, context.time_remaining(), record, started)
        except asyncio.CancelledError:  # the client went away (or its deadline passed): dropped
            self._log(context, "ModelInfer", call, grpc.StatusCode.CANCELLED, started, record)
            raise
        except Exception as exc:  # noqa: BLE001 (every failure is answered with its status)
            code, text = status_of(exc)
            self._log(context, "ModelInfer", call, code, started, record)
            await _abort(context, code, text, retry_after(exc))
        self._log(context, "ModelInfer", call, grpc.StatusCode.OK, started, record)
        return response

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """`request_iterator`: the ModelInferRequests as received (server/grpc/frontend.py)."""
        refusal = self._gate.refusal("ModelStreamInfer", context.invocation_metadata())
        if refusal is not None:
            code, message = status_of(refusal)
            await _abort(context, code, message)
        if self._plane.stopping:  # a stream opened now would hold the drain to its grace period
            await _abort(context, grpc.StatusCode.UNAVAILABLE,
                                "the server is shutting down; open a stream to another replica")
        stream = _Stream(stream_share(self._flight.max_requests))
        stream.reader = asyncio.create_task(self._read_stream(request_iterator, context, stream))
        self._streams.add(stream)
        try:
            while (answer := await stream.answers.get()) is not _STREAM_END:
                yield answer
                stream.room.release()  # sent: the client reads its answers
        finally:
            self._streams.discard(stream)
            stream.abandon()  # done, or the client went away: nothing of it may still run
        if self._plane.stopping:  # ended by a stop: tell the client to go elsewhere, not that all is well
            context.set_code(grpc.StatusCode.UNAVAILABLE)
            context.set_details("the server is shutting down; open a stream to another replica")

    @property
    def busy(self) -> bool:
        """Infer requests in flight, or streams open."""
        return self.in_flight > 0 or bool(self._streams)

    def stop_streams(self) -> None:
        """Stop reading every open stream: what each has in flight is answered, then it ends."""
        for stream in list(self._streams):
            if stream.reader is not None:
                stream.reader.cancel()

    async def _read_stream(
        self, messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext, stream: _Stream
    ) -> None:
        try:
            async for message in messages:
                await stream.room.acquire()
                task = asyncio.create_task(self._stream_one(message, context, stream.answers))
                stream.running.add(task)
                task.add_done_callback(stream.finished)
        except asyncio.CancelledError:
            pass  # a stop (or the client left): read no more
        except Exception:  # noqa: BLE001 (the stream broke under us: nobody to answer)
            stream.cancel_running()  # not the reader itself: it still has to end the stream
        finally:
            if stream.running:
                await asyncio.gather(*stream.running, return_exceptions=True)
            stream.answers.put_nowait(_STREAM_END)

    async def _stream_one(
        self, message: bytes, context: grpc.aio.ServicerContext, answers: asyncio.Queue[Any]
    ) -> None:
        started = time.perf_counter_ns()
        record = RequestRecord() if self._access_log.enabled else None
        call = InferCall(message)
        del message  # the call holds it until it is parsed
        try:
            response = await self._infer(call, context.time_remaining(), record, started)
        except asyncio.CancelledError:
            self._log(context, "ModelStreamInfer", call, grpc.StatusCode.CANCELLED, started, record)
            raise
        except Exception as exc:  # noqa: BLE001 (the stream answers it with its message)
            code, text = status_of(exc)
            self._log(context, "ModelStreamInfer", call, code, started, record)
            request = call.names()
            failed = pb.ModelInferResponse(model_name=request.model_name, model_version=request.model_version,
                                           id=request.id)
            answers.put_nowait(pb.ModelStreamInferResponse(error_message=text, infer_response=failed))
            return
        self._log(context, "ModelStreamInfer", call, grpc.StatusCode.OK, started, record)
        answers.put_nowait(pb.ModelStreamInferResponse(infer_response=response))

    async def _infer(
        self,
        call: InferCall,
        time_remaining: float | None,
        record: RequestRecord | None,
        received_ns: int,
    ) -> pb.ModelInferResponse:
        """One infer request through the data plane, cheapest refusals first, before its
        message is parsed; its deadline counts from `received_ns`, when the call arrived."""
        self._plane.refuse_when_stopping()  # before RESOURCE_EXHAUSTED
        size = len(call.message)
        hold = self._flight.hold(size)  # the message as received, held until the answer
        self.in_flight += 1
        try:
            request = call.request = codec.parse_request(call.message)
            call.message = b""
            hold.hold_to(codec.held_when_parsed(request, size))
            if record is not None:
                record.request_id = request.id or None
            model = self._plane.admit(request.model_name, request.model_version or None)
            if record is not None:
                record.model_version = model.version
            declared = codec.declare(request)
            batch_size = self._plane.check_inputs(model, declared.declared)
            try:
                parameters = with_deadline(declared.parameters, time_remaining)
            except DeadlineExceeded:
                self._plane.count_expired(model, received_ns)
                raise
            regions = self._plane.shared_memory
            if declared.decode_cost > INLINE_DECODE_COST:
                inputs = await asyncio.to_thread(codec.decode_inputs, request, declared.in_shared_memory,
                                                 regions.read_inputs)
            else:
                inputs = codec.decode_inputs(request, declared.in_shared_memory, regions.read_inputs)
            targets = regions.output_targets(declared.to_shared_memory)
            outputs = await self._plane.start_call(model, inputs, parameters, declared.outputs, record, received_ns,
                                                   batch_size).answer()
            if sum(tensor_bytes(array) for _, _, array in outputs) > OFFLOAD_ENCODE_BYTES:
                return await asyncio.to_thread(_answer, request.model_name, model.version, request.id, outputs,
                                               targets)
            return _answer(request.model_name, model.version, request.id, outputs, targets)
        finally:
            self.in_flight -= 1
            hold.release()

    # -- shared ----------------------------------------------------------------------------------

    async def _call(self, context: grpc.aio.ServicerContext, rpc: str, work: Callable[[], T | Awaitable[T]]) -> T:
        """Run a non-infer RPC behind the gate; any failure is answered with its status."""
        try:
            refusal = self._gate.refusal(rpc, context.invocation_metadata())
            if refusal is not None:
                raise refusal
            result = work()
            if isinstance(result, Awaitable):
                result = await result
            return result  # type: ignore[return-value]
        except Exception as exc:
            code, message = status_of(exc)
            await _abort(context, code, message)
            raise  # abort raised already; this line is for the type checker

    def _log(self, context: grpc.aio.ServicerContext, rpc: str, call: InferCall, code: grpc.StatusCode, started: int,
             record: RequestRecord | None) -> None:
        if record is not None:
            self._access_log.write(context.peer() or "-", SERVICE + rpc, call.names().model_name, code.value[0],
                                   started, record, method="GRPC")


_UNREAD = pb.ModelInferRequest()  # what a call names before its message is parsed: no model, no id


class InferCall:
    """One infer call's message as received, and the request parsed from it once it is let in."""

    __slots__ = ("message", "request")

    def __init__(self, message: bytes) -> None:
        self.message = message
        self.request = _UNREAD

    def names(self) -> Any:
        """The call's model_name, model_version and id: the parsed request's, or, for a call
        refused before it was parsed, read from its message alone."""
        if self.request is _UNREAD:
            return codec.call_names(self.message)
        return self.request


def stream_share(max_requests: int) -> int:
    """The requests one stream may have running or answered but not yet sent: a quarter of the
    server's bound on requests in flight. One stream holding all of it refused every other
    client (1 call in 750 served); one whose client read no answers grew without bound."""
    return max(1, max_requests // 4)


class _Stream:
    """One ModelStreamInfer call: its reader, the requests it runs, the answers it sends. A
    request holds a place in `room` from when it is read until its answer is sent: a client
    that stops reading its answers is read no further."""

    def __init__(self, room: int) -> None:
        self.reader: asyncio.Task[None] | None = None
        self.room = asyncio.Semaphore(room)
        self.running: set[asyncio.Task[None]] = set()
        self.answers: asyncio.Queue[Any] = asyncio.Queue()

    def finished(self, task: asyncio.Task[None]) -> None:
        """A request's task is done: its answer is queued, or, cancelled, it has none to send and
        gives its place back now."""
        self.running.discard(task)
        if task.cancelled():
            self.room.release()

    def abandon(self) -> None:
        """Cancel what runs and stop reading: queued requests are dropped before compute."""
        self.cancel_running()
        if self.reader is not None:
            self.reader.cancel()

    def cancel_running(self) -> None:
        for task in list(self.running):
            task.cancel()


def _answer(
    model_name: str, version: int, request_id: str, outputs: list[codec.Output], targets: dict[str, Window],
) -> pb.ModelInferResponse:
    """Write the outputs asked for in shared memory there, then encode the answer."""
    written = write_outputs(outputs, targets) if targets else None
    return codec.encode_response(model_name, version, request_id, outputs, written)


def with_deadline(parameters: dict[str, Any], time_remaining: float | None) -> dict[str, Any]:
    """The request's parameters with the call's deadline as its `timeout` (microseconds), unless
    the request asks for a shorter one (or for one that is no timeout, refused at admission):
    the batcher then drops it unrun when it cannot make it.
    DEADLINE_MARGIN_US early, so that the batcher drops it (and counts it as a deadline) before
    grpc cancels the call at the same instant; an answer then would be too late anyway."""
    if time_remaining is None:
        return parameters
    remaining_us = int(time_remaining * 1e6) - DEADLINE_MARGIN_US
    if remaining_us <= 0:
        raise DeadlineExceeded("the call's deadline passed before it could run")
    asked = parameters.get("timeout")
    if asked is None or type(asked) is int and (asked == 0 or asked > remaining_us):  # none, or longer
        return {**parameters, "timeout": remaining_us}
    return parameters  # shorter; or not a timeout at all, which admission refuses as over HTTP


async def _unimplemented(context: grpc.aio.ServicerContext, what: str) -> None:
    await _abort(context, grpc.StatusCode.UNIMPLEMENTED, f"{what} not supported by this server")


# A status's text travels in a trailer (grpc-message), which clients refuse past 8 KiB or 16 KiB
# of metadata: a 4 MiB model name echoed in "model ... not found" failed the client's read of
# the answer itself. Texts past this many characters are cut, saying how long they were.
MAX_STATUS_CHARS = 1024


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, text: str,
                 trailing_metadata: tuple[tuple[str, str], ...] = ()) -> NoReturn:
    """End the call with `code`, its text cut to MAX_STATUS_CHARS. A call that ended meanwhile
    (its deadline passed and grpc answered DEADLINE_EXCEEDED itself, or its client left) is
    dropped as a cancelled one is: grpc logs a failed abort at ERROR, with a traceback, for what
    is a client's race."""
    if len(text) > MAX_STATUS_CHARS:
        text = f"{text[:MAX_STATUS_CHARS]}...({len(text)} characters)"
    try:
        await context.abort(code, text, trailing_metadata=trailing_metadata)
    except cygrpc.ExecuteBatchError:  # the status could not be sent: the call is over
        raise asyncio.CancelledError from None
