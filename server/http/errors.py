"""The one place where core errors become HTTP statuses and the KServe error body."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from server.errors import (
    BatchlineError,
    Cancelled,
    ConfigError,
    DeadlineExceeded,
    EngineError,
    InvalidInput,
    ModelNotFound,
    QueueFull,
    Unavailable,
    Unsupported,
)
from server.protocol.v2 import encode_error

logger = logging.getLogger(__name__)

STATUS_BY_ERROR: dict[type[BatchlineError], int] = {
    InvalidInput: 400,
    Unsupported: 400,
    ConfigError: 400,
    ModelNotFound: 404,
    QueueFull: 429,
    Cancelled: 499,  # the client closed the request (nginx's convention)
    EngineError: 500,
    Unavailable: 503,
    DeadlineExceeded: 504,
}


def status_of(error: BatchlineError) -> int:
    for cls in type(error).__mro__:
        if cls in STATUS_BY_ERROR:
            return STATUS_BY_ERROR[cls]
    return 500


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(encode_error(message), status_code=status, media_type="application/json", headers=headers)


def response_for(error: BatchlineError) -> Response:
    headers = None
    if isinstance(error, QueueFull):
        headers = {"Retry-After": str(max(1, round(error.retry_after_s)))}
    return error_response(status_of(error), error.message, headers)


def install_error_handlers(app: FastAPI) -> None:
    async def on_batchline_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, BatchlineError)
        return response_for(exc)

    async def on_http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(exc.status_code, str(exc.detail), exc.headers)

    async def on_validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return error_response(400, problems)

    async def on_unexpected_error(_: Request, exc: Exception) -> Response:
        logger.exception("unexpected error", exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}")

    app.add_exception_handler(BatchlineError, on_batchline_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected_error)
