"""A request of many texts cut into chunks within its model's token budget (max_batch_tokens),
and the chunks run as requests of their own.

A batch is cut to the budget only between requests: the batcher always runs the request at its
head whole. One v2 request of 64 texts of about 1 KB (8x minilm's budget) ran as one batch for
about 3.5 s on one core, and held every other caller's text behind it for that long. So such a
request runs as chunks, planned from its texts' tokens once it is tokenized (whole, once),
ordered by length first (as sentence-transformers does, so a chunk holds texts of like length
and little padding), each within the budget; OpenAI's /v1 lists are cut the same way, each
chunk within the model's batch cap too. Two chunks an instance go at a time: every instance
runs one while the next waits formed behind it, and other callers' requests queue between them.
(Chunks were once planned from the texts' bytes, a token a byte: ordinary text has a token per
four or five bytes, so a request of 64 sentences of ~130 bytes went as 8 chunks where one fit.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from server.errors import DeadlineExceeded, TooLongForDeadline
from server.scheduler.request import RequestRecord

T = TypeVar("T")


def chunks(sizes: list[int], size: int, max_tokens: int | None = None) -> list[list[int]]:
    """Indexes of the texts, ordered by `sizes` (their tokens, as the batcher counts them;
    stable), cut into runs of at most `size` texts and, with `max_tokens`, of at most that many
    tokens padded to the run's longest (a run of one text goes whatever its tokens)."""
    order = sorted(range(len(sizes)), key=sizes.__getitem__)
    if max_tokens is None:
        return [order[start:start + size] for start in range(0, len(order), size)]
    plan: list[list[int]] = []
    run: list[int] = []
    for index in order:  # each text is the run's longest yet: the order is by length
        if run and (len(run) >= size or (len(run) + 1) * sizes[index] > max_tokens):
            plan.append(run)
            run = []
        run.append(index)
    if run:
        plan.append(run)
    return plan


def in_flight(instances: int) -> int:
    """Chunks of one request in its model's queue at once: two an instance."""
    return 2 * max(1, instances)


async def gathered(
    plan: list[list[int]], start: Callable[[int, list[int], RequestRecord], Awaitable[T]], window: int,
    record: RequestRecord | None = None,
) -> list[T]:
    """Each chunk's answer, in the plan's order, `start(index, rows, record)` begun for at most
    `window` chunks at a time; `record` gets the tokens of all and the longest queue and compute
    times. The first failure is raised, and the chunks still waiting are cancelled (dropped
    before compute); a deadline that passes where the chunks computed say the whole request
    needs more compute than the time it had is raised as TooLongForDeadline (`too_long`)."""
    began = time.monotonic_ns()
    slots = asyncio.Semaphore(window)
    records = [RequestRecord() for _ in plan]

    async def run(index: int, rows: list[int]) -> T:
        async with slots:
            return await start(index, rows, records[index])

    tasks = [asyncio.ensure_future(run(index, rows)) for index, rows in enumerate(plan)]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        _cancel(tasks)  # (no loop variable here: it would hold the failed task, and so its error)
    failures = [task.exception() for task in tasks if task.done() and not task.cancelled()]  # each read
    failure = next((f for f in failures if f is not None), None)
    if failure is not None:
        computed = [index for index, task in enumerate(tasks)
                    if task.done() and not task.cancelled() and task.exception() is None]
        # Raised from here, the error's traceback holds this frame: nothing in it may hold the
        # error back (the tasks do), or the request's inputs, megabytes of them, live in a
        # reference cycle until a rare full collection.
        del tasks, failures
        if type(failure) is DeadlineExceeded:
            failure = too_long(plan, [(len(plan[i]), records[i].compute_ns) for i in computed],
                               time.monotonic_ns() - began, window) or failure
        try:
            raise failure
        finally:
            del failure
    if record is not None:
        record.tokens = sum(r.tokens for r in records)
        record.queue_ns = max(r.queue_ns for r in records)
        record.compute_ns = max(r.compute_ns for r in records)
    return [task.result() for task in tasks]


def too_long(plan: list[list[int]], computed: list[tuple[int, int]], waited_ns: int,
             window: int) -> TooLongForDeadline | None:
    """The error for a request whose deadline passed when it is too long for the time it had:
    at the pace of its parts computed ((items, compute ns) each), its whole plan needs at least
    the time it waited, with its parts on every instance at once (`window`, two an instance).
    Then a retry would fail the same way, where one whose time went to other callers' queue may
    pass; None for that, or when no part was computed."""
    items = sum(n for n, _ in computed)
    if not items:
        return None
    total = sum(map(len, plan))
    needed_ns = sum(ns for _, ns in computed) / items * total / max(1, window // 2)
    if needed_ns < waited_ns:
        return None
    return TooLongForDeadline(
        f"the request's deadline passed after {len(computed)} of its {len(plan)} parts ({items} of {total} items)"
        f" were computed; at their pace the whole request needs about {needed_ns / 1e9:.1f} s of compute, more than"
        " its timeout allows: send fewer items a request, or give it a longer timeout (its own, or the model's"
        " default_timeout_microseconds)")


def _cancel(tasks: Iterable[asyncio.Future[Any]]) -> None:
    for task in tasks:
        task.cancel()  # nothing for those done
