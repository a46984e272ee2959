"""How a request run in parts fails: the first failure fails it, and a deadline that passes
after some of its own parts were computed says the request is too long for it."""

from __future__ import annotations

import asyncio

import pytest

from server.errors import DeadlineExceeded, EngineError, TooLongForDeadline
from server.scheduler.chunking import gathered
from server.scheduler.request import RequestRecord


def parts_that(fail_at: int, error: Exception) -> tuple[list[list[int]], object]:
    """A plan of three parts (2, 2 and 1 items) whose part `fail_at` raises `error` at once; the
    others take 10 ms, so that the parts after it are still running when it fails."""
    plan = [[0, 1], [2, 3], [4]]

    async def start(index: int, rows: list[int], record: RequestRecord) -> list[int]:
        if index == fail_at:
            raise error
        await asyncio.sleep(0.01)
        return rows

    return plan, start


async def test_a_deadline_after_some_parts_were_computed_is_too_long_for_it() -> None:
    plan, start = parts_that(1, DeadlineExceeded("the request's deadline passed while it was queued"))
    with pytest.raises(TooLongForDeadline) as caught:
        await gathered(plan, start, 1)  # type: ignore[arg-type]  # one at a time: part 0 first
    assert caught.value.message == (
        "the request's deadline passed after 1 of its 3 parts (2 of 5 items) were computed, so it is too long to"
        " finish within the model's timeout (the request's deadline passed while it was queued): send fewer items"
        " a request, or raise the model's default_timeout_microseconds")
    assert caught.value.__cause__ is None and caught.value.__context__ is None  # nothing held in a cycle


async def test_a_deadline_before_any_part_ran_and_other_failures_are_raised_as_they_are() -> None:
    first = DeadlineExceeded("late")
    plan, start = parts_that(0, first)
    with pytest.raises(DeadlineExceeded) as caught:
        await gathered(plan, start, 1)  # type: ignore[arg-type]
    assert caught.value is first  # a queue backed up by others: a retry may well pass
    broken = EngineError("boom")
    plan, start = parts_that(1, broken)
    with pytest.raises(EngineError) as failed:
        await gathered(plan, start, 1)  # type: ignore[arg-type]
    assert failed.value is broken
