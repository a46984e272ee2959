"""Ending a call with its status: a call that grpc ended meanwhile (its deadline passed, its
client left) is dropped quietly, as a cancelled one is, where grpc logged the failed abort at
ERROR with a traceback (nine times in 60,000 calls with deadlines near their service time)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from grpc._cython import cygrpc  # type: ignore[attr-defined]

from server.grpc.servicer import MAX_STATUS_CHARS, _abort


class Context:
    """What `_abort` uses of grpc's servicer context: abort, which raises what grpc raises."""

    def __init__(self, raises: BaseException) -> None:
        self.raises = raises
        self.aborted: list[tuple[Any, ...]] = []

    async def abort(self, code: grpc.StatusCode, text: str, trailing_metadata: tuple[Any, ...] = ()) -> None:
        self.aborted.append((code, text, trailing_metadata))
        raise self.raises


def test_an_abort_that_grpc_sends_ends_the_call_with_its_status() -> None:
    context = Context(grpc.aio.AbortError())
    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(_abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", (("retry-after", "1"),)))  # type: ignore[arg-type]
    assert context.aborted == [(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", (("retry-after", "1"),))]


def test_a_call_that_ended_meanwhile_is_dropped_as_cancelled() -> None:
    context = Context(cygrpc.ExecuteBatchError('Failed "execute_batch"'))  # grpc's own, when a status cannot go
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(_abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, "too late"))  # type: ignore[arg-type]


@pytest.mark.parametrize("error", [cygrpc.UsageError("Abort was already called"), TypeError("bad metadata")])
def test_any_other_failure_of_an_abort_is_not_hidden(error: Exception) -> None:
    with pytest.raises(type(error)):
        asyncio.run(_abort(Context(error), grpc.StatusCode.INTERNAL, "x"))  # type: ignore[arg-type]


def test_a_long_text_is_cut_so_the_client_can_read_its_status() -> None:
    """A 4 MiB model name echoed in the status's text failed the client's read of the answer
    (its trailers past grpc's metadata limit)."""
    context = Context(grpc.aio.AbortError())
    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(_abort(context, grpc.StatusCode.NOT_FOUND, "x" * 100_000))  # type: ignore[arg-type]
    assert context.aborted[0][1] == "x" * MAX_STATUS_CHARS + "...(100000 characters)"
