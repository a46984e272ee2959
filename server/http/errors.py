"""The one place where core errors become HTTP statuses and the KServe error body."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from server.asgi.body import CLIENT_LEFT
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
from server.protocol.v2 import encode_error

logger = logging.getLogger(__name__)

STATUS_BY_ERROR: dict[type[BatchlineError], int] = {
    InvalidInput: 400,
    Unsupported: 400,
    ConfigError: 400,
    ConfigMismatch: 400,  # a load's config that misdescribes its model
    ModelNotFound: 404,
    RequestTimeout: 408,
    PayloadTooLarge: 413,
    QueueFull: 429,
    ServerBusy: 429,
    Cancelled: 499,  # the client closed the request (nginx's convention)
    EngineError: 500,
    OutOfMemory: 500,  # a single item too large for the device, after its batch was split
    Unavailable: 503,
    DeadlineExceeded: 504,
    TooLongForDeadline: 504,
    ExecutionTimeout: 504,  # not 503: clients retry that, and an input that hangs the engine would take the next instance
}


class Refusal(Exception):
    """A request the HTTP front end refuses before any route runs: who may call what, and how.
    Not a core error: the core knows nothing of tokens or media types."""

    def __init__(self, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class NotAuthenticated(Refusal):
    """No bearer token, or not the one this route takes."""


class ControlDisabled(Refusal):
    """Repository load/unload while model control is off, or from a page that is not local."""


class UnsupportedMediaType(Refusal):
    """A state-changing call that is not JSON: what a cross-site form would send."""


STATUS_BY_REFUSAL: dict[type[Refusal], int] = {
    NotAuthenticated: 401,
    ControlDisabled: 403,  # Triton answers 503, which clients and balancers retry: this will not change
    UnsupportedMediaType: 415,
}


def status_of(error: BatchlineError) -> int:
    return most_specific(STATUS_BY_ERROR, error, 500)


def error_parts(error: BaseException) -> tuple[int, bytes, dict[str, str]]:
    """Status, KServe error body and extra headers for any exception (500 for the unexpected)."""
    if isinstance(error, Refusal):
        return STATUS_BY_REFUSAL[type(error)], encode_error(error.message), error.headers
    if not isinstance(error, BatchlineError):
        logger.error("unexpected error", exc_info=error)
        return 500, encode_error(f"internal error: {type(error).__name__}"), {}
    headers = {}
    if isinstance(error, QueueFull):
        headers["Retry-After"] = error.retry_after
    elif isinstance(error, RequestTimeout):  # the rest of its body may still come: not a request to read
        headers["Connection"] = "close"
    return status_of(error), encode_error(error.message), headers


def error_response(status: int, message: str) -> Response:
    return Response(encode_error(message), status_code=status, media_type="application/json")


def install_error_handlers(app: FastAPI) -> None:
    async def on_error(_: Request, exc: Exception) -> Response:
        status, body, headers = error_parts(exc)
        return Response(body, status_code=status, media_type="application/json", headers=headers)

    async def on_http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return Response(encode_error(str(exc.detail)), status_code=exc.status_code,
                        media_type="application/json", headers=exc.headers)

    async def on_validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return error_response(400, problems)

    async def on_client_left(_: Request, exc: Exception) -> Response:
        """The client closed its connection while a route read the body: nobody reads this
        answer, and nothing went wrong here to log (else each such client logs a traceback)."""
        status, body, headers = error_parts(Cancelled(CLIENT_LEFT))
        return Response(body, status_code=status, media_type="application/json", headers=headers)

    app.add_exception_handler(BatchlineError, on_error)
    app.add_exception_handler(ClientDisconnect, on_client_left)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_error)
