"""Who may call what: one ASGI layer in front of the FastAPI app and the bare infer endpoint.

Routes fall in three kinds. Open ones (liveness, readiness, /metrics, the API docs) answer
anyone: kubelet probes and Prometheus scrapes carry no credentials, and they reveal nothing
a token would protect. Control ones (repository load and unload) are refused unless model
control is on (Triton's --model-control-mode=explicit), then need the admin token and a JSON
body. Everything else is data (infer, metadata, statistics, the repository index, and any path
not listed): it needs the inference token when one is set, so a new route is closed by default.

Tokens are compared with hmac.compare_digest, whose time does not depend on where the guess
goes wrong. A web page can make a browser send a cross-site POST, but not with an
Authorization header or a JSON Content-Type without a CORS preflight, which this server never
grants; so the token and the media type are what keep a page from driving the control plane.
"""

from __future__ import annotations

import enum
import hmac
import ipaddress
import logging
import string
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import SecretStr

from server.asgi.respond import body_headers, send_response
from server.asgi.types import ASGIApp, Receive, Scope, Send
from server.http.errors import ControlDisabled, NotAuthenticated, Refusal, UnsupportedMediaType, error_parts
from server.settings import ServerSettings

if TYPE_CHECKING:
    from server.asgi.extension import HttpExtension

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready", "/metrics", "/openapi.json", "/docs", "/redoc",
                        "/docs/oauth2-redirect"})
OPEN_PREFIXES = ("/docs/static/",)
CONTROL_PREFIX = "/v2/repository/models/"  # POST .../load and .../unload; anything else there too
MIN_TOKEN_LENGTH = 16
_TOKEN_CHARACTERS = frozenset(string.ascii_letters + string.digits + string.punctuation)
_LOOPBACK_NAMES = ("localhost",)
_REALM = 'Bearer realm="batchline"'
_JSON_TYPE = b"application/json"
_FLAG = "--model-control (BATCHLINE_MODEL_CONTROL=1)"


class Access(enum.Enum):
    OPEN = "open"
    DATA = "data"
    CONTROL = "control"


def access_of(method: str, path: str) -> Access:
    """The kind of a route, from its method and path (a template such as /v2/models/{model}
    classifies as its paths do)."""
    if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
        return Access.OPEN
    if method == "POST" and path.startswith(CONTROL_PREFIX):
        return Access.CONTROL
    return Access.DATA


class SettingsError(ValueError):
    """Settings the server refuses to start with: the message says which and why."""


@dataclass(frozen=True)
class AccessPolicy:
    """What the gate enforces. The default is the safe one: model control off, no tokens."""

    model_control: bool = False
    admin_token: str | None = None
    inference_token: str | None = None

    def __repr__(self) -> str:  # never print a token into a log or a traceback
        return (f"AccessPolicy(model_control={self.model_control}, admin_token={_shown(self.admin_token)}, "
                f"inference_token={_shown(self.inference_token)})")

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> AccessPolicy:
        """The policy of `batchline serve`; SettingsError for tokens that are unsafe or in conflict,
        and for model control without an admin token on an address other hosts can reach."""
        admin = _token("admin", settings.admin_token, settings.admin_token_file)
        inference = _token("inference", settings.inference_token, settings.inference_token_file)
        if admin is not None and admin == inference:
            raise SettingsError("the admin and inference tokens are the same: every client could load and unload")
        if settings.model_control and admin is None and not is_loopback(settings.host):
            raise SettingsError(
                f"model control is on and --host {settings.host} is reachable from other machines, but no admin "
                "token is set: set BATCHLINE_ADMIN_TOKEN or --admin-token-file, or serve on 127.0.0.1"
            )
        if admin is not None and not settings.model_control:
            logger.warning("an admin token is set but model control is off: load and unload stay refused (%s)", _FLAG)
        return cls(settings.model_control, admin, inference)


def _shown(token: str | None) -> str:
    return "None" if token is None else "'**********'"


def _token(kind: str, value: SecretStr | None, file: Path | None) -> str | None:
    """A token from the environment or from a file (safer: argv and the environment of a
    process are readable by more people than a file of mode 0600)."""
    if value is not None and file is not None:
        raise SettingsError(f"the {kind} token is set twice: give BATCHLINE_{kind.upper()}_TOKEN or "
                            f"--{kind}-token-file, not both")
    if file is not None:
        try:
            token = file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise SettingsError(f"cannot read the {kind} token file {file}: {exc}") from exc
        where = f"the {kind} token file {file}"
    elif value is not None:
        token = value.get_secret_value().strip()
        where = f"BATCHLINE_{kind.upper()}_TOKEN"
    else:
        return None
    if len(token) < MIN_TOKEN_LENGTH:
        raise SettingsError(f"{where} holds a token of {len(token)} characters; use at least {MIN_TOKEN_LENGTH} "
                            "(e.g. `openssl rand -hex 32`)")
    if not set(token) <= _TOKEN_CHARACTERS:
        raise SettingsError(f"{where} holds a token with spaces or characters outside printable ASCII, "
                            "which an HTTP header cannot carry as is")
    return token


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches: 127.0.0.0/8, ::1, localhost."""
    name = host.strip().removeprefix("[").removesuffix("]").lower()
    if name in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class AccessGate:
    """The ASGI app `create_app` returns: checks each request against the policy, then hands
    it to `app` (the infer endpoint and the FastAPI app behind it) or answers the refusal."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy, extensions: tuple[HttpExtension, ...] = ()) -> None:
        """`extensions`: the protocols beside v2, whose refusals go out in their own error shape."""
        self.app = app
        self.policy = policy
        self._extensions = extensions
        self._admin = _encoded(policy.admin_token)
        self._inference = _encoded(policy.inference_token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                status, body, headers = error_parts(refusal)
                for extension in self._extensions:  # its clients read its own error body
                    if extension.owns(scope["path"]):
                        body = extension.refusal_body(status, refusal.message)
                await send_response(scope, send, status, body_headers(body, headers), body)
                return
        await self.app(scope, receive, send)

    def admits(self, scope: Scope) -> bool:
        """Whether this request passes the gate (what a layer that answers before it must ask)."""
        return self._refusal(scope) is None

    def admits_data(self, scope: Scope) -> bool:
        """`admits`, for a request the caller knows is on a data route (an infer call): on a
        server without an inference token, every one passes, unlooked at."""
        return self._inference is None or self._refusal(scope) is None

    def _refusal(self, scope: Scope) -> Refusal | None:
        """Why this request may not pass, or None. Cheap where it matters: an infer call on a
        server without an inference token costs a set lookup and two prefix checks."""
        access = access_of(scope["method"], scope["path"])
        if access is Access.OPEN:
            return None
        if access is Access.DATA:
            if self._inference is None:
                return None
            presented = _bearer(scope)
            # both compared, always: the time taken says nothing of which token was close
            if _matches(presented, self._inference) | _matches(presented, self._admin):
                return None
            return _not_authenticated(presented, "the inference token")
        if not self.policy.model_control:
            return ControlDisabled(
                "explicit model load / unload is not allowed: model control is off; start the server with " + _FLAG
            )
        if self._admin is not None:
            presented = _bearer(scope)
            if not _matches(presented, self._admin):
                return _not_authenticated(presented, "the admin token")
        elif not _from_a_local_name(scope):
            return ControlDisabled(
                "model control without an admin token takes calls addressed to localhost, 127.0.0.1 or [::1] only "
                "(a page elsewhere could reach this server through a DNS name it controls); set an admin token"
            )
        if not _is_json(scope):
            return UnsupportedMediaType(
                "send Content-Type: application/json: load and unload change the server, and a web page's form "
                "cannot send that type to another site (tritonclient: headers={'Content-Type': 'application/json'})"
            )
        return None


def _encoded(token: str | None) -> bytes | None:
    return None if token is None else token.encode("ascii")


def _header(scope: Scope, name: bytes) -> list[bytes]:
    return [value for key, value in scope["headers"] if key == name]


def _bearer(scope: Scope) -> bytes | None:
    """The token of the one Authorization header, if it is `Bearer <token>` (scheme in any case)."""
    values = _header(scope, b"authorization")
    if len(values) != 1:
        return None
    scheme, _, token = values[0].strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip() or None


def _matches(presented: bytes | None, expected: bytes | None) -> bool:
    if presented is None or expected is None:
        return False
    return hmac.compare_digest(presented, expected)


def _not_authenticated(presented: bytes | None, which: str) -> NotAuthenticated:
    """401 with the challenge RFC 6750 asks for; `invalid_token` when a token came and was wrong."""
    if presented is None:
        return NotAuthenticated(f"this route needs {which}: send Authorization: Bearer <token>",
                                {"WWW-Authenticate": _REALM})
    return NotAuthenticated(f"the bearer token is not {which}",
                            {"WWW-Authenticate": f'{_REALM}, error="invalid_token"'})


def _is_json(scope: Scope) -> bool:
    values = _header(scope, b"content-type")
    return len(values) == 1 and values[0].partition(b";")[0].strip().lower() == _JSON_TYPE


def _from_a_local_name(scope: Scope) -> bool:
    """The Host the client addressed is a loopback name: a page that rebinds its own DNS name to
    127.0.0.1 reaches the port, but its requests still name its own host."""
    values = _header(scope, b"host")
    if len(values) != 1:
        return False
    host = values[0].decode("latin-1").strip()
    name = host[: host.index("]") + 1] if host.startswith("[") and "]" in host else host.rpartition(":")[0] or host
    return is_loopback(name)
