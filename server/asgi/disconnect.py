"""Run a request's work unless its HTTP client leaves first: a client that disconnects while
its request waits has the request cancelled, and so dropped before compute.

Two ways to learn that the client left. The server's own HTTP protocol offers a callback list in
the request's scope (`DISCONNECT_EXTENSION`) and calls it when the connection is lost: free for
a request whose client stays. Otherwise (any other ASGI server) a task waits on `receive` for the
disconnect; it costs a task, so it starts only once the work has taken WATCH_AFTER_S: a fast
answer never pays for it. Every HTTP route that runs inference (v2's infer, OpenAI's embeddings)
goes through here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from server.asgi.types import Message, Receive, Scope
from server.errors import Unavailable

T = TypeVar("T")

WATCH_AFTER_S = 0.002
DISCONNECT_EXTENSION = "batchline.disconnect"  # scope["extensions"][it]: called when the client leaves
# What a client still waiting is told when the server's graceful stop runs out of time for it.
CUT_OFF = ("the server stopped before this request was answered (its grace period for requests in flight ran out); "
           "retry on another replica")


def disconnect_callbacks(scope: Scope | None) -> list[Callable[[], None]] | None:
    """The callbacks the server calls when this request's client leaves, or None when the server
    offers none."""
    extensions = scope.get("extensions") if scope is not None else None
    return extensions.get(DISCONNECT_EXTENSION) if extensions else None


async def unless_client_leaves(
    receive: Receive, work: Callable[[], Awaitable[T]], scope: Scope | None = None,
) -> T | BaseException | None:
    """`work`'s result, its failure (returned, not raised), or None when the client left first
    and the work was cancelled. Call it once the request's body has been read: the next message
    `receive` gives is then the disconnect."""
    handler = asyncio.current_task()
    assert handler is not None
    watcher: asyncio.Future[Message] | None = None
    timer: asyncio.TimerHandle | None = None
    answered = False
    left = False

    def client_left() -> None:
        # A disconnect seen in the same loop turn as the result comes after the handler moved
        # on: cancelling then would hit it mid-answer, not mid-wait.
        nonlocal left
        if not answered:
            left = True
            handler.cancel()

    def watch() -> None:
        nonlocal watcher
        watcher = asyncio.ensure_future(receive())  # completes when the client disconnects
        watcher.add_done_callback(lambda _: client_left())

    callbacks = disconnect_callbacks(scope)
    if callbacks is not None:
        callbacks.append(client_left)
    else:
        timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, watch)
    try:
        return await work()
    except asyncio.CancelledError:
        handler.uncancel()
        if not left:
            # Not the client leaving: uvicorn ran out of its grace period while stopping and
            # cancels what is still running. The client is still there: tell it, in the
            # protocol's shape (uvicorn would answer 500 and log a traceback).
            return Unavailable(CUT_OFF)
        return None
    except Exception as exc:  # noqa: BLE001 (returned: the route answers it in its protocol's shape)
        return exc
    finally:
        answered = True
        if callbacks is not None:
            callbacks.remove(client_left)
        if timer is not None:
            timer.cancel()
        if watcher is not None and not watcher.done():
            watcher.cancel()
