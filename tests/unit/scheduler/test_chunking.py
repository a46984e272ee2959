"""How a request run in parts fails: the first failure fails it, and a deadline that passes
where its computed parts say it needs more compute than the time it had says it is too long."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from server.errors import DeadlineExceeded, EngineError, TooLongForDeadline
from server.scheduler.chunking import gathered, too_long
from server.scheduler.request import RequestRecord

Start = Callable[[int, list[int], RequestRecord], Awaitable[list[int]]]
PLAN = [[0, 1], [2, 3], [4]]  # three parts: 2, 2 and 1 items


def parts_that(fail_at: int, error: Exception, compute_ns: int) -> Start:
    """Part `fail_at` raises `error` at once; each other part takes 10 ms and records
    `compute_ns` of compute, as the batcher records its batch's."""

    async def start(index: int, rows: list[int], record: RequestRecord) -> list[int]:
        if index == fail_at:
            raise error
        await asyncio.sleep(0.01)
        record.compute_ns = compute_ns
        return rows

    return start


async def test_a_deadline_where_the_parts_computed_need_more_than_the_time_it_had_is_too_long() -> None:
    """One part at a time: part 0 computes for its whole 10 ms; at that pace 5 items need 25 ms,
    more than the ~10 ms the request had before part 1's deadline passed."""
    start = parts_that(1, DeadlineExceeded("the request's deadline passed while it was queued"), 10_000_000)
    with pytest.raises(TooLongForDeadline) as caught:
        await gathered(PLAN, start, 1)
    assert caught.value.message.startswith(
        "the request's deadline passed after 1 of its 3 parts (2 of 5 items) were computed; at their pace the whole"
        " request needs about 0.0 s of compute, more than its timeout allows: send fewer items a request")
    assert caught.value.__cause__ is None and caught.value.__context__ is None  # nothing held in a cycle


async def test_a_deadline_spent_mostly_waiting_behind_others_stays_a_deadline() -> None:
    """Part 0 took 10 ms but computed for 1 us of it (the rest, another caller's batches): the
    request is not too long, and a retry may well pass."""
    first = DeadlineExceeded("late")
    with pytest.raises(DeadlineExceeded) as caught:
        await gathered(PLAN, parts_that(1, first, 1_000), 1)
    assert caught.value is first


async def test_a_deadline_before_any_part_was_computed_and_other_failures_are_raised_as_they_are() -> None:
    first = DeadlineExceeded("late")
    with pytest.raises(DeadlineExceeded) as caught:
        await gathered(PLAN, parts_that(0, first, 10_000_000), 1)  # parts 1 and 2 wait for the slot
    assert caught.value is first
    with pytest.raises(DeadlineExceeded) as caught:
        await gathered(PLAN, parts_that(1, first, 10_000_000), 3)  # parts 0 and 2 still running
    assert caught.value is first
    broken = EngineError("boom")
    with pytest.raises(EngineError) as failed:
        await gathered(PLAN, parts_that(1, broken, 10_000_000), 1)
    assert failed.value is broken


def test_the_pace_counts_every_instance() -> None:
    """Two instances (a window of 4) run the plan in half the time: 40 ms of compute for 5 items
    at 8 ms an item is 20 ms with two."""
    computed = [(2, 16_000_000)]  # 2 items in 16 ms
    assert too_long(PLAN, computed, 19_000_000, 4) is not None
    assert too_long(PLAN, computed, 21_000_000, 4) is None
    assert too_long(PLAN, computed, 39_000_000, 1) is not None
    assert too_long(PLAN, [], 1, 1) is None
