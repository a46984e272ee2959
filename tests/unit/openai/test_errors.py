"""The /v1 error map: OpenAI's statuses, types and codes, in OpenAI's body."""

from __future__ import annotations

import orjson
import pytest

from server.errors import (
    BatchlineError,
    DeadlineExceeded,
    EngineError,
    ExecutionTimeout,
    InvalidInput,
    ModelNotFound,
    OutOfMemory,
    PayloadTooLarge,
    QueueFull,
    ServerBusy,
    TooLongForDeadline,
    Unavailable,
    Unsupported,
)
from server.openai.errors import InvalidRequest, error_parts, refusal_body
from server.openai.schemas import ErrorBody


@pytest.mark.parametrize(
    ("error", "status", "kind", "code"),
    [
        (InvalidInput("bad"), 400, "invalid_request_error", None),
        (Unsupported("no"), 400, "invalid_request_error", None),
        (ModelNotFound("none"), 404, "invalid_request_error", "model_not_found"),
        (PayloadTooLarge("big"), 413, "invalid_request_error", "request_too_large"),
        (QueueFull("full"), 429, "requests", "rate_limit_exceeded"),
        (ServerBusy("busy"), 429, "requests", "rate_limit_exceeded"),
        (EngineError("boom"), 500, "server_error", None),
        (OutOfMemory("oom"), 500, "server_error", None),
        (Unavailable("later"), 503, "server_error", None),
        (DeadlineExceeded("late"), 504, "server_error", "timeout"),
        (TooLongForDeadline("too long"), 504, "server_error", "timeout"),
        (ExecutionTimeout("stuck"), 504, "server_error", "timeout"),  # an EngineError, but a timeout
    ],
)
def test_core_errors_map_to_openais_status_type_and_code(
    error: BatchlineError, status: int, kind: str, code: str | None
) -> None:
    sent, body, _ = error_parts(error)
    detail = ErrorBody.model_validate_json(body).error
    assert (sent, detail.type, detail.code, detail.message, detail.param) == (status, kind, code, error.message, None)


def test_a_full_queue_says_when_to_retry() -> None:
    assert error_parts(QueueFull("full", retry_after_s=2.6))[2] == {"Retry-After": "3"}
    assert error_parts(QueueFull("full", retry_after_s=0.1))[2] == {"Retry-After": "1"}
    assert error_parts(InvalidInput("bad"))[2] == {}


def test_a_list_too_long_for_its_deadline_tells_the_client_not_to_retry() -> None:
    """OpenAI's clients retry a 5xx twice: a list too long for the model's timeout was computed
    three times, 30 s each, and failed each time. One whose deadline passed before any of it ran
    (a queue backed up by others) may pass when retried."""
    assert error_parts(TooLongForDeadline("too long"))[2] == {"x-should-retry": "false"}
    assert error_parts(DeadlineExceeded("late"))[2] == {}


def test_an_invalid_request_names_its_field() -> None:
    status, body, _ = error_parts(InvalidRequest("'dimensions' ...", "dimensions"))
    assert status == 400 and orjson.loads(body)["error"]["param"] == "dimensions"


def test_an_unexpected_error_is_a_500_that_shows_no_detail(caplog: pytest.LogCaptureFixture) -> None:
    status, body, _ = error_parts(KeyError("secret"))
    assert status == 500
    assert orjson.loads(body) == {"error": {"message": "internal error: KeyError", "type": "server_error",
                                            "param": None, "code": None}}
    assert "unexpected error" in caplog.text


def test_the_gates_refusal_is_openais_invalid_api_key() -> None:
    detail = ErrorBody.model_validate_json(refusal_body(401, "this route needs the inference token")).error
    assert (detail.type, detail.code, detail.message) == (
        "invalid_request_error", "invalid_api_key", "this route needs the inference token")
