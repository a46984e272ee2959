"""The dynamic batcher of one model version: the single owner of its queue.

It runs on the event loop only, so its state needs no locks. Requests wait in one FIFO per
priority level; a batch is formed from the oldest request of the highest level and every
compatible request behind it (same shape key, within the size cap, the token budget and the
padding bound), and the policy (`policy.py`) says whether it goes now. While every instance is
busy the queue fills, so the next batch is ready the moment one frees: batch k+1 forms while
batch k runs.

Admission is honest: a full queue refuses at once, a request whose deadline passes while
queued is answered with DeadlineExceeded and never runs, and so is one whose deadline would
pass before its batch could finish (the batch time is a running mean of this version's
batches): under overload, compute goes to requests that can still be answered in time. No
result comes after its deadline: a request whose batch finished late (slower than the mean) is
answered with DeadlineExceeded too. A cancelled request is dropped before compute. Each future
is resolved exactly once.

The batcher also owns which instances are in service. An instance whose batch ran past the
watchdog (ExecutionTimeout) is stuck in its engine: it is retired, never handed another batch,
and the model is asked for a fresh one (`replace`); when none is left and none is coming, the
queued requests are answered at once and the model is told (`on_exhausted`). An instance that
ran out of memory reports a lowered working cap, and its batches are formed within it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from server.errors import (
    BatchlineError,
    DeadlineExceeded,
    EngineError,
    ExecutionTimeout,
    QueueFull,
    Unavailable,
)
from server.scheduler.policy import BatchPolicy, DispatchReason, PaddedBatch
from server.scheduler.request import InferenceRequest, RequestState
from server.stats import ModelStatistics
from server.workers.result import BatchResult

logger = logging.getLogger(__name__)

# Texts are chosen by length among this many times the cap of the oldest compatible requests:
# nearly all the padding a whole queue would save (a simulation of minilm's traffic at 64
# clients and a cap of 8: 27% of a batch's tokens padding in arrival order, 6% within 4 caps, 4%
# over the whole queue), with a sort that does not grow with the queue.
LENGTH_WINDOW = 4


class BatchRunner(Protocol):
    """What the batcher needs of a model instance."""

    label: str

    async def run(self, feeds: list[dict[str, np.ndarray]]) -> BatchResult: ...


@dataclass(frozen=True)
class QueueSettings:
    levels: int = 1
    max_queue_size: int = 0  # 0: unbounded
    merge: bool = True  # False: every request runs alone (no dynamic batching configured)
    # texts join the oldest nearest its length: off where a batch costs the same in any order
    # (padded to its sequence bucket) and under preserve_ordering (answers wait for the oldest)
    by_length: bool = True
    preserve_ordering: bool = False


Replace = Callable[[BatchRunner], Awaitable[BatchRunner]]


class Batcher:
    def __init__(
        self,
        policy: BatchPolicy,
        settings: QueueSettings,
        instances: list[BatchRunner],
        stats: ModelStatistics,
        clock: Callable[[], int] = time.perf_counter_ns,
        *,
        replace: Replace | None = None,
        on_exhausted: Callable[[str], None] | None = None,
    ) -> None:
        """`replace(stuck)` makes a fresh instance for one taken out of service (or raises);
        `on_exhausted(reason)` is told once no instance is left and none is coming."""
        self._policy = policy
        self._settings = settings
        self._idle: list[BatchRunner] = list(instances)
        self._in_service = len(instances)
        self._replacing: set[asyncio.Task[None]] = set()
        self._replace = replace
        self._on_exhausted = on_exhausted
        self._caps: dict[BatchRunner, int] = {}  # instances whose working cap memory lowered
        self._capped: dict[int, BatchPolicy] = {}  # the policy at each lowered cap
        self._queues: list[deque[InferenceRequest]] = [deque() for _ in range(settings.levels)]
        self._queued = 0  # live requests waiting (dead ones are dropped lazily from the deques)
        self._running: dict[asyncio.Task[None], int] = {}  # each batch running: its requests
        self._wake: asyncio.TimerHandle | None = None
        self._stats = stats
        self._clock = clock
        self._next_sequence = 0
        self._next_release = 0
        self._held: dict[int, Callable[[], None] | None] = {}  # preserve_ordering buffer
        self._draining = False  # unloading: nothing waits for the delay window any more
        self._batch_ns = 0.0  # running mean of a batch's time, dispatch to result (0: none yet)
        self._batch_done_ns = 0  # when the last batch finished (the clock's time)
        stats.instances_in_service = len(instances)
        stats.instance_batch_caps = {i.label: policy.max_batch_size for i in instances}

    @property
    def queue_depth(self) -> int:
        """Requests waiting, not yet dispatched."""
        return self._queued

    @property
    def batches_running(self) -> int:
        return len(self._running)

    @property
    def requests_running(self) -> int:
        """Requests in the batches running (answered once their batch's task ends)."""
        return sum(self._running.values())

    @property
    def requests_held(self) -> int:
        """Requests computed and held back behind an earlier one (preserve_ordering)."""
        return sum(1 for complete in self._held.values() if complete is not None)

    @property
    def instances_in_service(self) -> int:
        """Instances that take batches (idle or running); stuck ones retired are not counted."""
        return self._in_service

    def submit(self, request: InferenceRequest) -> None:
        """Queue an admitted request, or refuse it at once when the queue is full."""
        if not self._in_service and not self._replacing:
            raise Unavailable("no instance of this model is in service")
        limit = self._settings.max_queue_size
        if limit and request.bounded and self._queued >= limit:
            self._stats.count_failure("queue_full")
            raise QueueFull(f"the queue of this model is full ({limit} requests waiting); retry later")
        if not 1 <= request.priority <= len(self._queues):
            raise ValueError(f"priority {request.priority} outside 1..{len(self._queues)}")
        request.sequence = self._next_sequence
        self._next_sequence += 1
        self._queues[request.priority - 1].append(request)
        self._queued += 1
        request.watch = lambda _: self._on_future_done(request)
        request.future.add_done_callback(request.watch)
        if request.deadline_ns is not None:
            delay_s = max(0.0, (request.deadline_ns - self._clock()) / 1e9)
            request.expiry = asyncio.get_running_loop().call_later(delay_s, self._expire, request)
        self._dispatch()

    def withdraw(self, future: asyncio.Future[dict[str, np.ndarray]]) -> bool:
        """Drop the queued request of this future, its client gone: True if it was queued. One
        already handed to an instance runs to its end (its inputs may be read until then). A
        search of the queue: only a client that gives up pays for it."""
        for queue in self._queues:
            for request in queue:
                if request.future is future and request.state is RequestState.QUEUED:
                    request.unwatch()
                    self._on_future_done(request)  # now, so no batch takes it before a callback would run
                    future.cancel()
                    return True
        return False

    def _expire(self, request: InferenceRequest) -> None:
        if request.state is RequestState.QUEUED:
            self._give_up(request, "the request's deadline passed while it was queued; it was not run")

    def _give_up(self, request: InferenceRequest, why: str) -> None:
        self._drop(request)
        self._stats.count_failure("deadline", self._clock() - request.received_ns)
        request.fail(DeadlineExceeded(why))
        self._release(request, None)

    def _too_late(self, request: InferenceRequest, now: int) -> bool:
        """Its deadline would pass before a batch dispatched now is done."""
        if request.deadline_ns is None:
            return False
        if request.deadline_ns <= now:  # already past it (its expiry timer has not fired yet)
            return True
        typical = self._batch_ns
        if now - self._batch_done_ns > typical:
            # No batch has finished for longer than one takes: the estimate may be an old outlier's,
            # and refusing on it could refuse every request from now on (none would run to measure
            # again). An idle model runs what it has; a busy one measures with every batch.
            return False
        return request.deadline_ns - now < typical

    def _give_up_late(self, request: InferenceRequest, now: int) -> None:
        if request.deadline_ns is not None and request.deadline_ns <= now:
            self._give_up(request, "the request's deadline passed before it could run; it was not run")
            return
        self._give_up(request, f"the request's deadline would pass before its batch could finish (a batch takes "
                               f"about {self._batch_ns / 1e6:.0f} ms here); it was not run")

    def _on_future_done(self, request: InferenceRequest) -> None:
        """A queued future that completes from outside was cancelled by its client."""
        request.watch = None  # run: the future holds it no more
        if request.state is RequestState.QUEUED:
            self._drop(request)
            self._stats.count_failure("cancelled", self._clock() - request.received_ns)
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
            chosen = self._roomiest_idle()
            policy = self._policy_for(self._idle[chosen])
            batch, blocked = self._form_batch(policy)
            if not batch:
                return
            items = sum(r.batch_size for r in batch)
            now = self._clock()
            oldest = min(r.arrival_ns for r in batch)
            decision = policy.decide(items, blocked, oldest, now, busy=bool(self._running) and not self._draining)
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
            task = asyncio.create_task(self._execute(self._idle.pop(chosen), batch, decision.reason, now))
            self._running[task] = len(batch)
            # a task cancelled before its first step runs none of its code, its `finally` neither
            task.add_done_callback(self._running_batch_ended)

    def _roomiest_idle(self) -> int:
        """The idle instance that takes the largest batch (the last one freed, on a tie)."""
        if not self._caps:
            return len(self._idle) - 1
        full = self._policy.max_batch_size
        return max(range(len(self._idle)), key=lambda i: (self._caps.get(self._idle[i], full), i))

    def _policy_for(self, instance: BatchRunner) -> BatchPolicy:
        """The policy within the instance's working cap: full and preferred mean what fits it."""
        cap = self._caps.get(instance)
        if cap is None or cap >= self._policy.max_batch_size:
            return self._policy
        if cap not in self._capped:
            preferred = tuple(p for p in self._policy.preferred if p <= cap)
            self._capped[cap] = dataclasses.replace(self._policy, max_batch_size=cap, preferred=preferred)
        return self._capped[cap]

    def _form_batch(self, policy: BatchPolicy) -> tuple[list[InferenceRequest], bool]:
        """The oldest live request of the highest level and the compatible ones behind it;
        `blocked` says a compatible request had to stay behind for lack of room. Texts join the
        oldest nearest its length first (of the LENGTH_WINDOW x cap oldest compatible, sorted by
        level, then by nearness in length; `by_length`): a batch pads to its longest text, and
        in arrival order a quarter of its tokens can be padding. The oldest always goes, so no
        request waits for more batches than there are requests ahead of it."""
        now = self._clock()
        for queue in self._queues:
            while queue and (queue[0].state is not RequestState.QUEUED or self._too_late(queue[0], now)):
                if queue[0].state is RequestState.QUEUED:
                    self._give_up_late(queue[0], now)
                queue.popleft()
        head = next((q[0] for q in self._queues if q), None)
        if head is None:
            return [], False
        batch, items, longest = [head], head.batch_size, head.longest
        if not self._settings.merge:
            return batch, False
        candidates: Iterable[tuple[int, InferenceRequest]] = self._compatible(head, now)
        if head.length and self._settings.by_length:
            window = itertools.islice(candidates, LENGTH_WINDOW * policy.max_batch_size)
            candidates = sorted(window, key=lambda found: (found[0], abs(found[1].length - head.length)))
        blocked = False
        padded = PaddedBatch.of(head.padded, head.batch_size) if head.padded else None
        for _, candidate in candidates:
            grown = max(longest, candidate.longest)
            if not policy.fits(items + candidate.batch_size, grown):
                blocked = True
                break
            if padded is not None:
                joined = padded.joined(candidate.padded, candidate.batch_size, policy)
                if joined is None:  # it would pad this batch past the bound: it heads another
                    blocked = True
                    break
                padded = joined
            batch.append(candidate)
            items += candidate.batch_size
            longest = grown
            if items >= policy.max_batch_size:
                break
        return batch, blocked

    def _compatible(self, head: InferenceRequest, now: int) -> Iterator[tuple[int, InferenceRequest]]:
        """The live queued requests that may share `head`'s batch with their level, highest level
        first, oldest first; lazily, so a batch that fills early reads no further. One found too
        late to finish in time is given up on the way."""
        for level, queue in enumerate(self._queues):
            for candidate in queue:
                if candidate is head or candidate.state is not RequestState.QUEUED:
                    continue
                if candidate.deadline_ns is not None and self._too_late(candidate, now):
                    self._give_up_late(candidate, now)
                    continue
                if candidate.shape_key == head.shape_key:
                    yield level, candidate

    async def _execute(
        self, instance: BatchRunner, batch: list[InferenceRequest], reason: DispatchReason, dispatched_ns: int
    ) -> None:
        self._stats.dispatch_reasons[reason] += 1
        for request in batch:
            self._stats.record_queued(dispatched_ns - request.arrival_ns)
            if request.record is not None:
                request.record.queue_ns = dispatched_ns - request.arrival_ns
        retired = False
        try:
            result = await instance.run([r.feed for r in batch])
        except BaseException as exc:  # the instance isolates a bad request: what comes here fails the batch
            self._stats.record_busy(instance.label, self._clock() - dispatched_ns)
            retired = isinstance(exc, ExecutionTimeout)  # its thread is still in the engine
            error = exc if isinstance(exc, BatchlineError) else EngineError(f"{type(exc).__name__}: {exc}")
            if retired:
                logger.error("%s", error.message)
            elif not isinstance(exc, BatchlineError):
                logger.exception("batch of %d requests failed on %s", len(batch), instance.label)
            done = self._clock()
            for request in batch:
                self._fail_request(request, error, done)
            if isinstance(exc, asyncio.CancelledError):
                raise
        else:
            self._batch_done_ns = self._clock()
            took = self._batch_done_ns - dispatched_ns
            self._stats.record_busy(instance.label, took)
            self._batch_ns = took if not self._batch_ns else 0.8 * self._batch_ns + 0.2 * took
            self._note_memory(instance, result)
            done = self._batch_done_ns
            late = {i for i, r in enumerate(batch) if r.deadline_ns is not None and done > r.deadline_ns}
            served = [r for i, r in enumerate(batch) if i not in result.failed and i not in late]
            if served:
                self._stats.record_batch(
                    sum(r.batch_size for r in served), len(served),
                    result.compute_input_ns, result.compute_infer_ns, result.compute_output_ns,
                )
            compute_ns = result.compute_input_ns + result.compute_infer_ns + result.compute_output_ns
            preserve_ordering = self._settings.preserve_ordering
            for index, (request, outputs) in enumerate(zip(batch, result.outputs)):
                if index in result.failed:
                    self._fail_request(request, result.failed[index], done)
                    continue
                if request.record is not None:
                    request.record.compute_ns = compute_ns
                if index in late:
                    self._answer_late(request, done)
                elif preserve_ordering:
                    self._release(request, functools.partial(self._answer_in_time, request, outputs, done))
                else:
                    self._answer_in_time(request, outputs, done)
        finally:
            self._running.pop(asyncio.current_task(), None)  # type: ignore[arg-type]  # no longer counts as busy
            if retired:
                self._retire(instance)
            else:
                self._idle.append(instance)
            self._dispatch()

    def _running_batch_ended(self, task: asyncio.Task[None]) -> None:
        self._running.pop(task, None)

    def _fail_request(self, request: InferenceRequest, error: BaseException, done_ns: int) -> None:
        self._stats.count_failure("engine_error", done_ns - request.received_ns)
        self._release(request, lambda: request.fail(error))

    def _answer_late(self, request: InferenceRequest, done_ns: int) -> None:
        """Its batch finished after its deadline: the client was promised an answer by then,
        so it gets the deadline error rather than a result it no longer waits for."""
        error = self._late(request, done_ns, "the request's batch finished")
        self._release(request, lambda: request.fail(error))

    def _answer_in_time(self, request: InferenceRequest, outputs: dict[str, np.ndarray], done_ns: int) -> None:
        """A result, released: still within its deadline, or held (preserve_ordering) past it."""
        if self._settings.preserve_ordering and request.deadline_ns is not None:
            done_ns = self._clock()
            if done_ns > request.deadline_ns:
                request.fail(self._late(request, done_ns, "the request's result, held behind an earlier one, was ready"))
                return
        self._stats.record_success(done_ns - request.received_ns)
        request.resolve(outputs)

    def _late(self, request: InferenceRequest, done_ns: int, what: str) -> DeadlineExceeded:
        """Count a request answered past its deadline; the error it gets."""
        self._stats.count_failure("deadline", done_ns - request.received_ns)
        late_ms = (done_ns - request.deadline_ns) / 1e6 if request.deadline_ns is not None else 0.0
        return DeadlineExceeded(f"{what} {late_ms:.0f} ms after its deadline; its result was dropped")

    def _note_memory(self, instance: BatchRunner, result: BatchResult) -> None:
        """Record a working cap lowered by running out of memory; later batches fit within it."""
        self._stats.memory_splits += result.memory_splits
        if result.batch_cap is not None and result.batch_cap < self._caps.get(instance, self._policy.max_batch_size):
            self._caps[instance] = result.batch_cap
            self._stats.instance_batch_caps[instance.label] = result.batch_cap

    def _retire(self, stuck: BatchRunner) -> None:
        """Take a stuck instance out of service for good and ask for a fresh one."""
        self._in_service -= 1
        self._caps.pop(stuck, None)
        self._stats.instances_abandoned += 1
        self._stats.instances_in_service = self._in_service
        self._stats.instance_batch_caps.pop(stuck.label, None)
        if self._replace is None or self._draining:
            self._check_exhausted(f"instance {stuck.label} is stuck in the engine and none replaces it")
            return
        task = asyncio.create_task(self._bring_replacement(stuck))
        self._replacing.add(task)
        task.add_done_callback(self._replacing.discard)

    async def _bring_replacement(self, stuck: BatchRunner) -> None:
        assert self._replace is not None
        try:
            fresh = await self._replace(stuck)
        except BatchlineError as exc:  # the fresh one did not load: serve on with those left
            self._not_replaced(stuck, exc.message)
            return
        except Exception as exc:
            logger.exception("replacing instance %s failed", stuck.label)
            self._not_replaced(stuck, f"{type(exc).__name__}: {exc}")
            return
        self._in_service += 1
        self._stats.instances_replaced += 1
        self._stats.instances_in_service = self._in_service
        self._stats.instance_batch_caps[fresh.label] = self._policy.max_batch_size
        self._idle.append(fresh)
        logger.warning("instance %s was replaced by a fresh one, warmed up", stuck.label)
        self._dispatch()

    def _not_replaced(self, stuck: BatchRunner, reason: str) -> None:
        logger.error("instance %s was not replaced: %s", stuck.label, reason)
        self._replacing.discard(asyncio.current_task())  # type: ignore[arg-type]
        self._check_exhausted(f"instance {stuck.label} is stuck in the engine and was not replaced: {reason}")

    def _check_exhausted(self, reason: str) -> None:
        """No instance left and none coming: answer the queue now instead of never."""
        if self._in_service or self._replacing:
            return
        self._fail_queued(Unavailable(f"no instance of this model is in service: {reason}"))
        if self._on_exhausted is not None:
            self._on_exhausted(reason)

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
        """Run everything already queued to completion (the caller stops new submissions).
        Bounded: a stuck batch ends at the instance's watchdog, and no replacement is awaited."""
        self._draining = True
        self._dispatch()
        while self._running or self._queued:
            if not self._running:  # nothing can run any more: no instance left
                self._fail_queued(Unavailable("the model was unloaded before this request ran"))
                break
            await asyncio.wait(list(self._running))  # not gather: a drain cancelled must not cancel its batches
            self._dispatch()

    def _fail_queued(self, error: BatchlineError) -> None:
        for queue in self._queues:
            while queue:
                request = queue.popleft()
                if request.state is RequestState.QUEUED:
                    self._drop(request)
                    request.fail(error)
                    self._release(request, None)
