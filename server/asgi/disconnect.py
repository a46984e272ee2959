"""Run a request's work unless its HTTP client leaves first: a client that disconnects while
its request waits has the request cancelled, and so dropped before compute.

Watching for the disconnect costs a task, so it starts only once the work has taken
WATCH_AFTER_S: a fast answer, the usual case at low load, never pays for it. Every HTTP route
that runs inference (v2's infer, OpenAI's embeddings) goes through here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

from server.errors import Unavailable

T = TypeVar("T")
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]

WATCH_AFTER_S = 0.002


async def unless_client_leaves(receive: Receive, work: Callable[[], Awaitable[T]]) -> T | BaseException | None:
    """`work`'s result, its failure (returned, not raised), or None when the client left first
    and the work was cancelled. Call it once the request's body has been read: the next message
    `receive` gives is then the disconnect."""
    handler = asyncio.current_task()
    assert handler is not None
    watcher: asyncio.Future[Message] | None = None
    answered = False

    def on_disconnect(_: asyncio.Future[Message]) -> None:
        # A disconnect seen in the same loop turn as the result runs this callback after the
        # handler moved on: cancelling then would hit it mid-answer, not mid-wait.
        if not answered:
            handler.cancel()

    def watch() -> None:
        nonlocal watcher
        watcher = asyncio.ensure_future(receive())  # completes when the client disconnects
        watcher.add_done_callback(on_disconnect)

    timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, watch)
    try:
        return await work()
    except asyncio.CancelledError:
        handler.uncancel()
        if watcher is None or not watcher.done():
            # Not the client leaving: uvicorn ran out of its grace period while stopping and
            # cancels what is still running. The client is still there: tell it, in the
            # protocol's shape (uvicorn would answer 500 and log a traceback).
            return Unavailable("the server stopped before this request was answered (its grace period "
                               "for requests in flight ran out); retry on another replica")
        return None
    except Exception as exc:  # noqa: BLE001 (returned: the route answers it in its protocol's shape)
        return exc
    finally:
        answered = True
        timer.cancel()
        if watcher is not None and not watcher.done():
            watcher.remove_done_callback(on_disconnect)
            watcher.cancel()
