"""What a protocol served on the HTTP port beside KServe v2 declares of itself (OpenAI's /v1 is
one), so that the HTTP front end mounts it, gates it and documents it without knowing it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter

from server.access_log import AccessLog
from server.dataplane import DataPlane
from server.inflight import InFlight

RouterFactory = Callable[[DataPlane, int, AccessLog, InFlight], APIRouter]


@dataclass(frozen=True)
class HttpExtension:
    prefix: str  # every route of it lies under this path ("/v1")
    router: RouterFactory  # its routes over (plane, max_body_bytes, access_log, flight); they read their own bodies
    refusal_body: Callable[[int, str], bytes]  # the access gate's refusal (401), in its clients' error shape
    error_statuses: Mapping[str, Mapping[int, str]]  # 'METHOD /path' -> its error statuses, for the document
    error_schema: str  # the component schema of its error body
    component_schemas: Callable[[], dict[str, Any]]  # schemas its document refers to beyond its models

    def owns(self, path: str) -> bool:
        return path.startswith(self.prefix + "/")
