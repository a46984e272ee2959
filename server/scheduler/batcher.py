"""The dynamic batcher of one model version: the single owner of its queue.

Runs on the event loop only, so its state needs no locks. A batch is dispatched the moment an
instance is idle: at low load a request runs at once (no batching tax), and while every
instance is busy the queue fills, so the next batch is already formed when one frees up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from server.config import ModelConfig
from server.errors import BatchlineError, EngineError
from server.scheduler.request import InferenceRequest
from server.stats import ModelStatistics
from server.workers.instance import ModelInstance

logger = logging.getLogger(__name__)


class Batcher:
    def __init__(
        self, config: ModelConfig, instances: list[ModelInstance], stats: ModelStatistics
    ) -> None:
        self._max_batch = max(config.max_batch_size, 1)
        self._batched = config.batched
        self._idle: list[ModelInstance] = list(instances)
        self._queue: deque[InferenceRequest] = deque()
        self._running: set[asyncio.Task[None]] = set()
        self._stats = stats

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def submit(self, request: InferenceRequest) -> None:
        """Queue a validated request; its future resolves with outputs or an error."""
        self._queue.append(request)
        self._dispatch()

    def _dispatch(self) -> None:
        while self._idle and self._queue:
            batch = self._take_batch()
            if not batch:
                return
            task = asyncio.create_task(self._execute(self._idle.pop(), batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    def _take_batch(self) -> list[InferenceRequest]:
        """The oldest live request and the compatible ones behind it, up to max_batch_size."""
        while self._queue and self._queue[0].future.done():  # cancelled while queued
            self._queue.popleft()
        if not self._queue:
            return []
        head = self._queue.popleft()
        batch, size = [head], head.batch_size
        if not self._batched:
            return batch
        key = head.shape_key()
        skipped: list[InferenceRequest] = []
        while self._queue and size < self._max_batch:
            candidate = self._queue.popleft()
            if candidate.future.done():
                continue
            if candidate.shape_key() != key or size + candidate.batch_size > self._max_batch:
                skipped.append(candidate)
                continue
            batch.append(candidate)
            size += candidate.batch_size
        self._queue.extendleft(reversed(skipped))
        return batch

    async def _execute(self, instance: ModelInstance, batch: list[InferenceRequest]) -> None:
        dispatched = time.perf_counter_ns()
        for request in batch:
            self._stats.queue.add(dispatched - request.arrival_ns)
        try:
            result = await instance.run([r.inputs for r in batch], self._batched)
        except BaseException as exc:  # one bad batch fails its own requests, nobody else's
            error = exc if isinstance(exc, BatchlineError) else EngineError(f"{type(exc).__name__}: {exc}")
            if not isinstance(exc, BatchlineError):
                logger.exception("batch of %d requests failed on %s", len(batch), instance.label)
            done = time.perf_counter_ns()
            for request in batch:
                self._stats.fail.add(done - request.arrival_ns)
                request.fail(error)
            if isinstance(exc, asyncio.CancelledError):
                raise
        else:
            times = result.times
            self._stats.record_batch(
                sum(r.batch_size for r in batch), len(batch),
                times.compute_input_ns, times.compute_infer_ns, times.compute_output_ns,
            )
            done = time.perf_counter_ns()
            for request, outputs in zip(batch, result.outputs):
                self._stats.success.add(done - request.arrival_ns)
                request.resolve(outputs)
        finally:
            self._idle.append(instance)
            self._dispatch()

    async def drain(self) -> None:
        """Run everything already queued to completion (the caller stops new submissions)."""
        self._dispatch()
        while self._running:
            await asyncio.gather(*list(self._running), return_exceptions=True)
