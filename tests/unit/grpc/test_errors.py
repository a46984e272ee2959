"""Every core error and refusal has its gRPC status, in the one table, as clients expect."""

from __future__ import annotations

import inspect

import grpc
import pytest

import server.errors as core
from server.grpc import errors
from server.grpc.access import Access, CallGate, access_of
from server.grpc.errors import ControlDisabled, NotAuthenticated, retry_after, status_of


@pytest.mark.parametrize(("error", "code"), [
    (core.InvalidInput("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (core.Unsupported("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (core.ConfigError("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (core.ModelNotFound("x"), grpc.StatusCode.NOT_FOUND),
    (core.QueueFull("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (core.PayloadTooLarge("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (core.DeadlineExceeded("x"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (core.ExecutionTimeout("x"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (core.Unavailable("x"), grpc.StatusCode.UNAVAILABLE),
    (core.Cancelled("x"), grpc.StatusCode.CANCELLED),
    (core.EngineError("x"), grpc.StatusCode.INTERNAL),
    (core.OutOfMemory("x"), grpc.StatusCode.INTERNAL),
    (NotAuthenticated("x"), grpc.StatusCode.UNAUTHENTICATED),
    (ControlDisabled("x"), grpc.StatusCode.PERMISSION_DENIED),
    (core.ServerBusy("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
])
def test_the_status_of_each_error(error: Exception, code: grpc.StatusCode) -> None:
    assert status_of(error) == (code, "x")


def test_every_core_error_is_in_the_table() -> None:
    """A new error type added to the core is mapped here, not left to fall through to INTERNAL."""
    declared = {cls for _, cls in inspect.getmembers(core, inspect.isclass) if issubclass(cls, core.BatchlineError)}
    assert declared - {core.BatchlineError} <= set(errors.CODE_BY_ERROR)


def test_internal_only_for_engine_faults_and_the_unexpected() -> None:
    internal = {cls for cls, code in errors.CODE_BY_ERROR.items() if code is grpc.StatusCode.INTERNAL}
    assert all(issubclass(cls, core.EngineError) for cls in internal)
    code, message = status_of(KeyError("secret detail"))
    assert code is grpc.StatusCode.INTERNAL and "secret" not in message


def test_refusals_under_load_say_when_to_retry() -> None:
    assert retry_after(core.QueueFull("x", retry_after_s=2.6)) == (("retry-after", "3"),)
    assert retry_after(core.ServerBusy("x")) == (("retry-after", "1"),)
    assert retry_after(core.InvalidInput("x")) == ()


class Policy:
    def __init__(self, model_control: bool, admin: str | None = None, inference: str | None = None) -> None:
        self.model_control, self.admin_token, self.inference_token = model_control, admin, inference


ADMIN, CLIENT = "a" * 32, "c" * 32


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def test_the_gate_keeps_http_s_policy() -> None:
    assert access_of("ServerLive") is Access.OPEN and access_of("RepositoryModelLoad") is Access.CONTROL
    assert access_of("SomethingNew") is Access.DATA, "closed by default"
    closed = CallGate(Policy(False))
    assert isinstance(closed.refusal("RepositoryModelLoad", _bearer(ADMIN)), ControlDisabled)
    assert closed.refusal("ModelInfer", []) is None
    guarded = CallGate(Policy(True, ADMIN, CLIENT))
    assert guarded.refusal("ServerReady", []) is None
    assert isinstance(guarded.refusal("ModelInfer", []), NotAuthenticated)
    assert isinstance(guarded.refusal("ModelInfer", _bearer("x" * 32)), NotAuthenticated)
    assert guarded.refusal("ModelInfer", _bearer(CLIENT)) is None
    assert guarded.refusal("ModelInfer", _bearer(ADMIN)) is None
    assert isinstance(guarded.refusal("RepositoryModelUnload", _bearer(CLIENT)), NotAuthenticated)
    assert guarded.refusal("RepositoryModelUnload", [("authorization", f"bearer {ADMIN}")]) is None
    assert isinstance(guarded.refusal("ModelInfer", [*_bearer(CLIENT), *_bearer(CLIENT)]), NotAuthenticated)
    assert CallGate(Policy(True)).refusal("RepositoryModelLoad", []) is None, "loopback without a token, as HTTP"


def test_the_calls_deadline_becomes_the_requests_timeout() -> None:
    from server.errors import DeadlineExceeded
    from server.grpc.servicer import DEADLINE_MARGIN_US, with_deadline

    assert with_deadline({"priority": 1}, None) == {"priority": 1}
    assert with_deadline({}, 2.0) == {"timeout": 2_000_000 - DEADLINE_MARGIN_US}
    assert with_deadline({"timeout": 1_000}, 2.0) == {"timeout": 1_000}, "a shorter timeout asked for stays"
    assert with_deadline({"timeout": 5_000_000}, 2.0)["timeout"] == 2_000_000 - DEADLINE_MARGIN_US
    assert with_deadline({"timeout": 0}, 2.0)["timeout"] == 2_000_000 - DEADLINE_MARGIN_US  # 0: none asked for
    for wrong in (-1, "1000", 1.5, False, 0.0):  # no timeout at all: left for admission to refuse, as over HTTP
        assert with_deadline({"timeout": wrong}, 2.0) == {"timeout": wrong}
    with pytest.raises(DeadlineExceeded):
        with_deadline({}, 0.001)
