"""The data plane every front end shares: KServe v2 operations over the model repository.

Front ends (HTTP today) only move bytes and statuses; what each operation means lives here.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

from server import __version__
from server.config import ModelConfig
from server.errors import BatchlineError, InvalidInput, QueueFull, Unavailable
from server.heap import HeapPolicy
from server.model import ModelVersion
from server.protocol.triton_config import triton_model_config, triton_platform
from server.protocol.v2 import (
    DecodedRequest,
    ParsedRequest,
    build_tensors,
    encode_response,
    parse_request,
)
from server.repository import ModelRepository
from server.scheduler.admission import check_declared
from server.scheduler.request import RequestRecord

# Work that grows with a request runs on a worker thread above these sizes, so one big request
# never stalls the event loop every other request shares. Measured worst cases inline (orjson,
# one core): 16 KiB of JSON, nested or many tiny strings, ~1 ms to parse and build; 64 KiB of
# JSON outputs ~0.5 ms to encode; 1 MiB of binary outputs, one copy, ~0.1 ms.
INLINE_DECODE_BYTES = 16 << 10
INLINE_ENCODE_JSON_BYTES = 64 << 10
OFFLOAD_BYTES = 1 << 20

EXTENSIONS = [
    "binary_tensor_data",
    "model_configuration",
    "model_repository",
    "statistics",
]


class DataPlane:
    def __init__(self, repository: ModelRepository, heap: HeapPolicy | None = None) -> None:
        self.repository = repository
        self._heap = heap  # settled after models load or unload; None: the collector is left as it is
        self._startup: asyncio.Task[None] | None = None
        self.stopping = False  # a stop was asked for: not ready, no new inference; what is in flight finishes

    def start(self, models: list[str] | None = None) -> None:
        """Begin loading models in the background: the server is live at once, ready later."""
        self._startup = asyncio.create_task(self._load_at_start(models))

    async def _load_at_start(self, models: list[str] | None) -> None:
        await self.repository.load_all(models)
        self._settle()

    def _settle(self) -> None:
        if self._heap is not None:
            self._heap.settle()

    def begin_stop(self) -> None:
        """The moment a stop is asked for (SIGTERM): readiness turns false, so the orchestrator
        stops routing here, and new inference is refused with 503 (another replica can take it),
        while what is already queued or running finishes before `stop`."""
        self.stopping = True

    async def stop(self) -> None:
        self.stopping = True
        if self._startup is not None and not self._startup.done():
            self._startup.cancel()
        await self.repository.unload_all()

    @staticmethod
    def server_metadata() -> dict[str, Any]:
        return {"name": "batchline", "version": __version__, "extensions": EXTENSIONS}

    def server_live(self) -> bool:
        """False once a model lost every instance to a hung engine: only a restart frees them."""
        return self.repository.live()

    def server_ready(self) -> bool:
        return not self.stopping and self._startup is not None and self._startup.done() and self.repository.all_ready()

    def model_ready(self, name: str, version: str | None) -> bool:
        try:
            return self.repository.get(name, version).ready
        except Unavailable:
            return False

    def model_metadata(self, name: str, version: str | None) -> dict[str, Any]:
        model = self.repository.get(name, version)
        versions = [str(m.version) for m in self.repository.versions(name) if m.ready]
        return {
            "name": name,
            "versions": versions,
            "platform": triton_platform(model.config.engine),
            **model.metadata(),
        }

    def model_config(self, name: str, version: str | None) -> dict[str, Any]:
        if version:
            served = self.repository.get(name, version)
            return triton_model_config(served.config, served.placement)
        loaded = self.repository.versions(name)
        if loaded:
            return triton_model_config(loaded[-1].config, loaded[-1].placement)
        return triton_model_config(self.repository.config(name))

    def statistics(self, name: str | None, version: str | None) -> dict[str, Any]:
        if name is None:
            models = [m for m in self.repository.loaded() if m.ready]
        elif version:
            models = [self.repository.get(name, version)]
        else:
            models = self.repository.versions(name)
            if not models:
                self.repository.get(name)  # raises the reason
        return {"model_stats": [m.stats.as_dict(m.config.name, m.version) for m in models]}

    def repository_index(self, ready_only: bool) -> list[dict[str, str]]:
        entries = [e.as_dict() for e in self.repository.index()]
        return [e for e in entries if e["state"] == "READY"] if ready_only else entries

    async def load(self, name: str, parameters: dict[str, Any]) -> None:
        if parameters.get("config") or any(k.startswith("file:") for k in parameters):
            raise InvalidInput("loading with a config override or files is not supported; edit config.yaml")
        try:
            await self.repository.load(name)
        finally:
            self._settle()  # a reload's old versions, or a failed load's remains, are freed now

    async def unload(self, name: str) -> None:
        try:
            await self.repository.unload(name)
        finally:
            self._settle()

    async def infer(
        self,
        name: str,
        version: str | None,
        body: bytes,
        header_length: int | None,
        record: RequestRecord | None = None,
    ) -> tuple[bytes, int | None]:
        """One v2 infer call: bytes in, response bytes (and binary header length) out.

        The cheap refusals come first, each before any work that grows with the request: the
        model (404, 503) and its queue (429) before the body is parsed; names, datatypes, shapes
        and the batch size (400) before any tensor is built.
        """
        try:
            if self.stopping:
                raise Unavailable("the server is shutting down; send the request to another replica")
            model = self.repository.get(name, version)
            refuse_when_full(model)
        except BatchlineError as exc:
            # the access log line still names its request; not under overload, where refusing is all
            if record is not None and not isinstance(exc, QueueFull):
                record.request_id = await asyncio.to_thread(_request_id, body, header_length)
            raise
        if record is not None:
            record.model_version = model.version
        if len(body) > INLINE_DECODE_BYTES:
            parsed = await asyncio.to_thread(_parse_without_gc, body, header_length)
        else:
            parsed = parse_request(body, header_length)
        if record is not None:
            record.request_id = parsed.id
        try:
            check_declared(model.config, {d.name: (d.datatype, d.shape) for d in parsed.inputs})
        except InvalidInput:
            model.stats.count_failure("invalid")
            raise
        if parsed.decode_bytes > INLINE_DECODE_BYTES:
            decoded = await asyncio.to_thread(build_tensors, parsed)
        else:
            decoded = build_tensors(parsed)
        selection = selected_outputs(model.config, decoded)
        outputs = await model.infer(decoded.inputs, decoded.parameters, record)
        tensors = [(n, datatype, outputs[n], binary) for n, datatype, binary in selection]
        json_bytes = binary_bytes = 0
        for _, _, array, binary in tensors:
            if binary:
                binary_bytes += array.nbytes
            else:
                json_bytes += array.nbytes
        if json_bytes > INLINE_ENCODE_JSON_BYTES or binary_bytes > OFFLOAD_BYTES:
            return await asyncio.to_thread(encode_response, name, model.version, decoded.id, tensors)
        return encode_response(name, model.version, decoded.id, tensors)


def refuse_when_full(model: ModelVersion) -> None:
    """429 before the body is parsed when the model's queue is already at max_queue_size: a
    full queue refuses at submit anyway, so parsing, building and tokenizing first is waste."""
    batching = model.config.dynamic_batching
    limit = batching.default_queue_policy.max_queue_size if batching is not None else 0
    if limit and model.queue_depth >= limit:
        model.stats.count_failure("queue_full")
        raise QueueFull(f"the queue of this model is full ({limit} requests waiting); retry later")


_gc_lock = threading.Lock()
_gc_pauses = 0
_gc_was_enabled = False


def _parse_without_gc(body: bytes, header_length: int | None) -> ParsedRequest:
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


def _request_id(body: bytes, header_length: int | None) -> str | None:
    """The request's id for the access log of a refused request, best effort (a worker thread:
    the body was never parsed, and a big one is not parsed on the loop for a log line)."""
    try:
        request = _parse_without_gc(body, header_length)
    except BatchlineError:
        return None
    return request.id


def selected_outputs(config: ModelConfig, request: DecodedRequest) -> list[tuple[str, str, bool]]:
    """(name, datatype, as_binary) of each output to return, checked before any compute."""
    if request.outputs is None:
        return [(t.name, t.datatype, request.binary_output) for t in config.outputs]
    selection = []
    for wanted in request.outputs:
        tensor = config.output(wanted.name)
        if tensor is None:
            names = ", ".join(t.name for t in config.outputs)
            raise InvalidInput(f"model '{config.name}' has no output '{wanted.name}' (outputs: {names})")
        binary = request.binary_output if wanted.binary is None else wanted.binary
        selection.append((tensor.name, tensor.datatype, binary))
    return selection
