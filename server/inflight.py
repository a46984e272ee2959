"""The server-wide bound on requests in flight and on the body bytes they hold.

Every front end takes from the same budget before it reads a request's body (HTTP v2, OpenAI's
/v1, gRPC), so memory under load is bounded by what the server took in, whichever protocol it
came by, and a client refused here costs the server almost nothing.

A request is let in when the bound has room for the whole body its head declares, and holds
from then on the first HELD_AHEAD bytes of it (all of a smaller one), then what has arrived;
one without a declared length holds its parts as they arrive, and one that inflates (a
Content-Encoding) the body limit more while it inflates. Counting a body whole from its head on
let sixteen clients that declared 64 MiB and sent a byte now and then (or reconnected every half
minute) hold the default 1 GiB, and every other call was refused meanwhile.
"""

from __future__ import annotations

from server.errors import ServerBusy

BUSY_MESSAGE = "the server is at its limit of requests in flight; retry after Retry-After seconds"


# What a body still to come holds ahead of its bytes: bodies up to this size (most calls) are
# never refused once let in; a client trickling a bigger one holds no more than this.
HELD_AHEAD = 64 << 10


def body_reservation(declared: int | None, limit: int) -> int:
    """The bytes a request's body needs room for from its head on: its declared length (one past
    the limit at most: the 413 comes as it is read), or nothing for a body that declares none."""
    return 0 if declared is None else min(declared, limit + 1)


class InFlight:
    """Requests between their arrival and their answer, and the body bytes they hold. A request
    alone is always let in, whatever its size (the body limit bounds it)."""

    def __init__(self, max_requests: int = 512, max_bytes: int = 1 << 30) -> None:
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.requests = 0
        self.bytes = 0

    def has_room(self, nbytes: int) -> bool:
        """Whether a request holding `nbytes` would be let in now."""
        return self.requests < self.max_requests and not (self.bytes and self.bytes + nbytes > self.max_bytes)

    def try_hold(self, nbytes: int, *, arriving: bool = False) -> Hold | None:
        """A request counted in, holding `nbytes`, when there is room; None (nothing counted)
        when there is none. `arriving`: `nbytes` is a body still to come, which needs the room
        but holds at most HELD_AHEAD of it until its bytes arrive (`Hold.hold_to`)."""
        if not self.has_room(nbytes):
            return None
        if arriving and nbytes > HELD_AHEAD:
            nbytes = HELD_AHEAD
        self.requests += 1
        self.bytes += nbytes
        return Hold(self, nbytes)

    def hold(self, nbytes: int, *, arriving: bool = False) -> Hold:
        """A request counted in, or refused (ServerBusy, answered 429 / RESOURCE_EXHAUSTED)."""
        held = self.try_hold(nbytes, arriving=arriving)
        if held is None:
            raise ServerBusy(BUSY_MESSAGE)
        return held


class Hold:
    """What one request holds of its InFlight, from its head to its answer."""

    __slots__ = ("_flight", "nbytes")

    def __init__(self, flight: InFlight, nbytes: int) -> None:
        self._flight: InFlight | None = flight
        self.nbytes = nbytes

    def hold_to(self, nbytes: int) -> None:
        """Hold `nbytes` in all from now on: less is always let go of; more is refused
        (ServerBusy) when the rest of the bound is held by others and has no room for it. A
        request holding every byte held alone always grows, as it was let in alone."""
        flight = self._flight
        if flight is None:
            raise RuntimeError("a released hold cannot grow")
        more = nbytes - self.nbytes
        if more > 0 and flight.bytes != self.nbytes and flight.bytes + more > flight.max_bytes:
            raise ServerBusy(BUSY_MESSAGE)
        flight.bytes += more
        self.nbytes = nbytes

    def release(self) -> None:
        """Count the request out: it was answered, or its client left. A second call does
        nothing (an answer gives its place back before it is written, its handler again at the
        end)."""
        flight = self._flight
        if flight is None:
            return
        self._flight = None
        flight.requests -= 1
        flight.bytes -= self.nbytes
        self.nbytes = 0
