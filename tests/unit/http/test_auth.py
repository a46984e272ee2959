"""The access gate (server/http/auth.py) on its own: which settings the server refuses to start
with, which requests pass to the routes behind it, and that tokens are compared in constant
time. The statuses it answers, on the real app, are in test_statuses_match_openapi.py."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from server.cli import build_parser, main
from server.http import auth
from server.http.auth import Access, AccessGate, AccessPolicy, SettingsError, access_of, is_loopback
from server.settings import ServerSettings, settings_from

ADMIN = "admin-0123456789abcdef"
INFERENCE = "inference-0123456789abcdef"
Message = dict[str, Any]


class Routes:
    """What stands behind the gate: records the scopes that reached it and answers 200."""

    def __init__(self) -> None:
        self.reached: list[str] = []

    async def __call__(self, scope: Message, receive: Any, send: Any) -> None:
        self.reached.append(scope.get("path", scope["type"]))
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})


def call(gate: AccessGate, method: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, Message, Any]:
    """One request through the gate: (status, headers, JSON body or None)."""
    sent: list[Message] = []
    scope = {"type": "http", "method": method, "path": path,
             "headers": [(k.lower().encode(), v.encode("latin-1")) for k, v in (headers or {}).items()]}

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    asyncio.run(gate(scope, receive, send))
    answered = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
    body = sent[1]["body"]
    return sent[0]["status"], answered, orjson.loads(body) if body else None


def bearer(token: str, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", **{k.replace("_", "-"): v for k, v in headers.items()}}


# --- settings -------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No access setting of the machine's environment leaks in; what `main` sets is undone."""
    for name in ("MODEL_CONTROL", "ADMIN_TOKEN", "INFERENCE_TOKEN", "ADMIN_TOKEN_FILE", "INFERENCE_TOKEN_FILE", "HOST"):
        monkeypatch.delenv(f"BATCHLINE_{name}", raising=False)
    for name in ("HF_HUB_OFFLINE", "CUDA_DEVICE_ORDER"):
        monkeypatch.setenv(name, os.environ.get(name, ""))


def settings(**fields: Any) -> ServerSettings:
    return ServerSettings(**fields)


def test_the_default_is_closed_control_and_open_data() -> None:
    assert AccessPolicy.from_settings(settings()) == AccessPolicy(False, None, None)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "batchline.internal"])
def test_model_control_without_an_admin_token_refuses_to_start_on_a_reachable_address(host: str) -> None:
    with pytest.raises(SettingsError, match="no admin token is set"):
        AccessPolicy.from_settings(settings(host=host, model_control=True))
    policy = AccessPolicy.from_settings(settings(host=host, model_control=True, admin_token=ADMIN))
    assert policy.admin_token == ADMIN


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_model_control_without_an_admin_token_starts_on_loopback(host: str) -> None:
    assert AccessPolicy.from_settings(settings(host=host, model_control=True)) == AccessPolicy(True, None, None)
    assert is_loopback(host)


def test_a_token_is_read_from_its_file_without_the_final_newline(tmp_path: Path) -> None:
    (tmp_path / "admin").write_text(ADMIN + "\n")
    (tmp_path / "inference").write_text(INFERENCE)
    policy = AccessPolicy.from_settings(settings(
        model_control=True, admin_token_file=tmp_path / "admin", inference_token_file=tmp_path / "inference"
    ))
    assert (policy.admin_token, policy.inference_token) == (ADMIN, INFERENCE)
    assert ADMIN not in repr(policy) and INFERENCE not in repr(policy)


@pytest.mark.parametrize(("fields", "why"), [
    ({"admin_token": ADMIN, "inference_token": ADMIN}, "the same"),
    ({"admin_token": "short"}, "at least 16"),
    ({"inference_token": "has a space in it, sadly"}, "spaces"),
    ({"inference_token": "é" * 20}, "printable ASCII"),
    ({"admin_token_file": Path("/nonexistent/admin-token")}, "cannot read"),
])
def test_unsafe_or_conflicting_tokens_refuse_to_start(fields: dict[str, Any], why: str) -> None:
    with pytest.raises(SettingsError, match=why):
        AccessPolicy.from_settings(settings(**fields))


def test_a_token_given_twice_refuses_to_start(tmp_path: Path) -> None:
    (tmp_path / "admin").write_text(ADMIN)
    with pytest.raises(SettingsError, match="set twice"):
        AccessPolicy.from_settings(settings(admin_token=ADMIN, admin_token_file=tmp_path / "admin"))


def test_the_command_line_takes_token_files_never_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHLINE_INFERENCE_TOKEN", INFERENCE)
    args = build_parser().parse_args(["serve", "--model-control", "--admin-token-file", str(tmp_path / "a")])
    chosen = settings_from(args)
    assert chosen.model_control and chosen.admin_token_file == tmp_path / "a"
    assert chosen.inference_token is not None and chosen.inference_token.get_secret_value() == INFERENCE
    assert settings_from(build_parser().parse_args(["serve"])).model_control is False
    with pytest.raises(SystemExit):  # a token on the command line would show in `ps`
        build_parser().parse_args(["serve", "--admin-token", ADMIN])


def test_serve_refuses_to_start_with_open_model_control_on_all_interfaces(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHLINE_MODEL_CONTROL", "1")
    code = main(["serve", "--model-repository", str(tmp_path), "--host", "0.0.0.0", "--http-port", "0"])
    assert code == 2
    assert "no admin token is set" in caplog.text


# --- which requests pass ----------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "access"), [
    ("GET", "/v2/health/live", Access.OPEN),
    ("GET", "/v2/health/ready", Access.OPEN),
    ("GET", "/metrics", Access.OPEN),
    ("GET", "/docs", Access.OPEN),
    ("GET", "/docs/static/swagger-ui.css", Access.OPEN),
    ("GET", "/openapi.json", Access.OPEN),
    ("POST", "/v2/repository/models/digits/load", Access.CONTROL),
    ("POST", "/v2/repository/models/digits/unload", Access.CONTROL),
    ("POST", "/v2/repository/models/digits/load/", Access.CONTROL),  # a redirect target is gated too
    ("POST", "/v2/repository/models/{model}/load", Access.CONTROL),
    ("GET", "/v2/repository/models/digits/load", Access.DATA),  # 405 behind the gate, token first
    ("POST", "/v2/repository/index", Access.DATA),
    ("POST", "/v2/models/digits/infer", Access.DATA),
    ("GET", "/v2/models/digits/ready", Access.DATA),
    ("GET", "/v2", Access.DATA),
    ("GET", "/v2/health/live/", Access.DATA),  # not listed as open: closed
    ("GET", "/v2/something/new", Access.DATA),
])
def test_every_route_is_open_data_or_control_and_unlisted_ones_are_data(method: str, path: str, access: Access) -> None:
    assert access_of(method, path) is access


@pytest.mark.parametrize("content_type", [None, "application/octet-stream", "application/json"])
def test_infer_passes_with_the_inference_or_admin_token_whatever_its_content_type(content_type: str | None) -> None:
    """tritonclient sends no Content-Type at all, JSON or binary; curl sends a form type."""
    routes = Routes()
    gate = AccessGate(routes, AccessPolicy(True, ADMIN, INFERENCE))
    extra = {} if content_type is None else {"content_type": content_type}
    assert call(gate, "POST", "/v2/models/m/infer", bearer(INFERENCE, **extra))[0] == 200
    assert call(gate, "POST", "/v2/models/m/infer", bearer(ADMIN, **extra))[0] == 200
    assert call(gate, "POST", "/v2/models/m/infer", {"authorization": f"bearer {INFERENCE}"})[0] == 200
    status, headers, body = call(gate, "POST", "/v2/models/m/infer", {} if content_type is None else extra)
    assert status == 401 and headers["www-authenticate"] == 'Bearer realm="batchline"'
    assert "inference token" in body["error"]
    assert routes.reached == ["/v2/models/m/infer"] * 3


def test_without_an_inference_token_data_and_open_routes_pass_bare() -> None:
    routes = Routes()
    gate = AccessGate(routes, AccessPolicy(True, ADMIN, None))
    for method, path in [("POST", "/v2/models/m/infer"), ("GET", "/v2/models/m"), ("GET", "/v2/health/ready")]:
        assert call(gate, method, path)[0] == 200
    assert call(gate, "POST", "/v2/repository/models/m/load", {"content-type": "application/json"})[0] == 401


def test_control_takes_only_the_admin_token_and_json() -> None:
    routes = Routes()
    gate = AccessGate(routes, AccessPolicy(True, ADMIN, INFERENCE))
    load = "/v2/repository/models/m/load"
    status, headers, body = call(gate, "POST", load, bearer(INFERENCE, content_type="application/json"))
    assert status == 401 and headers["www-authenticate"] == 'Bearer realm="batchline", error="invalid_token"'
    assert body["error"] == "the bearer token is not the admin token"
    assert call(gate, "POST", load, bearer(ADMIN, content_type="multipart/form-data; boundary=x"))[0] == 415
    assert call(gate, "POST", load, bearer(ADMIN, content_type="application/json; charset=utf-8"))[0] == 200
    assert routes.reached == [load]


def test_the_gate_lets_the_lifespan_through() -> None:
    routes = Routes()
    gate = AccessGate(routes, AccessPolicy(True, ADMIN, INFERENCE))

    async def nothing() -> Message:
        return {}

    async def ignore(_: Message) -> None:
        return None

    asyncio.run(gate({"type": "lifespan"}, nothing, ignore))
    assert routes.reached == ["lifespan"]


def test_tokens_are_compared_with_hmac_compare_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decision goes through compare_digest: with it answering False, the right tokens fail
    too; and it saw the presented and the expected bytes."""
    seen: list[tuple[bytes, bytes]] = []

    def never(presented: bytes, expected: bytes) -> bool:
        seen.append((presented, expected))
        return False

    monkeypatch.setattr(auth.hmac, "compare_digest", never)
    gate = AccessGate(Routes(), AccessPolicy(True, ADMIN, INFERENCE))
    assert call(gate, "POST", "/v2/models/m/infer", bearer(INFERENCE))[0] == 401
    assert call(gate, "POST", "/v2/repository/models/m/unload", bearer(ADMIN, content_type="application/json"))[0] == 401
    assert (INFERENCE.encode(), INFERENCE.encode()) in seen
    assert (ADMIN.encode(), ADMIN.encode()) in seen
