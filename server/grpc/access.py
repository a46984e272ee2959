"""Who may call which RPC: the policy of the HTTP front end, read from the call's metadata.

Health (ServerLive, ServerReady) is open, as HTTP's probes are. Repository load and unload are
refused unless model control is on, then need the admin token when one is set. Everything else
needs the inference token when one is set (the admin token passes too). A token comes as
`authorization: Bearer <token>` metadata, tritonclient's `headers=`.

HTTP's checks against web pages (a loopback Host, a JSON Content-Type) have no gRPC
counterpart to defend: a page cannot make a browser send a gRPC call.
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Iterable
from typing import Protocol

from server.grpc.errors import ControlDisabled, NotAuthenticated, Refusal

_FLAG = "--model-control (BATCHLINE_MODEL_CONTROL=1)"


class Policy(Protocol):
    """What the gate reads of the server's access policy (read only: the policy is frozen)."""

    @property
    def model_control(self) -> bool: ...
    @property
    def admin_token(self) -> str | None: ...
    @property
    def inference_token(self) -> str | None: ...


class Access(enum.Enum):
    OPEN = "open"
    DATA = "data"
    CONTROL = "control"


OPEN_RPCS = frozenset({"ServerLive", "ServerReady"})
CONTROL_RPCS = frozenset({"RepositoryModelLoad", "RepositoryModelUnload"})


def access_of(rpc: str) -> Access:
    """The kind of an RPC by its method name; anything not listed is data, closed by default."""
    if rpc in OPEN_RPCS:
        return Access.OPEN
    if rpc in CONTROL_RPCS:
        return Access.CONTROL
    return Access.DATA


class CallGate:
    def __init__(self, policy: Policy | None) -> None:
        self.model_control = policy.model_control if policy is not None else False
        self._admin = _encoded(policy.admin_token if policy is not None else None)
        self._inference = _encoded(policy.inference_token if policy is not None else None)

    def refusal(self, rpc: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> Refusal | None:
        """Why this call may not go on, or None."""
        access = access_of(rpc)
        if access is Access.OPEN:
            return None
        if access is Access.DATA:
            if self._inference is None:
                return None
            presented = bearer(metadata)
            # both compared, always: the time taken says nothing of which token was close
            if _matches(presented, self._inference) | _matches(presented, self._admin):
                return None
            return _not_authenticated(presented, "the inference token")
        if not self.model_control:
            return ControlDisabled("explicit model load / unload is not allowed: model control is off; start the "
                                   "server with " + _FLAG)
        if self._admin is not None:
            presented = bearer(metadata)
            if not _matches(presented, self._admin):
                return _not_authenticated(presented, "the admin token")
        return None


def bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> bytes | None:
    """The token of the one `authorization` entry, if it is `Bearer <token>` (scheme in any case)."""
    values = [value for key, value in metadata or () if key.lower() == "authorization"]
    if len(values) != 1:
        return None
    value = values[0]
    raw = value.encode("latin-1", "replace") if isinstance(value, str) else value
    scheme, _, token = raw.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip() or None


def _encoded(token: str | None) -> bytes | None:
    return None if token is None else token.encode("ascii")


def _matches(presented: bytes | None, expected: bytes | None) -> bool:
    if presented is None or expected is None:
        return False
    return hmac.compare_digest(presented, expected)


def _not_authenticated(presented: bytes | None, which: str) -> NotAuthenticated:
    if presented is None:
        return NotAuthenticated(f"this call needs {which}: send the metadata authorization: Bearer <token>")
    return NotAuthenticated(f"the bearer token is not {which}")
