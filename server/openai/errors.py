"""The one place where errors become OpenAI's statuses and error body.

OpenAI's clients read the status (the official client raises BadRequestError for 400,
AuthenticationError for 401, NotFoundError for 404, RateLimitError for 429, and retries 429
and 5xx unless the answer says `x-should-retry: false`) and show `error.message`; `type`,
`param` and `code` are what OpenAI itself sends for the same failure.
"""

from __future__ import annotations

import logging

import orjson
from fastapi.responses import Response

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

INVALID = "invalid_request_error"
SERVER = "server_error"

# error type -> (status, OpenAI's type, OpenAI's code); a subclass takes its nearest ancestor's entry
KIND_BY_ERROR: dict[type[BatchlineError], tuple[int, str, str | None]] = {
    InvalidInput: (400, INVALID, None),
    Unsupported: (400, INVALID, None),
    ConfigError: (400, INVALID, None),
    ConfigMismatch: (400, INVALID, None),
    ModelNotFound: (404, INVALID, "model_not_found"),
    RequestTimeout: (408, INVALID, None),
    PayloadTooLarge: (413, INVALID, "request_too_large"),
    QueueFull: (429, "requests", "rate_limit_exceeded"),
    ServerBusy: (429, "requests", "rate_limit_exceeded"),
    Cancelled: (499, INVALID, None),  # the client left: logged, never sent
    EngineError: (500, SERVER, None),  # OutOfMemory too: one item too large for the device
    Unavailable: (503, SERVER, None),
    DeadlineExceeded: (504, SERVER, "timeout"),
    TooLongForDeadline: (504, SERVER, "timeout"),
    ExecutionTimeout: (504, SERVER, "timeout"),  # its batch ran past the watchdog (an EngineError)
}
_KIND_BY_STATUS = {401: (INVALID, "invalid_api_key"), 403: (INVALID, None), 415: (INVALID, None)}


class InvalidRequest(InvalidInput):
    """A request this front end refuses, naming the field at fault (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def kind_of(error: BatchlineError) -> tuple[int, str, str | None]:
    return most_specific(KIND_BY_ERROR, error, (500, SERVER, None))


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


def error_parts(error: BaseException) -> tuple[int, bytes, dict[str, str]]:
    """Status, OpenAI error body and extra headers for any exception (500 for the unexpected)."""
    if not isinstance(error, BatchlineError):
        logger.error("unexpected error", exc_info=error)
        return 500, error_body(f"internal error: {type(error).__name__}", SERVER), {}
    status, type_, code = kind_of(error)
    headers = {"Retry-After": error.retry_after} if isinstance(error, QueueFull) else {}
    if isinstance(error, RequestTimeout):  # the rest of its body may still come: not a request to read
        headers["Connection"] = "close"
    if isinstance(error, TooLongForDeadline):  # OpenAI's clients retry a 5xx unless told not to
        headers["x-should-retry"] = "false"
    return status, error_body(error.message, type_, getattr(error, "param", None), code), headers


def refusal_body(status: int, message: str) -> bytes:
    """The body of a refusal the HTTP gate makes before any route runs (401 without the token)."""
    type_, code = _KIND_BY_STATUS.get(status, (INVALID, None))
    return error_body(message, type_, None, code)


def error_response(error: BaseException, status: int | None = None) -> Response:
    """The answer to `error`; `status` overrides its mapped status (a route that is not there)."""
    mapped, body, headers = error_parts(error)
    return Response(body, status_code=status or mapped, media_type="application/json", headers=headers)
