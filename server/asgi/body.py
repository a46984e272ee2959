"""A request body read as it arrives: each part within BODY_IDLE_TIMEOUT_S, the whole within
the body limit and the bytes in flight its request may hold.

A client that stops sending its body part-way (a process frozen mid-upload: the connection
stays open) would hold its place in flight for as long as the connection lives. A wait for a
part is bounded, as nginx's client_body_timeout bounds it (60 s there); a client that goes on
sending, however slowly, is not cut off (a proxy in front is where a minimum rate belongs), and
holds of the bytes in flight only what it sent, or HELD_AHEAD (server/inflight.py). A part
already received costs no timer: uvicorn's request cycle says so, and most bodies arrive whole
with their head.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from server.asgi.types import Message, Receive
from server.errors import Cancelled, PayloadTooLarge, RequestTimeout
from server.inflight import Hold

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


async def read_body(receive: Receive, limit: int, declared: int | None, hold: Hold | None = None) -> bytes:
    """The whole body: refused (413) past `limit`, at once when its `declared` length is over it.
    Its bytes past what `hold` holds already (a body whose head declared no length, or more than
    is held ahead of it) are counted into it as they arrive, refused (429) when the server's
    bound has no room for them."""
    if declared is not None and declared > limit:
        raise PayloadTooLarge(f"the request body exceeds the limit of {limit} bytes")
    chunk, more = await _next_chunk(receive)
    if not more and (hold is None or len(chunk) <= hold.nbytes) and len(chunk) <= limit:
        return chunk  # most bodies: whole in one part, within what their head declared
    chunks: list[bytes] = []
    size = 0
    while True:
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the request body exceeds the limit of {limit} bytes")
        if hold is not None and size > hold.nbytes:
            hold.hold_to(size)
        chunks.append(chunk)
        if not more:
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunk, more = await _next_chunk(receive)


async def body_parts(receive: Receive) -> AsyncIterator[bytes]:
    """The body's parts as they arrive, for a reader that passes them on."""
    more = True
    while more:
        chunk, more = await _next_chunk(receive)
        if chunk:
            yield chunk


async def _next_chunk(receive: Receive) -> tuple[bytes, bool]:
    """The body's next part and whether more follow; Cancelled when the client left part-way."""
    message = await next_part(receive)
    if message["type"] == "http.disconnect":
        raise Cancelled(CLIENT_LEFT)
    return message.get("body", b""), message.get("more_body", False)
