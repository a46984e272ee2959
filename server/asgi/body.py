"""A request body's next part, within BODY_IDLE_TIMEOUT_S.

A client that stops sending its body part-way (a process frozen mid-upload: the connection
stays open) would hold what its request reserved of the bytes in flight for as long as the
connection lives: sixteen such uploads of a declared 64 MiB held the whole default budget, and
every other request was refused. A wait for a part is bounded, as nginx's client_body_timeout
bounds it (60 s there); a client that goes on sending, however slowly, is not cut off (a proxy
in front is where a minimum rate belongs). A part already received costs no timer: uvicorn's
request cycle says so, and most bodies arrive whole with their head.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from server.asgi.types import Message, Receive
from server.errors import RequestTimeout

T = TypeVar("T")

BODY_IDLE_TIMEOUT_S = 30.0
# what the OpenAPI documents say of the 408
CLIENT_LEFT = "the client disconnected while sending the body"  # Cancelled's words, whoever reads a body
STALLED = f"The body stopped coming part-way: no part of it for {BODY_IDLE_TIMEOUT_S:g} s (the connection is closed)"


async def next_part(receive: Receive) -> Message:
    """`receive()`, refused with RequestTimeout (408) when no part comes in time."""
    cycle = getattr(receive, "__self__", None)
    if isinstance(cycle, RequestResponseCycle) and cycle.message_event.is_set():
        return await receive()  # received already: nothing to wait for
    return await within_idle_timeout(receive())


async def within_idle_timeout(part: Awaitable[T]) -> T:
    try:
        async with asyncio.timeout(BODY_IDLE_TIMEOUT_S):
            return await part
    except TimeoutError:
        raise RequestTimeout(f"no part of the request body came for {BODY_IDLE_TIMEOUT_S:g} s; "
                             "the request was dropped") from None
