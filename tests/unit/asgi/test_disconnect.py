"""Dropping a request whose client leaves: through the server's callback list when the scope
offers one (no task per request), through a task watching `receive` otherwise."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from server.asgi.disconnect import DISCONNECT_EXTENSION, disconnect_callbacks, unless_client_leaves
from server.errors import Unavailable

pytestmark = pytest.mark.asyncio


async def _never_receives() -> dict[str, Any]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def _waiting(scope: dict[str, Any]) -> asyncio.Future[Any]:
    """A call whose work has started and waits forever, with the server's callback list in `scope`."""
    started = asyncio.Event()

    async def work() -> str:
        started.set()
        await asyncio.Event().wait()
        return "never"

    call = asyncio.ensure_future(unless_client_leaves(_never_receives, work, scope))
    await started.wait()
    return call


async def test_the_servers_callback_drops_the_work_and_is_removed_after() -> None:
    scope: dict[str, Any] = {"extensions": {DISCONNECT_EXTENSION: []}}
    call = await _waiting(scope)
    (client_left,) = disconnect_callbacks(scope) or []
    client_left()  # what the protocol does on connection_lost
    assert await call is None
    assert disconnect_callbacks(scope) == []


async def test_a_callback_after_the_answer_changes_nothing() -> None:
    scope: dict[str, Any] = {"extensions": {DISCONNECT_EXTENSION: []}}
    seen: list[Any] = []

    async def work() -> str:
        seen.extend(disconnect_callbacks(scope) or [])
        return "answer"

    assert await unless_client_leaves(_never_receives, work, scope) == "answer"
    seen[0]()  # the client leaves once the answer is out: nothing to cancel
    await asyncio.sleep(0)


async def test_a_cancel_that_is_not_the_client_leaving_answers_unavailable() -> None:
    call = await _waiting({"extensions": {DISCONNECT_EXTENSION: []}})
    call.cancel()  # uvicorn's grace period ran out
    assert isinstance(await call, Unavailable)


async def test_without_the_extension_a_watcher_sees_the_disconnect() -> None:
    async def receive() -> dict[str, Any]:
        await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    async def work() -> str:
        await asyncio.sleep(5)
        return "late"

    assert await unless_client_leaves(receive, work, {}) is None
    assert await unless_client_leaves(receive, work) is None


async def test_a_failure_is_returned_not_raised() -> None:
    async def work() -> str:
        raise ValueError("bad")

    outcome = await unless_client_leaves(_never_receives, work, {"extensions": {DISCONNECT_EXTENSION: []}})
    assert isinstance(outcome, ValueError)
