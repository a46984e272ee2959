"""The data plane every front end shares: KServe v2 operations over the model repository.

Protocol-neutral: calls come in as named numpy arrays and parameters, results go out as named
arrays, and failures are the typed errors of `server.errors`. Each front end owns its codec
(JSON and binary tensors over HTTP, protobuf over gRPC) and maps those errors to its statuses.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from server import __version__
from server.config import ModelConfig
from server.engines.registry import ENGINES
from server.errors import InvalidInput, QueueFull, Unavailable
from server.heap import HeapPolicy
from server.model import ModelVersion
from server.paced import PacedRender
from server.protocol.binary import tensor_bytes
from server.repository import ModelRepository
from server.scheduler.admission import check_declared
from server.scheduler.request import RequestRecord
from server.settings import MAX_OUTPUT_BYTES
from server.shared_memory import SystemSharedMemory
from server.triton_config import triton_model_config

Output = tuple[str, str, np.ndarray]  # name, datatype, array

STOPPING = "the server is shutting down; send the request to another replica"
MAX_CONFIG_OVERRIDE_CHARS = 64 << 10  # a model's config is a few hundred bytes; HTTP's control bodies stop here too

EXTENSIONS = [
    "binary_tensor_data",
    "model_configuration",
    "model_repository",
    "statistics",
]
SHARED_MEMORY_EXTENSION = "system_shared_memory"  # listed when clients may register regions


class DataPlane:
    def __init__(
        self, repository: ModelRepository, heap: HeapPolicy | None = None,
        shared_memory: SystemSharedMemory | None = None, max_output_bytes: int = MAX_OUTPUT_BYTES,
    ) -> None:
        self.repository = repository
        self.max_output_bytes = max_output_bytes  # an answer's tensors, together
        self.shared_memory = shared_memory or SystemSharedMemory()  # clients' regions, off unless allowed
        self._heap = heap  # settled after models load or unload; None: the collector is left as it is
        self._index = PacedRender(lambda: self.repository.index())  # shared by HTTP and gRPC
        self._startup: asyncio.Task[None] | None = None
        self.stopping = False  # a stop was asked for: not ready, no new inference; what is in flight finishes
        self.accepting = True  # False while the Server starts its front ends: not ready until all accept

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

    def server_metadata(self) -> dict[str, Any]:
        extensions = [*EXTENSIONS, SHARED_MEMORY_EXTENSION] if self.shared_memory.allowed else EXTENSIONS
        return {"name": "batchline", "version": __version__, "extensions": extensions}

    def server_live(self) -> bool:
        """False once a model lost every instance to a hung engine: only a restart frees them."""
        return self.repository.live()

    def server_ready(self) -> bool:
        return (not self.stopping and self.accepting and self._startup is not None
                and self._startup.done() and self.repository.all_ready())

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
            "platform": ENGINES[model.config.engine].triton_platform,
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

    async def repository_index(self, ready_only: bool) -> list[dict[str, str]]:
        """Every model and its state. The index reads the repository's folder on the event loop
        (5,000 model folders: about 30 ms), so calls waiting at once share one read, begun after
        each asked, and reads take at most a tenth of the loop: one client polling the index of
        5,000 folders cut others' inference from ~1,950 requests a second to ~60."""
        entries = [e.as_dict() for e in await self._index()]
        return [e for e in entries if e["state"] == "READY"] if ready_only else entries

    async def load(self, name: str, parameters: dict[str, Any]) -> None:
        """Load or reload `name`; a `config` parameter (JSON in config.yaml's schema) stands in for
        config.yaml for this load only, as Triton's repository extension allows."""
        if any(k.startswith("file:") for k in parameters):
            raise InvalidInput("loading with files is not supported; put the model's files in its folder")
        override = parameters.get("config")
        if override is not None and not isinstance(override, str):  # a gRPC bool_param false was no config
            raise InvalidInput("the 'config' parameter must be a string: the model's config as JSON")
        override = override or None  # "": config.yaml
        if override is not None and len(override) > MAX_CONFIG_OVERRIDE_CHARS:
            raise InvalidInput(f"the 'config' parameter is over {MAX_CONFIG_OVERRIDE_CHARS} characters")
        changes = self.repository.changes
        try:
            await self.repository.load(name, override)
        finally:
            self._settle_after(changes)  # a reload's old versions, or a failed load's remains, are freed now

    async def unload(self, name: str) -> None:
        changes = self.repository.changes
        try:
            await self.repository.unload(name)
        finally:
            self._settle_after(changes)

    def _settle_after(self, changes: int) -> None:
        """Settle the heap if models were built or dropped since `changes`. A full collection
        holds the event loop for tens to hundreds of milliseconds: a client asking again and
        again to unload a model that is not there cut others' inference from ~1,950 requests a
        second to ~14."""
        if self.repository.changes != changes:
            self._settle()

    def refuse_when_stopping(self) -> None:
        """503 (UNAVAILABLE) once a stop is asked for: another replica should take the call. A
        front end asks first, before its bound on requests in flight would answer 429 (retry
        here, where no server will be)."""
        if self.stopping:
            raise Unavailable(STOPPING)

    def admit(self, name: str, version: str | None) -> ModelVersion:
        """The model that will serve a call, after the refusals that cost nothing, so a front end
        runs them before it decodes anything: stopping (503), the model (404, 503) and its queue
        (429)."""
        self.refuse_when_stopping()
        model = self.repository.get(name, version)
        refuse_when_full(model)
        return model

    @staticmethod
    def check_inputs(model: ModelVersion, declared: dict[str, tuple[str, list[int]]]) -> int:
        """Names, datatypes, shapes and the batch size (400), from what the request declares:
        a front end calls this before it builds any tensor. The batch size, for `infer`."""
        try:
            return check_declared(model.config, declared)
        except InvalidInput:
            model.stats.count_failure("invalid")
            raise

    def _serving_now(self, model: ModelVersion) -> ModelVersion:
        """The version serving under `model`'s name and number now (Unavailable when none is:
        unloaded, or dropped by a reload's version policy)."""
        self.refuse_when_stopping()
        return self.repository.get(model.config.name, str(model.version))

    @staticmethod
    def count_expired(model: ModelVersion, received_ns: int) -> None:
        """A call whose deadline passed before it could start (a front end's own check),
        counted as the batcher counts one it drops at its deadline."""
        model.stats.count_failure("deadline", time.perf_counter_ns() - received_ns)

    def start_call(
        self,
        model: ModelVersion,
        inputs: dict[str, tuple[str, np.ndarray]],
        parameters: dict[str, Any],
        outputs: list[str] | None = None,
        record: RequestRecord | None = None,
        received_ns: int | None = None,
        checked_batch_size: int | None = None,
        items_a_part: int | None = None,
    ) -> Call:
        """Start one call on `model` (from `admit`): its inputs as named arrays and its parameters
        (priority, timeout and what the model's admission reads) in; the `outputs` asked for
        (None: all), checked before any compute, out in that order. Requests from every front
        end share the model's queue and batches. `received_ns` (perf_counter_ns) is when the
        front end took the request in: its `timeout` counts from there, not from admission.
        `checked_batch_size`: what `check_inputs` said of these inputs' declared shapes (the
        arrays were built to them), so they are not checked twice. Refusals raise here; what
        the call meets later comes through its future.
        A reload may have replaced `model` since `admit` chose it (the front end parsed a large
        body meanwhile, or sent a list's earlier texts one a call): the call goes to the version of its
        number that serves now, whose admission checks the inputs against its own config.
        `items_a_part`: a list taken whole, run in parts (ModelVersion.start_request)."""
        if not model.ready:
            model, checked_batch_size = self._serving_now(model), None
        selection = model.every_output if outputs is None else output_tensors(model.config, outputs)
        future = model.start_request(inputs, parameters, record, received_ns, checked_batch_size, items_a_part)
        return Call(future, selection, model, self.max_output_bytes)


class Call(NamedTuple):
    """A started call: the future of the model's outputs, and the outputs asked for."""

    future: asyncio.Future[dict[str, np.ndarray]]
    selection: Sequence[tuple[str, str]]  # (name, datatype), in the order asked for
    model: ModelVersion
    max_bytes: int = MAX_OUTPUT_BYTES  # of the outputs asked for, together

    def outputs(self, results: dict[str, np.ndarray]) -> list[Output]:
        """The outputs asked for; InvalidInput (400) past `max_bytes`: encoding a gigabyte of
        outputs held every other client for seconds, and gRPC's answer took six times its
        size in memory."""
        outputs = [(name, datatype, results[name]) for name, datatype in self.selection]
        size = sum(tensor_bytes(array) for _, _, array in outputs)
        if size > self.max_bytes:
            raise InvalidInput(
                f"the outputs of this request hold {size} bytes, over the server's limit of {self.max_bytes} "
                "(--max-output-bytes): send fewer or smaller inputs, or ask for fewer outputs"
            )
        return outputs

    async def answer(self) -> list[Output]:
        """The outputs asked for, once computed (the call's error, raised). Raised from here,
        the error's traceback holds this frame, and the frame would hold the error back through
        the call's future: a cycle keeping the caller's frames (its inputs) until a rare full
        collection, were they not let go first."""
        future = self.future
        try:
            results = await future
        except BaseException:
            del self, future
            raise
        return self.outputs(results)

    def withdraw(self) -> None:
        """Its caller gave up: drop it if it is still queued; one computing runs to its end and
        its future completes as usual (its inputs may be read until then)."""
        self.model.withdraw(self.future)


def refuse_when_full(model: ModelVersion) -> None:
    """429 before the body is parsed when the model's queue is already at max_queue_size: a
    full queue refuses at submit anyway, so parsing, building and tokenizing first is waste."""
    batching = model.config.dynamic_batching
    limit = batching.default_queue_policy.max_queue_size if batching is not None else 0
    if limit and model.queue_depth >= limit:
        model.stats.count_failure("queue_full")
        raise QueueFull(f"the queue of this model is full ({limit} requests waiting); retry later")


def output_tensors(config: ModelConfig, names: list[str]) -> list[tuple[str, str]]:
    """(name, datatype) of each output asked for, in that order (a call that asks for none gets
    the model's `every_output`); an unknown name is a 400 before any compute."""
    selection = []
    for name in names:
        tensor = config.output(name)
        if tensor is None:
            known = ", ".join(t.name for t in config.outputs)
            raise InvalidInput(f"model '{config.name}' has no output '{name}' (outputs: {known})")
        selection.append((tensor.name, tensor.datatype))
    return selection
