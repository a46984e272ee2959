"""The server-wide bound on requests in flight and on the body bytes they hold.

Every front end takes from the same budget before it reads a request's body (HTTP v2, OpenAI's
/v1, gRPC), so memory under load is bounded by what the server took in, whichever protocol it
came by, and a client refused here costs the server almost nothing.
"""

from __future__ import annotations

from server.errors import ServerBusy

BUSY_MESSAGE = "the server is at its limit of requests in flight; retry after Retry-After seconds"


def body_reservation(declared: int | None, compressed: bool, limit: int) -> int:
    """The bytes a request's body holds while in flight, known before it is read: its declared
    length, else (undeclared, or compressed and so able to inflate) the body limit."""
    if declared is None or compressed:
        return limit
    return min(declared, limit + 1)


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

    def try_take(self, nbytes: int) -> bool:
        """Count a request in when there is room; False (nothing counted) when there is none."""
        if not self.has_room(nbytes):
            return False
        self.requests += 1
        self.bytes += nbytes
        return True

    def take(self, nbytes: int) -> None:
        """Count a request in, or refuse it (ServerBusy, answered 429 / RESOURCE_EXHAUSTED)."""
        if not self.try_take(nbytes):
            raise ServerBusy(BUSY_MESSAGE)

    def give_back(self, nbytes: int) -> None:
        """Count a request out: it was answered, or its client left."""
        self.requests -= 1
        self.bytes -= nbytes
