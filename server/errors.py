"""Typed errors of the core.

The core raises these and nothing else for expected failures; each front end maps each type
to its protocol's status in one table, read with `most_specific`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


class BatchlineError(Exception):
    """Base of every error a client may see; the message is shown to the client as is."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidInput(BatchlineError):
    """The request is malformed or does not match the model's declared inputs."""


class ModelNotFound(BatchlineError):
    """No model (or no such version of it) is in the repository."""


class Unavailable(BatchlineError):
    """The model exists but cannot serve now: not loaded, not ready, or shutting down."""


class QueueFull(BatchlineError):
    """Admission refused: the model's queue is at its bound."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @property
    def retry_after(self) -> str:
        """The Retry-After value: whole seconds, at least 1."""
        return str(max(1, round(self.retry_after_s)))


class ServerBusy(QueueFull):
    """The server is at its limit of requests in flight, or of the body bytes they hold: refused
    before the body is read, as a full queue is (429, RESOURCE_EXHAUSTED)."""


class DeadlineExceeded(BatchlineError):
    """The request's deadline passed before it could run."""


class TooLongForDeadline(DeadlineExceeded):
    """A request run in parts (a long list of texts) whose deadline passed where the parts it
    computed say the whole needs more compute than the time it had: it would fail the same way
    again, so a client should send less rather than retry (server/scheduler/chunking.py)."""


class Cancelled(BatchlineError):
    """The client went away; the request was dropped before compute."""


class EngineError(BatchlineError):
    """The engine failed while running a batch; only that batch's requests see it."""


class ConfigMismatch(EngineError):
    """The config describes tensors the model does not have: a load given it is refused as a
    bad config (400), not as a model that could not load (503)."""


class ConfigError(BatchlineError):
    """A model configuration is invalid; the message names file, field and reason."""


class PayloadTooLarge(BatchlineError):
    """The request body is larger than the server accepts."""


class RequestTimeout(BatchlineError):
    """The client stopped sending its request's body part-way: what the request reserved of the
    bytes in flight is freed rather than held for as long as the connection stays open."""


class Unsupported(BatchlineError):
    """The request asks for a feature this server does not implement."""


class ExecutionTimeout(EngineError):
    """A batch ran past the model's execution_timeout_seconds. Its requests fail with this; the
    instance stuck in the engine is taken out of service (a thread cannot be killed) and replaced."""


class OutOfMemory(EngineError):
    """The engine ran out of memory even for a batch of a single item."""


def most_specific(table: Mapping[type[BatchlineError], T], error: BatchlineError, default: T) -> T:
    """The entry of a front end's error table for the most specific class of `error`."""
    for cls in type(error).__mro__:
        if cls in table:
            return table[cls]  # type: ignore[index]
    return default


def without_tracebacks(error: BaseException) -> BaseException:
    """`error` with its tracebacks dropped, its causes' and contexts' too: for an error handed
    on to a waiting caller once the server logged what it needed of it. A traceback holds the
    frames that raised and caught the error, and a frame that holds the error back (or the
    future that holds it) makes a reference cycle, with whatever else those frames hold (a
    batch's inputs), alive until a rare full collection."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        link = pending.pop()
        if id(link) in seen:
            continue
        seen.add(id(link))
        link.__traceback__ = None
        pending.extend(e for e in (link.__cause__, link.__context__) if e is not None)
    return error
