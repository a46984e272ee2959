"""Triton's shared-memory extension over HTTP: register, status and unregister of the system
regions clients name in their tensors (`--allow-client-shm`). CUDA regions are refused plainly."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.dataplane import DataPlane
from server.errors import InvalidInput, Unsupported
from server.protocol.v2 import json_object

_EMPTY_JSON = b"{}"
CUDA_NOT_SUPPORTED = "CUDA shared memory is not supported by this server; use system shared memory"


def shared_memory_router(plane: DataPlane) -> APIRouter:
    regions = plane.shared_memory
    router = APIRouter(prefix="/v2", tags=["shared memory"])

    @router.get("/systemsharedmemory/status", summary="Every registered system shared-memory region")
    @router.get("/systemsharedmemory/region/{name}/status", summary="One registered region")
    async def status(name: str | None = None) -> Response:
        return Response(orjson.dumps(regions.status(name)), media_type="application/json")

    @router.post("/systemsharedmemory/region/{name}/register", summary="Register a system shared-memory region")
    async def register(request: Request, name: str) -> Response:
        body = await request.body()
        document = json_object(body) if body.strip() else {}
        regions.register(name, _field(document, "key", str), _field(document, "offset", int, 0),
                         _field(document, "byte_size", int))
        return Response(_EMPTY_JSON, media_type="application/json")

    @router.post("/systemsharedmemory/unregister", summary="Unregister every system shared-memory region")
    @router.post("/systemsharedmemory/region/{name}/unregister", summary="Unregister one region")
    async def unregister(name: str | None = None) -> Response:
        regions.unregister(name)
        return Response(_EMPTY_JSON, media_type="application/json")

    @router.get("/cudasharedmemory/{rest:path}", include_in_schema=False)
    @router.post("/cudasharedmemory/{rest:path}", include_in_schema=False)
    async def cuda(rest: str) -> Response:
        raise Unsupported(CUDA_NOT_SUPPORTED)

    return router


def _field(document: dict[str, Any], key: str, kind: type, default: Any = None) -> Any:
    value = document.get(key, default)
    if value is None or type(value) is not kind:
        raise InvalidInput(f"the register request needs '{key}' ({'a string' if kind is str else 'an integer'})")
    return value
