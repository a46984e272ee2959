"""One served model version: its instances, its batcher, its statistics and its lifecycle.

Loading builds one engine per placement, warms every instance up (profiling the batch ladder
when asked), and only then reports ready; a failure leaves the version unavailable with the
reason, and other models unaffected. Warm-up and profiling run on the instance's own thread,
the one that will serve its batches: what an engine prepares per thread (torch's CUDA graphs)
is then prepared once, where it is used. Versions load side by side, but a batch profile times
alone among loads (server/load_gate.py): beside another model's load it times the neighbour, not
the model.

While serving, an instance stuck in its engine past execution_timeout_seconds is replaced by a
fresh one, built and warmed up the same way, so the version keeps serving; the stuck thread is
left to finish (or not) on its own. Replacement stops when more threads are stuck than the
version has instances (each may hold a core or device memory): the lost instances stay lost,
and a version with none left is unavailable until it is reloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from server.config import ModelConfig, TensorConfig
from server.devices import Device, placements
from server.engines import create_engine
from server.engines.registry import ENGINES
from server.errors import (
    BatchlineError,
    ConfigMismatch,
    EngineError,
    InvalidInput,
    Unavailable,
    without_tracebacks,
)
from server.gpu import driver_versions, identity
from server.load_gate import LOADS, run_load, run_now
from server.preprocess import TextTokenizer
from server.protocol.datatypes import numpy_dtype
from server.recording import TrafficRecorder
from server.scheduler.admission import Admission, Admitted
from server.scheduler.batcher import Batcher, BatchRunner, QueueSettings
from server.scheduler.chunking import gathered, in_flight
from server.scheduler.policy import BatchPolicy
from server.scheduler.request import InferenceRequest, RequestRecord
from server.stats import ModelStatistics
from server.versions import installed_versions
from server.workers.instance import ModelInstance
from server.workers.pipeline import ModelPipeline, paddable_inputs

logger = logging.getLogger(__name__)

# A batch profile's timed passes stop after this long (at least one is timed): a load holds its
# model, other models' profiles and a server's stop until it ends (profile_repeats is bounded too).
PROFILE_BUDGET_S = 30.0


class ModelState(enum.StrEnum):
    LOADING = "LOADING"
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"
    UNLOADING = "UNLOADING"


class ModelVersion:
    def __init__(self, config: ModelConfig, version: int, path: Path) -> None:
        self.config = config
        self.version = version
        self.path = path
        self.ready = False
        self.state = ModelState.LOADING
        # (name, datatype) of every output, in the config's order: what a call that asks for none returns
        self.every_output = tuple((t.name, t.datatype) for t in config.outputs)
        self.reason = ""
        self.config_mismatch = False  # it failed to load because its config does not describe its model
        self.stats = ModelStatistics()
        self.placement = ""  # where and on what it runs, once ready (the model config's parameters show it)
        self.instances: list[ModelInstance] = []  # in service (the batcher says which are idle)
        self._abandoned: list[ModelInstance] = []  # stuck past the watchdog, maybe forever
        self._pads: dict[str, float] = {}
        self._instance_count = 0  # as configured (placements)
        self._admission: Admission | None = None
        self._batcher: Batcher | None = None
        self._closed = False
        # requests in admission on a worker thread: an unload lets them reach the queue first
        self._admissions: set[asyncio.Task[None]] = set()
        self._chunked: set[asyncio.Task[dict[str, np.ndarray]]] = set()  # requests run in chunks
        self.recorder: TrafficRecorder | None = None  # record_traffic: a sample of client inputs for builds
        self._recording: asyncio.Task[None] | None = None

    @property
    def state(self) -> ModelState:
        return self._state

    @state.setter
    def state(self, state: ModelState) -> None:
        self._state = state
        self.ready = state is ModelState.READY  # an attribute, not a property: every call reads it

    @property
    def label(self) -> str:
        return f"{self.config.name}/{self.version}"

    async def load(self) -> None:
        """Build, warm up and profile every instance off the event loop; never raises."""
        try:
            await run_load(self._build)
            gpus, driver = await run_load(_gpu_identities, self.instances)  # NVML may block: off the loop
        except BatchlineError as exc:
            self.config_mismatch = isinstance(exc, ConfigMismatch)
            self._fail(exc.message)
            return
        except Exception as exc:  # a bug or an engine's own error type: keep the server up
            logger.exception("loading %s failed", self.label)
            self._fail(f"{type(exc).__name__}: {exc}")
            return
        self._batcher = Batcher(
            self._policy(), self._queue_settings(), list(self.instances), self.stats,
            replace=self._replace, on_exhausted=self._exhausted,
        )
        self.placement = _placement(self.instances, gpus, driver)
        if self.config.record_traffic is not None:
            recorder = TrafficRecorder(self.config.record_traffic, self.config, self.path.parent)
            await run_load(recorder.restore)
            self.recorder, self._recording = recorder, asyncio.create_task(recorder.run())
            logger.info("model %s records a sample of its requests' inputs to %s (record_traffic)",
                        self.label, recorder.path)
        self.state = ModelState.READY
        for instance in self.instances:
            d = instance.pipeline.engine.describe()
            gpu = f" ({gpus[instance.device.index]})" if instance.device.kind == "GPU" else ""
            logger.info(
                "model %s ready: instance %s engine=%s device=%s%s providers=%s precision=%s batch_cap=%d",
                self.label, instance.label, d.engine, d.device, gpu, ",".join(d.providers), d.precision,
                self.stats.batch_cap,
            )

    def _fail(self, reason: str) -> None:
        self.state = ModelState.UNAVAILABLE
        self.reason = reason
        self._close_instances()
        logger.error("model %s is not ready: %s", self.label, reason)

    def _build(self) -> None:
        tokenize = self.config.tokenize
        tokenizer = TextTokenizer(tokenize, self.path) if tokenize else None
        self._admission = Admission(self.config, tokenizer)
        self._pads = paddable_inputs(self.config, tokenizer.outputs if tokenizer else {})
        try:
            for index, device in enumerate(placements(self.config.instance_group)):
                self.instances.append(self._new_instance(device, f"{self.config.name}-{self.version}-{index}"))
            self._instance_count = len(self.instances)
            with LOADS.alone(self.label) if self._times_batch_ladder() else contextlib.nullcontext():
                self.stats.batch_cap = self.instances[0].run_on_thread(self._batch_cap)
        except BaseException:
            self._close_instances()
            raise

    def _new_instance(self, device: Device, label: str, replacing: bool = False) -> ModelInstance:
        """An instance on `device`, warmed up on its own thread: at load, and in place of a stuck
        one (`replacing`: at once, even beside another model's batch profile)."""
        with LOADS.building(f"instance {label}", wait=not replacing):
            engine = create_engine(self.config, self.path, device)
            instance = ModelInstance(
                ModelPipeline(self.config, engine, self._pads), device, label,
                timeout_s=self.config.execution_timeout_seconds,
            )
            try:
                instance.run_on_thread(self._warm_up)
            except BaseException:
                instance.close()
                raise
        return instance

    async def _replace(self, stuck: BatchRunner) -> BatchRunner:
        """A fresh instance for one the watchdog took out of service (the batcher asks)."""
        assert isinstance(stuck, ModelInstance)
        if stuck in self.instances:
            self.instances.remove(stuck)
        self._abandoned.append(stuck)
        self.stats.instances_stuck += 1
        stuck.on_return(lambda: self._returned(stuck))
        still_stuck = sum(i.stuck for i in self._abandoned)
        limit = self._instance_count
        if still_stuck > limit:
            raise Unavailable(
                f"{still_stuck} instances are stuck in the engine (more than the {limit} configured);"
                " no more are started: restart the server to free them"
            )
        logger.warning("model %s: replacing instance %s, stuck in the engine", self.label, stuck.label)
        fresh = await run_now(self._new_instance, stuck.device, stuck.label, True)
        if self._closed:  # unloaded while the fresh one warmed up
            await run_now(fresh.close)
            raise Unavailable(f"model {self.label} was unloaded")
        self.instances.append(fresh)
        return fresh

    def _returned(self, instance: ModelInstance) -> None:
        """An abandoned run came back at last: its thread closes the engine and ends."""
        self.stats.instances_stuck -= 1
        self._abandoned.remove(instance)
        logger.warning("model %s: the stuck run of instance %s came back; it was discarded", self.label, instance.label)

    def _exhausted(self, reason: str) -> None:
        """No instance is left in service and none is coming: the version no longer serves."""
        if self.state is ModelState.READY:
            self.state = ModelState.UNAVAILABLE
            self.reason = f"no instance in service: {reason}"
            logger.error("model %s is not ready: %s", self.label, self.reason)

    @property
    def wedged(self) -> bool:
        """Lost for good to threads stuck in the engine: only a new process frees them."""
        return self.state is not ModelState.READY and any(i.stuck for i in self._abandoned) and not self.instances

    def _warm_up(self, pipeline: ModelPipeline) -> None:
        """Run the model before it serves: its outputs are checked against the config, and what
        the engine prepares on a first run is prepared now, not with a client waiting. Called on
        the instance's own thread (`ModelInstance.run_on_thread`), which serves its batches.

        How many shapes depends on the engine (`Engine.compiles_per_shape`). One that prepares
        each new shape (torch.compile and its CUDA graphs, TensorRT, ONNX Runtime's TensorRT
        provider or cuDNN's exhaustive search) runs every shape a batch can take: each batch
        bucket a batch can be padded up to (the first at or past max_batch_size included: a full
        batch reaches it) and each of `warmup.batch_sizes`, and for a text model with
        `sequence_buckets`, each of those at every sequence bucket. Any other engine has nothing
        to prepare per shape: `warmup.batch_sizes` and the batch buckets within max_batch_size,
        the warm-up text at its own length, as a batch runs on such an engine (padded to the
        bucket only for a model of one bucket: server/workers/pipeline.py).
        Shapes without buckets are not fixed, so there is none to sweep: a text model without
        sequence_buckets runs the warm-up text at its own length, and an input's variable dim
        runs at length 1."""
        if not self.config.warmup.enabled:
            return
        sweep = pipeline.engine.compiles_per_shape
        tokenize = self.config.tokenize
        lengths: list[int | None] = [None]
        if sweep and tokenize and tokenize.sequence_buckets:
            lengths = list(tokenize.sequence_buckets)
        sizes = self._warmup_batch_sizes(sweep)
        if sweep:
            logger.info(
                "model %s: warm-up at batch sizes %s%s: every bucket a batch can reach (the engine prepares"
                " each shape on its first run)", self.label, sizes,
                f", each at sequence lengths {lengths}" if lengths != [None] else "",
            )
        else:
            logger.info(
                "model %s: warm-up at batch sizes %s: buckets not swept (the engine prepares nothing per shape)",
                self.label, sizes,
            )
        for batch_size in sizes:
            feed = self._sample_feed(batch_size)
            for length in lengths:
                try:
                    pipeline.run_batch([self._fitted(feed, length)], verify=True)
                except BatchlineError as exc:
                    where = f"batch size {batch_size}" + (f", sequence length {length}" if length else "")
                    raise EngineError(f"warm-up at {where} failed: {exc.message}") from exc

    def _warmup_batch_sizes(self, sweep: bool) -> list[int]:
        """`warmup.batch_sizes`, and with `sweep` a size that pads up to each batch bucket a
        batch can reach; without, the batch buckets within max_batch_size. A batching model
        runs a batch of 2 at least: one whose outputs ignore the batch (a reshape to one row, a
        sum over it) passes a batch of 1, then failed every batch of more under load."""
        sizes = set(self.config.warmup.batch_sizes)
        cap = self.config.max_batch_size
        if not sweep:
            sizes |= set(self.config.batch_ladder() if self.config.batch_buckets else [])
        else:
            for bucket in self.config.batch_buckets or []:
                sizes.add(min(bucket, cap))
                if bucket >= cap:  # larger buckets are never reached
                    break
        if self.config.batched and cap >= 2 and max(sizes, default=0) < 2:
            sizes.add(2)
        return sorted(sizes)

    def _fitted(self, feed: dict[str, np.ndarray], length: int | None) -> dict[str, np.ndarray]:
        """The warm-up feed with its token tensors `length` long: padded with their pad values,
        as a short text is in a batch of longer ones, or cut when the text is longer."""
        tokenize = self.config.tokenize
        if length is None or tokenize is None:
            return feed
        fitted = dict(feed)
        for name in (tokenize.input_ids, tokenize.attention_mask, tokenize.token_type_ids):
            if name is None:
                continue
            tokens = feed[name][..., :length]
            if tokens.shape[-1] < length:
                widths = [(0, 0)] * (tokens.ndim - 1) + [(0, length - tokens.shape[-1])]
                tokens = np.pad(tokens, widths, constant_values=self._pads[name])
            fitted[name] = tokens
        return fitted

    def _times_batch_ladder(self) -> bool:
        warmup = self.config.warmup
        return self.config.batched and warmup.batch_cap is None and warmup.enabled and warmup.profile

    def _batch_cap(self, pipeline: ModelPipeline) -> int:
        """Time the batch ladder; the cap is where more batch stops buying throughput."""
        warmup = self.config.warmup
        if not self.config.batched:
            return 1
        if warmup.batch_cap is not None:
            return min(warmup.batch_cap, self.config.max_batch_size)
        if not self._times_batch_ladder():
            return self.config.max_batch_size
        feeds = {size: self._sample_feed(size) for size in self.config.batch_ladder()}
        for feed in feeds.values():
            pipeline.run_batch([feed])  # each shape once untimed: first runs allocate
        fastest = dict.fromkeys(feeds, float("inf"))
        # Each repeat times every size in turn: a machine that slows down (or speeds up) while the
        # ladder is timed weighs on every size alike. Timed one size after another, the sizes
        # timed in a fast spell won, and the cap followed the machine's drift, not the model.
        began = time.perf_counter()
        for repeat in range(1, warmup.profile_repeats + 1):
            for size, feed in feeds.items():
                start = time.perf_counter()
                pipeline.run_batch([feed])
                # the least disturbed run: other work on the machine only adds time
                fastest[size] = min(fastest[size], time.perf_counter() - start)
            if repeat < warmup.profile_repeats and time.perf_counter() - began > PROFILE_BUDGET_S:
                logger.warning("model %s: the batch profile stopped after %d of %d passes, past %.0f s",
                               self.label, repeat, warmup.profile_repeats, PROFILE_BUDGET_S)
                break
        profile = [{"batch_size": size, "seconds": seconds, "items_per_second": size / seconds}
                   for size, seconds in fastest.items()]
        self.stats.batch_profile = profile
        best = max(p["items_per_second"] for p in profile)
        return next(int(p["batch_size"]) for p in profile if p["items_per_second"] >= (1 - warmup.tolerance) * best)

    def _sample_feed(self, batch_size: int) -> dict[str, np.ndarray]:
        inputs = {t.name: self._sample(t, batch_size) for t in self.config.inputs}
        assert self._admission is not None
        return self._admission.admit_now(inputs, batch_size).feed

    def _sample(self, tensor: TensorConfig, batch_size: int) -> np.ndarray:
        """An input as admission would have validated it, every element the warm-up value."""
        shape = [batch_size] if self.config.batched else []
        shape += [1 if d == -1 else d for d in tensor.dims]
        value = self.config.warmup.inputs.get(tensor.name)
        if tensor.datatype == "BYTES":
            text = self.config.warmup.text if value is None else str(value)
            tokenized = self.config.tokenize is not None and tensor.name == self.config.tokenize.input
            texts = np.empty(shape, dtype=object)
            # the text to tokenize is decoded to str at admission; other BYTES travel as bytes
            texts.fill(text if tokenized else text.encode())
            return texts
        return np.full(shape, 0 if value is None else value, dtype=numpy_dtype(tensor.datatype))

    def _policy(self) -> BatchPolicy:
        batching = self.config.dynamic_batching
        cap = max(self.stats.batch_cap, 1)
        buckets = tuple(self.config.batch_buckets or ())
        if batching is None:
            return BatchPolicy(max_batch_size=cap, batch_buckets=buckets)
        return BatchPolicy(
            max_batch_size=cap,
            preferred=tuple(sorted(p for p in batching.preferred_batch_size if p <= cap)),
            max_delay_ns=batching.max_queue_delay_microseconds * 1000,
            max_batch_tokens=batching.max_batch_tokens,
            batch_buckets=buckets,
        )

    def _queue_settings(self) -> QueueSettings:
        batching = self.config.dynamic_batching
        if batching is None:
            return QueueSettings(merge=False)
        return QueueSettings(
            levels=batching.levels,
            max_queue_size=batching.default_queue_policy.max_queue_size,
            merge=True,
            preserve_ordering=batching.preserve_ordering,
            by_length=texts_by_length(self.config, [i.pipeline for i in self.instances]),
        )

    def start_request(
        self,
        inputs: dict[str, tuple[str, np.ndarray]],
        parameters: dict[str, Any] | None = None,
        record: RequestRecord | None = None,
        received_ns: int | None = None,
        checked_batch_size: int | None = None,
        items_a_part: int | None = None,
    ) -> asyncio.Future[dict[str, np.ndarray]]:
        """Admit and queue one request: the future of its outputs (API names); `record` collects
        its times. Its clock (durations, the `timeout` deadline) starts at `received_ns`, when its
        front end took it in (None: now). `checked_batch_size`: the front end checked the inputs'
        names, datatypes and shapes already (None: admission checks them). A small request is
        admitted and queued here, with no task or coroutine of its own (a caller that needs none,
        a front end's link, pays for none); one whose admission goes to a worker thread gets a
        task. Cancelling the future drops a request not yet computing; `withdraw` drops one only
        while it is queued, before a batch or its admission reads its inputs.
        `items_a_part`: a list a front end takes whole (OpenAI's embeddings input, up to 2048
        texts), for a model that `splits_rows`: its rows are not bounded by max_batch_size, and
        it runs in parts of at most that many, by its texts' tokens."""
        if self._batcher is None or self._admission is None or not self.ready:
            raise Unavailable(f"model '{self.config.name}' version {self.version} is not ready")
        batcher, admission = self._batcher, self._admission
        started = received_ns or time.perf_counter_ns()
        try:
            if items_a_part is not None:
                if not admission.splittable:  # (a front end asks `splits_rows` first; a reload may change that)
                    raise Unavailable(f"model '{self.config.name}' version {self.version} was reloaded and takes "
                                      "no list of texts in parts now; retry")
                items_a_part = max(1, min(items_a_part, self.config.max_batch_size))
                if checked_batch_size is None:
                    checked_batch_size = admission.rows_of_list(inputs)
            admitted = admission.admit_or_offload(inputs, parameters or {}, started, checked_batch_size)
        except InvalidInput:
            self.stats.count_failure("invalid")
            raise
        if items_a_part is not None or admission.may_pass_budget(inputs, checked_batch_size):
            return self._start_in_parts(batcher, admission, admitted, inputs, record, started, items_a_part)
        future: asyncio.Future[dict[str, np.ndarray]] = asyncio.get_running_loop().create_future()
        if isinstance(admitted, Admitted):
            self._queued(batcher, admission, admitted, inputs, record, started, future)
            return future
        task = asyncio.ensure_future(
            self._queued_later(batcher, admission, admitted, inputs, record, started, future))
        self._admissions.add(task)  # counted now: an unload from here on waits for it
        task.add_done_callback(self._admissions.discard)
        return future

    @property
    def splits_rows(self) -> bool:
        """Whether a request's rows can run in parts (`items_a_part`): a batching text model of
        one text a row, whose outputs have fixed dims (parts of other widths would not join)."""
        return self._admission is not None and self._admission.splittable

    def withdraw(self, future: asyncio.Future[dict[str, np.ndarray]]) -> bool:
        """Drop a request still queued (from `start_request`), its caller gone: True if it was.
        One computing, or in admission on a worker thread, runs to its end and its future is
        left alone, since its inputs may be read until then (a front end must not reuse their
        memory before its answer). A request run in chunks has those still queued dropped."""
        if future in self._chunked:
            future.cancel()
            return True
        return self._batcher is not None and self._batcher.withdraw(future)

    def _start_in_parts(
        self,
        batcher: Batcher,
        admission: Admission,
        admitted: Admitted | Callable[[], Admitted],
        inputs: dict[str, tuple[str, np.ndarray]],
        record: RequestRecord | None,
        started: int,
        items: int | None,
    ) -> asyncio.Future[dict[str, np.ndarray]]:
        """A request whose texts may pass the model's token budget (see
        server/scheduler/chunking.py), or a list of at most `items` a part, admitted whole
        (tokenized once; `admitted` is that work when it runs on a worker thread), then cut
        into parts by its texts' tokens, each queued as a request of its own, or queued whole
        when it fits after all. Cut, its future is the task that joins the parts' outputs back
        in its rows' order (cancelled, it drops the parts still waiting)."""
        loop = asyncio.get_running_loop()

        def queued(part: Admitted, part_inputs: dict[str, tuple[str, np.ndarray]], part_record: RequestRecord | None,
                   first: bool = True) -> asyncio.Future[dict[str, np.ndarray]]:
            # A part after the first is queued past the queue's bound (the request's place was
            # counted with its first), and while the version unloads (an unload waits for it).
            future: asyncio.Future[dict[str, np.ndarray]] = loop.create_future()
            self._queued(batcher, admission, part, part_inputs, part_record, started, future, first)
            return future

        parts = admission.split(admitted, items) if isinstance(admitted, Admitted) else None
        if isinstance(admitted, Admitted) and parts is None:
            return queued(admitted, inputs, record)  # within the budget after all: no task

        def admitted_and_cut(work: Callable[[], Admitted]) -> tuple[Admitted, list[tuple[list[int], Admitted]] | None]:
            whole = work()  # on a worker thread: a large request's parts are cut there too
            return whole, admission.split(whole, items)

        async def joined(
            work: Callable[[], Admitted] | None, parts: list[tuple[list[int], Admitted]] | None,
        ) -> dict[str, np.ndarray]:
            if work is not None:
                try:
                    whole, parts = await asyncio.to_thread(admitted_and_cut, work)
                except InvalidInput:
                    self.stats.count_failure("invalid")
                    raise
                del work
                if parts is None:
                    return await queued(whole, inputs, record)
                del whole  # its parts hold what they need of it
            assert parts is not None
            plan = [rows for rows, _ in parts]
            waiting: list[Admitted | None] = [part for _, part in parts]  # each let go once queued
            del parts

            def start(index: int, rows: list[int], part_record: RequestRecord) -> asyncio.Future[dict[str, np.ndarray]]:
                part, waiting[index] = waiting[index], None
                assert part is not None
                # (a part's inputs are read by the recorder alone)
                part_inputs = inputs if self.recorder is None else {
                    name: (datatype, array[rows]) for name, (datatype, array) in inputs.items()}
                return queued(part, part_inputs, part_record, index == 0)

            answers = await gathered(plan, start, in_flight(len(self.instances)), record)
            total = sum(len(rows) for rows in plan)
            outputs: dict[str, np.ndarray] = {}
            for name, first in answers[0].items():
                outputs[name] = np.empty((total, *first.shape[1:]), dtype=first.dtype)
                for rows, answer in zip(plan, answers, strict=True):
                    outputs[name][rows] = answer[name]
            return outputs

        task = asyncio.ensure_future(joined(None if isinstance(admitted, Admitted) else admitted, parts))
        del admitted, parts
        self._chunked.add(task)  # an unload waits for it; withdraw cancels it
        task.add_done_callback(self._chunked.discard)
        return task

    def _queued(
        self,
        batcher: Batcher,
        admission: Admission,
        admitted: Admitted,
        inputs: dict[str, tuple[str, np.ndarray]],
        record: RequestRecord | None,
        received_ns: int,
        future: asyncio.Future[dict[str, np.ndarray]],
        bounded: bool = True,
    ) -> None:
        # An unload that began during an admission off the loop waited for it: it is queued and drained.
        if self._closed or self.state not in (ModelState.READY, ModelState.UNLOADING):
            raise Unavailable(f"model '{self.config.name}' version {self.version} is not ready: {self.reason}")
        if record is not None:
            record.tokens = admission.tokens_in(admitted.feed)
        request = InferenceRequest(
            admitted.feed,
            admitted.batch_size,
            future,
            shape_key=admitted.shape_key,
            longest=admitted.longest,
            length=admitted.length,
            padded=admitted.padded,
            priority=admitted.priority,
            deadline_ns=admitted.deadline_ns,
            received_ns=received_ns,
            record=record,
            bounded=bounded,
        )
        batcher.submit(request)
        if self.recorder is not None:  # queued: admitted, and not refused for a full queue
            self.recorder.offer(inputs, admitted.batch_size)

    async def _queued_later(
        self,
        batcher: Batcher,
        admission: Admission,
        work: Callable[[], Admitted],
        inputs: dict[str, tuple[str, np.ndarray]],
        record: RequestRecord | None,
        received_ns: int,
        future: asyncio.Future[dict[str, np.ndarray]],
    ) -> None:
        """Queue a request whose admission `work` runs on a worker thread; its outcome, a
        refusal too, goes to `future`. A caller that gave up meanwhile is not queued."""
        try:
            admitted = await asyncio.to_thread(work)
            if not future.done():
                self._admissions.discard(asyncio.current_task())  # type: ignore[arg-type]  # queued, counted there
                self._queued(batcher, admission, admitted, inputs, record, received_ns, future)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - the caller awaits the future, not this task
            if isinstance(exc, InvalidInput):
                self.stats.count_failure("invalid")
            if not future.done():
                future.set_exception(without_tracebacks(exc))  # (its traceback holds this frame and `future`)

    @property
    def queue_depth(self) -> int:
        return self._batcher.queue_depth if self._batcher else 0

    @property
    def pending_requests(self) -> int:
        """Requests taken in and not yet answered: in admission off the event loop, queued,
        computing, or held for ordering."""
        batcher = self._batcher
        if batcher is None:
            return len(self._admissions)
        return len(self._admissions) + batcher.queue_depth + batcher.requests_running + batcher.requests_held

    @property
    def batches_in_flight(self) -> int:
        return self._batcher.batches_running if self._batcher else 0

    async def unload(self) -> None:
        """Stop taking requests, let those already taken in finish, then free the engines.
        Bounded by the watchdog: a stuck batch fails at execution_timeout_seconds."""
        self.state = ModelState.UNLOADING
        while self._admissions or self._chunked:  # requests being admitted, or in chunks, are answered
            await asyncio.wait([*self._admissions, *self._chunked])
        if self._batcher is not None:
            await self._batcher.drain()
        self._closed = True  # on the loop, so a replacement warming up now is closed, not kept
        instances, self.instances = self.instances, []
        await run_now(_close_all, instances)  # engines freed first: the final write below need not hold them
        if self._recording is not None and self.recorder is not None:
            self._recording.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._recording  # a write in progress ends first: the last one below wins
            await self.recorder.write()  # what it recorded since; never raises
        self.state = ModelState.UNAVAILABLE
        self.reason = "unloaded"

    def _close_instances(self) -> None:
        self._closed = True
        instances, self.instances = self.instances, []
        _close_all(instances)

    def metadata(self) -> dict[str, Any]:
        """The tensors of KServe v2 model metadata. Not the device: v2 metadata has fixed fields
        (name, versions, platform, inputs, outputs; gRPC's ModelMetadataResponse has no others,
        nor a parameters map), so a device field would be ours alone and lost to every client and
        front end that keeps to the protocol. Where the version runs (`placement`: devices, GPU
        model, driver, CUDA, engine library and providers) is in the model config's parameters
        map, which Triton's clients read as is, and in the ready log line."""
        return {
            "inputs": [self._tensor_metadata(t) for t in self.config.inputs],
            "outputs": [self._tensor_metadata(t) for t in self.config.outputs],
        }

    def _tensor_metadata(self, tensor: TensorConfig) -> dict[str, Any]:
        return {"name": tensor.name, "datatype": tensor.datatype, "shape": self.config.api_shape(tensor)}


def _gpu_identities(instances: list[ModelInstance]) -> tuple[dict[int, str], str]:
    """The model and compute capability of each GPU the instances run on, by CUDA index, and
    the driver and CUDA versions ("" without a GPU)."""
    indices = {i.device.index for i in instances if i.device.kind == "GPU"}
    if not indices:
        return {}, ""
    driver, cuda = driver_versions()
    return {index: identity(index) or "unknown GPU" for index in indices}, (
        f"driver {driver or 'unknown'}, CUDA {cuda or 'unknown'}")


def texts_by_length(config: ModelConfig, pipelines: list[ModelPipeline]) -> bool:
    """Whether texts join a batch nearest its oldest's length: not under preserve_ordering (the
    answers behind a reordered one wait), nor where every pipeline pads to the sequence bucket
    (a batch then costs the same in any order; none known yet: by length)."""
    batching = config.dynamic_batching
    if batching is not None and batching.preserve_ordering:
        return False
    return not (pipelines and all(p.pads_to_bucket for p in pipelines))


def _placement(instances: list[ModelInstance], gpus: dict[int, str], driver: str) -> str:
    """One line for clients (the model config's `placement` parameter): each distinct device
    with its GPU model and compute capability, the driver and CUDA, and the engine's library
    and providers, e.g. "cuda:0 NVIDIA H200 sm90 x2; driver 580.65, CUDA 13.0; onnxruntime-gpu
    1.31.1 [CUDAExecutionProvider, CPUExecutionProvider]"."""
    if not instances:
        return ""
    counts: dict[str, int] = {}
    for instance in instances:
        name = str(instance.device) + (f" {gpus[instance.device.index]}" if instance.device.kind == "GPU" else "")
        counts[name] = counts.get(name, 0) + 1
    where = ", ".join(name + (f" x{n}" if n > 1 else "") for name, n in counts.items())
    description = instances[0].pipeline.engine.describe()
    library = _engine_library(description.engine)
    providers = [p for p in description.providers if not p.startswith(library.split()[0])]  # torch names itself
    runs = library + (f" [{', '.join(providers)}]" if providers else "")
    return "; ".join(part for part in (where, driver, runs) if part)


def _engine_library(engine: str) -> str:
    """The installed distribution that runs `engine`, with its version."""
    entry = ENGINES.get(engine)
    for name, version in installed_versions(entry.distributions if entry else ()).items():
        if version:
            return f"{name} {version}"
    return engine


def _close_all(instances: list[ModelInstance]) -> None:
    for instance in instances:
        instance.close()
