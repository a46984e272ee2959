"""A model instance: one pipeline (engine + batch assembly) and the one thread that runs it.

Batches are merged, run and split on that thread, so the event loop only hands requests over
and resolves futures; engines release the GIL while computing, so instances run in parallel.
Warm-up and the batch-cap profile run on that thread too (`run_on_thread`), before the first
batch: what an engine keeps per thread (torch's CUDA graphs) is made where batches will use it.

Faults stay within the batch that met them:
- Watchdog: a batch still running after `timeout_s` is answered with ExecutionTimeout and the
  instance is abandoned. A Python thread cannot be killed, so it is never handed another batch
  (the batcher retires it and the model replaces it). The thread is a daemon, so a stuck one
  never holds the process at exit; should it ever come back, it closes its engine and ends.
- Out of memory: the batch is cut in halves and each half retried, down to single items; a
  single item that still does not fit fails alone, with OutOfMemory, and the others are
  answered. The instance then lowers its working batch cap below the smallest size that ran out
  of memory, so later batches are formed within it; sizes that failed only because they held
  such an item do not count (one huge request must not shrink every later batch).
- Any other engine error on a batch of several requests: halves of its requests run again, and
  halves of a half that fails, so one request whose values the engine cannot take (text that
  does not parse, an id out of range) fails alone, with the engine's words, and the others are
  answered: about log2(N) more runs. Several such requests each fail alone.
  Once log2(N) + 3 (rounded down) requests are found at fault with no run between them that
  succeeded, what is left runs once as one: a burst of bad requests at the head of a batch
  leaves the rest answered. If that fails too, the engine seems to fail everything: the rest
  fails with Unavailable (retry), never with another request's error, which may quote that
  request's values. An engine that fails everything costs a batch about twice that many runs,
  not two a request; a run that succeeds starts the count again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import numpy as np

from server.devices import Device
from server.errors import BatchlineError, EngineError, ExecutionTimeout, OutOfMemory, Unavailable
from server.workers.faults import is_out_of_memory
from server.workers.pipeline import ModelPipeline
from server.workers.result import BatchResult

logger = logging.getLogger(__name__)

Feed = dict[str, np.ndarray]
T = TypeVar("T")


@dataclass
class _Job:
    """A call for the instance's thread and where its outcome goes: a future of the event loop
    (`loop`: a batch), or a thread-safe one that a caller off the loop blocks on (no loop)."""

    call: Callable[[], Any]
    future: asyncio.Future[Any] | concurrent.futures.Future[Any]
    loop: asyncio.AbstractEventLoop | None = None


@dataclass
class _Piece:
    """Rows of one request of the batch: all of them, or a part once the request was cut."""

    request: int
    feed: Feed
    rows: int


class ModelInstance:
    def __init__(self, pipeline: ModelPipeline, device: Device, label: str, *, timeout_s: float = 0) -> None:
        self.pipeline = pipeline
        self.device = device
        self.label = label
        self.timeout_s = timeout_s  # the watchdog of one engine run; 0: none
        self.batch_cap: int | None = None  # lowered when memory ran out; None: what the batcher forms
        self.abandoned = False
        self._stuck: asyncio.Future[BatchResult] | None = None  # the run the watchdog gave up on
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()  # None: close and end
        self._thread = threading.Thread(target=self._serve, name=label, daemon=True)
        self._thread.start()

    @property
    def stuck(self) -> bool:
        """Abandoned, and its thread is still inside the engine."""
        return self.abandoned and self._thread.is_alive()

    def on_return(self, callback: Callable[[], None]) -> None:
        """Call `callback` on the event loop once the run it was abandoned in comes back."""
        if self._stuck is None or self._stuck.done():
            callback()
        else:
            self._stuck.add_done_callback(lambda _: callback())

    async def run(self, feeds: list[Feed]) -> BatchResult:
        """Run one batch (the module docstring says how faults are met)."""
        if self.abandoned:
            raise Unavailable(f"instance {self.label} is out of service")
        if not self.pipeline.batched:  # nothing to cut: the request is the batch
            try:
                return await self._call(feeds)
            except ExecutionTimeout:
                raise
            except Exception as exc:
                if is_out_of_memory(exc):
                    raise OutOfMemory(f"instance {self.label} ran out of memory: {_reason(exc)}") from exc
                raise
        return await self._run_in_parts([_Piece(i, f, _rows(f)) for i, f in enumerate(feeds)])

    async def _run_in_parts(self, pieces: list[_Piece]) -> BatchResult:
        work = deque(_packed(pieces, self.batch_cap))
        whole = len(work) == 1  # the batch as dispatched: a failure of it that no search splits is raised as is
        parts: dict[int, list[Feed]] = defaultdict(list)
        failed: dict[int, BatchlineError] = {}
        ran_out: list[tuple[int, set[int]]] = []  # (rows, requests) of each group that ran out of memory
        total = BatchResult([])
        # requests found at fault since a run last succeeded: at `at_fault_bound` of them, what is
        # left runs once as one (`last_chance`); if that fails too, the engine seems to fail
        # everything, and the search ends
        at_fault_bound = len(pieces).bit_length() + 2
        at_fault = 0
        last_chance = False
        warned = False
        while work:
            group = [p for p in work.popleft() if p.request not in failed]
            if not group:
                continue
            try:
                result = await self._call([p.feed for p in group])
            except ExecutionTimeout:
                raise
            except Exception as exc:
                rows = sum(p.rows for p in group)
                if not is_out_of_memory(exc):
                    if whole and len(group) == 1:  # one request dispatched alone: its error as is
                        raise
                    if last_chance and len(group) > 1:
                        self._fail_unrun(failed, [group, *work], at_fault)
                        work.clear()
                        continue
                    if len(group) > 1:  # whose values failed it? its halves run again to say
                        if not warned:
                            warned = True
                            logger.warning("%d requests of a batch failed on %s (%s); halves of them run again to "
                                           "find the request at fault", len(group), self.label, _reason(exc))
                        middle = len(group) // 2  # by requests, not rows: one request is found in log2(N) steps
                        work.extendleft([group[middle:], group[:middle]])
                        whole = False
                        continue
                    logger.error("a request of a batch (%d items) failed on %s", rows, self.label, exc_info=exc)
                    failed[group[0].request] = (
                        exc if isinstance(exc, BatchlineError) else EngineError(f"{type(exc).__name__}: {exc}")
                    )
                    at_fault += 1
                    if at_fault >= at_fault_bound and not last_chance:  # not one request's values, it seems
                        rest = [p for pending in work for p in pending if p.request not in failed]
                        work.clear()
                        if rest:  # unless all of the rest works: a burst of bad requests at the head
                            work.append(rest)
                            last_chance = True
                elif rows == 1:
                    failed[group[0].request] = OutOfMemory(
                        f"instance {self.label} ran out of memory on a single item: {_reason(exc)}"
                    )
                    logger.warning("%s", failed[group[0].request].message)
                else:
                    ran_out.append((rows, {p.request for p in group}))
                    total.memory_splits += 1
                    work.extendleft(reversed(_halves(group)))
                whole = False
                continue
            whole = False
            at_fault = 0
            last_chance = False
            total.compute_input_ns += result.compute_input_ns
            total.compute_infer_ns += result.compute_infer_ns
            total.compute_output_ns += result.compute_output_ns
            for piece, outputs in zip(group, result.outputs):
                parts[piece.request].append(outputs)
        too_big = {i for i, error in failed.items() if isinstance(error, OutOfMemory)}
        sizes = [rows for rows, requests in ran_out if not requests & too_big]
        if sizes:
            self._lower_cap(min(sizes))
        total.outputs = [{} if i in failed else _joined(parts[i]) for i in range(len(pieces))]
        total.failed = failed
        total.batch_cap = self.batch_cap
        return total

    def _fail_unrun(self, failed: dict[int, BatchlineError], groups: list[list[_Piece]], at_fault: int) -> None:
        """Fail the requests of `groups` not failed yet with Unavailable (retry): never with
        another request's error, which may quote that request's values."""
        unrun = {p.request for group in groups for p in group} - failed.keys()
        logger.error("%d more requests of the batch fail unrun on %s: %d requests in a row failed alone, then the "
                     "rest together", len(unrun), self.label, at_fault)
        error = Unavailable(f"not run alone: the engine of {self.label} failed {at_fault} requests of its batch in "
                            "a row, then the rest of it together; retry")
        failed.update((request, error) for request in unrun)

    def _lower_cap(self, rows: int) -> None:
        cap = (rows + 1) // 2  # the larger half of the smallest batch that did not fit
        if self.batch_cap is None or cap < self.batch_cap:
            self.batch_cap = cap
            logger.warning(
                "instance %s ran out of memory on a batch of %d items and ran it in smaller parts; "
                "its working batch cap is now %d", self.label, rows, cap,
            )

    async def _call(self, feeds: list[Feed]) -> BatchResult:
        """One engine run on the instance's thread, under the watchdog."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[BatchResult] = loop.create_future()
        future.add_done_callback(_retrieve)
        self._jobs.put(_Job(partial(self.pipeline.run_batch, feeds), future, loop))
        del feeds  # (held by the job until it runs)
        if self.timeout_s:
            done, _ = await asyncio.wait({future}, timeout=self.timeout_s)
            if not done:
                self._abandon(future)
                raise ExecutionTimeout(
                    f"instance {self.label} did not finish a batch within execution_timeout_seconds "
                    f"({self.timeout_s:g} s); the instance was taken out of service"
                )
            del done
        try:
            return await future
        except BaseException:
            del future  # it holds the error, whose traceback holds this frame: no cycle
            raise

    def run_on_thread(self, call: Callable[[ModelPipeline], T]) -> T:
        """`call(pipeline)` on the instance's thread, waited for: warm-up and the batch-cap
        profile, before the instance serves. Blocks, so never from the event loop; no watchdog
        (a first run may compile for minutes). The call's error is raised here."""
        if self.abandoned:
            raise Unavailable(f"instance {self.label} is out of service")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put(_Job(partial(call, self.pipeline), future))
        return future.result()

    def _abandon(self, run: asyncio.Future[BatchResult]) -> None:
        self.abandoned = True
        self._stuck = run
        self._jobs.put(None)  # if the run ever returns, the thread closes the engine and ends

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                break
            _run(job)
            # Nothing of a batch stays held while the thread waits for the next: its inputs may
            # be large, or views of a front end's shared memory (server/link.py) that would keep
            # it mapped after that front end is gone.
            del job
        try:
            self.pipeline.engine.close()
        except Exception:
            logger.exception("closing the engine of %s failed", self.label)

    def close(self) -> None:
        """Free the engine once the thread is idle. An abandoned instance is not waited for: its
        thread closes the engine itself if its run ever comes back."""
        if self.abandoned:
            return
        self._jobs.put(None)
        self._thread.join()


def _run(job: _Job) -> None:
    """Run one job and hand its outcome to whoever waits for it. An error's traceback holds
    this frame: its locals (the error, the job and its future, which holds the error too) are
    let go before it ends, or the error, the frames and the batch's inputs would live in a
    reference cycle until a rare full collection."""
    result: Any = None
    error: BaseException | None = None
    try:
        result = job.call()
    except BaseException as exc:  # noqa: BLE001 (every outcome goes back to the waiting caller)
        error = exc if isinstance(exc, Exception) else EngineError(f"{type(exc).__name__}: {exc}")
    future, loop = job.future, job.loop
    del job
    if loop is None:  # a caller off the loop waits on a thread-safe future
        _settle(future, result, error)
    else:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for this run any more
            loop.call_soon_threadsafe(_settle, future, result, error)
    del future, result, error


def _settle(
    future: asyncio.Future[Any] | concurrent.futures.Future[Any], result: Any, error: BaseException | None
) -> None:
    if future.done():  # the waiter was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _retrieve(future: asyncio.Future[BatchResult]) -> None:
    """Mark an error as seen, so a run nobody awaits any more logs no 'never retrieved'."""
    if not future.cancelled():
        future.exception()


def _reason(error: BaseException) -> str:
    return error.message if isinstance(error, BatchlineError) else f"{type(error).__name__}: {error}"


def _rows(feed: Feed) -> int:
    return len(next(iter(feed.values())))


def _rows_of(piece: _Piece, start: int, stop: int) -> _Piece:
    return _Piece(piece.request, {name: array[start:stop] for name, array in piece.feed.items()}, stop - start)


def _packed(pieces: list[_Piece], cap: int | None) -> list[list[_Piece]]:
    """The batch as groups of at most `cap` rows, in order; a request larger than the cap is cut."""
    if cap is None or sum(p.rows for p in pieces) <= cap:
        return [pieces]
    groups: list[list[_Piece]] = []
    current: list[_Piece] = []
    rows = 0
    for piece in pieces:
        cuts = [piece] if piece.rows <= cap else [
            _rows_of(piece, start, min(start + cap, piece.rows)) for start in range(0, piece.rows, cap)
        ]
        for cut in cuts:
            if current and rows + cut.rows > cap:
                groups.append(current)
                current, rows = [], 0
            current.append(cut)
            rows += cut.rows
    groups.append(current)
    return groups


def _halves(group: list[_Piece]) -> list[list[_Piece]]:
    """Two groups of about half the rows each; a lone request is cut between its rows."""
    if len(group) == 1:
        piece = group[0]
        cut = (piece.rows + 1) // 2
        return [[_rows_of(piece, 0, cut)], [_rows_of(piece, cut, piece.rows)]]
    total = sum(p.rows for p in group)
    running, split = 0, 1
    for split, piece in enumerate(group[:-1], start=1):
        running += piece.rows
        if running * 2 >= total:
            break
    return [group[:split], group[split:]]


def _joined(parts: list[Feed]) -> Feed:
    """A request's outputs, put back together from the parts it was run in."""
    if len(parts) == 1:
        return parts[0]
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
