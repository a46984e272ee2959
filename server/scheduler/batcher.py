"""The dynamic batcher of one model version: the single owner of its queue.

It runs on the event loop only, so its state needs no locks. Requests wait in one FIFO per
priority level; a batch is formed from the oldest request of the highest level and every
compatible request behind it (same shape key, within the size cap and token budget), and the
policy (`policy.py`) says whether it goes now. While every instance is busy the queue fills,
so the next batch is ready the moment one frees: batch k+1 forms while batch k runs.

Admission is honest: a full queue refuses at once, a request whose deadline passes while
queued is answered with DeadlineExceeded and never runs, and a cancelled one is dropped
before compute. Each future is resolved exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from server.errors import BatchlineError, DeadlineExceeded, EngineError, QueueFull, Unavailable
from server.scheduler.policy import BatchPolicy, DispatchReason
from server.scheduler.request import InferenceRequest, RequestState
from server.stats import ModelStatistics

logger = logging.getLogger(__name__)


@dataclass
class BatchResult:
    outputs: list[dict[str, np.ndarray]]  # one per request, in request order
    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0


class BatchRunner(Protocol):
    """What the batcher needs of a model instance."""

    label: str

    async def run(self, feeds: list[dict[str, np.ndarray]]) -> BatchResult: ...


@dataclass(frozen=True)
class QueueSettings:
    levels: int = 1
    max_queue_size: int = 0  # 0: unbounded
    merge: bool = True  # False: every request runs alone (no dynamic batching configured)
    preserve_ordering: bool = False


class Batcher:
    def __init__(
        self,
        policy: BatchPolicy,
        settings: QueueSettings,
        instances: list[BatchRunner],
        stats: ModelStatistics,
        clock: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        self._policy = policy
        self._settings = settings
        self._idle: list[BatchRunner] = list(instances)
        self._queues: list[deque[InferenceRequest]] = [deque() for _ in range(settings.levels)]
        self._queued = 0  # live requests waiting (dead ones are dropped lazily from the deques)
        self._running: set[asyncio.Task[None]] = set()
        self._wake: asyncio.TimerHandle | None = None
        self._stats = stats
        self._clock = clock
        self._next_sequence = 0
        self._next_release = 0
        self._held: dict[int, Callable[[], None] | None] = {}  # preserve_ordering buffer
        self._draining = False  # unloading: nothing waits for the delay window any more

    @property
    def queue_depth(self) -> int:
        """Requests waiting, not yet dispatched."""
        return self._queued

    @property
    def batches_running(self) -> int:
        return len(self._running)

    def submit(self, request: InferenceRequest) -> None:
        """Queue an admitted request, or refuse it at once when the queue is full."""
        limit = self._settings.max_queue_size
        if limit and self._queued >= limit:
            self._stats.count_failure("queue_full")
            raise QueueFull(f"the queue of this model is full ({limit} requests waiting); retry later")
        if not 1 <= request.priority <= len(self._queues):
            raise ValueError(f"priority {request.priority} outside 1..{len(self._queues)}")
        request.sequence = self._next_sequence
        self._next_sequence += 1
        self._queues[request.priority - 1].append(request)
        self._queued += 1
        request.future.add_done_callback(lambda _: self._on_future_done(request))
        if request.deadline_ns is not None:
            delay_s = max(0.0, (request.deadline_ns - self._clock()) / 1e9)
            request.expiry = asyncio.get_running_loop().call_later(delay_s, self._expire, request)
        self._dispatch()

    def _expire(self, request: InferenceRequest) -> None:
        if request.state is RequestState.QUEUED:
            self._drop(request)
            self._stats.count_failure("deadline")
            request.fail(DeadlineExceeded("the request's deadline passed while it was queued; it was not run"))
            self._release(request, None)

    def _on_future_done(self, request: InferenceRequest) -> None:
        """A queued future that completes from outside was cancelled by its client."""
        if request.state is RequestState.QUEUED:
            self._drop(request)
            self._stats.count_failure("cancelled")
            self._release(request, None)

    def _drop(self, request: InferenceRequest) -> None:
        self._queued -= 1
        request.state = RequestState.DONE
        if request.expiry is not None:
            request.expiry.cancel()

    def _dispatch(self) -> None:
        """Start every batch the policy allows while instances are idle."""
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        while self._idle and self._queued:
            batch, blocked = self._form_batch()
            if not batch:
                return
            items = sum(r.batch_size for r in batch)
            now = self._clock()
            oldest = min(r.arrival_ns for r in batch)
            decision = self._policy.decide(items, blocked, oldest, now, busy=bool(self._running) and not self._draining)
            if decision.reason is None:
                assert decision.wake_at_ns is not None
                delay_s = max(0.0, (decision.wake_at_ns - now) / 1e9)
                self._wake = asyncio.get_running_loop().call_later(delay_s, self._dispatch)
                return
            for request in batch:
                request.state = RequestState.RUNNING
                if request.expiry is not None:
                    request.expiry.cancel()
            self._queued -= len(batch)
            task = asyncio.create_task(self._execute(self._idle.pop(), batch, decision.reason, now))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    def _form_batch(self) -> tuple[list[InferenceRequest], bool]:
        """The oldest live request of the highest level and the compatible ones behind it;
        `blocked` says a compatible request had to stay behind for lack of room."""
        for queue in self._queues:
            while queue and queue[0].state is not RequestState.QUEUED:
                queue.popleft()
        head = next((q[0] for q in self._queues if q), None)
        if head is None:
            return [], False
        batch, items, longest = [head], head.batch_size, head.longest
        if not self._settings.merge:
            return batch, False
        blocked = False
        for queue in self._queues:
            for candidate in queue:
                if candidate is head or candidate.state is not RequestState.QUEUED:
                    continue
                if candidate.shape_key != head.shape_key:
                    continue
                grown = max(longest, candidate.longest)
                if not self._policy.fits(items + candidate.batch_size, grown):
                    blocked = True
                    break
                batch.append(candidate)
                items += candidate.batch_size
                longest = grown
                if items >= self._policy.max_batch_size:
                    break
            if blocked or items >= self._policy.max_batch_size:
                break
        return batch, blocked

    async def _execute(
        self, instance: BatchRunner, batch: list[InferenceRequest], reason: DispatchReason, dispatched_ns: int
    ) -> None:
        self._stats.dispatch_reasons[reason] += 1
        for request in batch:
            self._stats.record_queued(dispatched_ns - request.arrival_ns)
            if request.record is not None:
                request.record.queue_ns = dispatched_ns - request.arrival_ns
        try:
            result = await instance.run([r.feed for r in batch])
        except BaseException as exc:  # one bad batch fails its own requests, nobody else's
            self._stats.record_busy(instance.label, self._clock() - dispatched_ns)
            error = exc if isinstance(exc, BatchlineError) else EngineError(f"{type(exc).__name__}: {exc}")
            if not isinstance(exc, BatchlineError):
                logger.exception("batch of %d requests failed on %s", len(batch), instance.label)
            done = self._clock()
            for request in batch:
                self._stats.fail.add(done - request.received_ns)
                self._stats.count_failure("engine_error")
                self._release(request, lambda r=request: r.fail(error))
            if isinstance(exc, asyncio.CancelledError):
                raise
        else:
            self._stats.record_busy(instance.label, self._clock() - dispatched_ns)
            self._stats.record_batch(
                sum(r.batch_size for r in batch), len(batch),
                result.compute_input_ns, result.compute_infer_ns, result.compute_output_ns,
            )
            done = self._clock()
            compute_ns = result.compute_input_ns + result.compute_infer_ns + result.compute_output_ns
            for request, outputs in zip(batch, result.outputs):
                self._stats.record_success(done - request.received_ns)
                if request.record is not None:
                    request.record.compute_ns = compute_ns
                self._release(request, lambda r=request, o=outputs: r.resolve(o))
        finally:
            self._running.discard(asyncio.current_task())  # this batch no longer counts as busy
            self._idle.append(instance)
            self._dispatch()

    def _release(self, request: InferenceRequest, complete: Callable[[], None] | None) -> None:
        """Complete a request now, or (preserve_ordering) once every earlier one has."""
        if not self._settings.preserve_ordering:
            if complete is not None:
                complete()
            return
        self._held[request.sequence] = complete
        while self._next_release in self._held:
            ready = self._held.pop(self._next_release)
            self._next_release += 1
            if ready is not None:
                ready()

    async def drain(self) -> None:
        """Run everything already queued to completion (the caller stops new submissions)."""
        self._draining = True
        self._dispatch()
        while self._running or self._queued:
            if not self._running:  # nothing can run any more: no instance left
                self._fail_queued(Unavailable("the model was unloaded before this request ran"))
                break
            await asyncio.gather(*list(self._running), return_exceptions=True)
            self._dispatch()

    def _fail_queued(self, error: BatchlineError) -> None:
        for queue in self._queues:
            while queue:
                request = queue.popleft()
                if request.state is RequestState.QUEUED:
                    self._drop(request)
                    request.fail(error)
                    self._release(request, None)
