"""The one place where core errors and access refusals become gRPC status codes.

The codes are the ones Triton's gRPC clients act on: a full queue is RESOURCE_EXHAUSTED (retry
later), a server that stops or a model not ready is UNAVAILABLE (retry elsewhere), and INTERNAL
is kept for engine faults and bugs, so a client's retry policy can tell them apart.
"""

from __future__ import annotations

import logging

import grpc

from server.errors import (
    BatchlineError,
    Cancelled,
    ConfigError,
    ConfigMismatch,
    DeadlineExceeded,
    EngineError,
    ExecutionTimeout,
    InvalidInput,
    ModelNotFound,
    OutOfMemory,
    PayloadTooLarge,
    QueueFull,
    RequestTimeout,
    ServerBusy,
    TooLongForDeadline,
    Unavailable,
    Unsupported,
    most_specific,
)

logger = logging.getLogger(__name__)

CODE_BY_ERROR: dict[type[BatchlineError], grpc.StatusCode] = {
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    Unsupported: grpc.StatusCode.INVALID_ARGUMENT,  # as HTTP's 400: the request asks for what is not here
    ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    ConfigMismatch: grpc.StatusCode.INVALID_ARGUMENT,  # a load's config that misdescribes its model
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
    PayloadTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,  # what gRPC itself answers for a message too large
    RequestTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,  # HTTP's alone: grpc reads whole messages itself
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ServerBusy: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Cancelled: grpc.StatusCode.CANCELLED,
    EngineError: grpc.StatusCode.INTERNAL,
    OutOfMemory: grpc.StatusCode.INTERNAL,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    TooLongForDeadline: grpc.StatusCode.DEADLINE_EXCEEDED,
    ExecutionTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,  # as HTTP's 504: not UNAVAILABLE, which clients retry
}


class Refusal(Exception):
    """A call the gRPC front end refuses before it reaches the data plane: who may call what.
    Not a core error: the core knows nothing of tokens."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotAuthenticated(Refusal):
    """No bearer token in the call's metadata, or not the one this call takes."""


class ControlDisabled(Refusal):
    """Repository load/unload while model control is off."""


CODE_BY_REFUSAL: dict[type[Refusal], grpc.StatusCode] = {
    NotAuthenticated: grpc.StatusCode.UNAUTHENTICATED,
    ControlDisabled: grpc.StatusCode.PERMISSION_DENIED,
}


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client sees for any exception (INTERNAL for the unexpected,
    logged here with its traceback, its details never shown to the client)."""
    if isinstance(error, Refusal):
        return CODE_BY_REFUSAL[type(error)], error.message
    if isinstance(error, BatchlineError):
        return most_specific(CODE_BY_ERROR, error, grpc.StatusCode.INTERNAL), error.message
    logger.error("unexpected error", exc_info=error)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}"


def retry_after(error: BaseException) -> tuple[tuple[str, str], ...]:
    """Trailing metadata that tells a refused client when to retry (HTTP's Retry-After)."""
    if isinstance(error, QueueFull):
        return (("retry-after", error.retry_after),)
    return ()
