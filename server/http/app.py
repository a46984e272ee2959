"""KServe v2 routes over HTTP. Thin: read bytes and headers, call the data plane, answer.

The control plane is ordinary FastAPI routes, documented at /docs; the infer route is a bare
ASGI endpoint in front of them (`infer.py`), described in the same OpenAPI document.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from prometheus_client import CollectorRegistry

from server import __version__
from server.dataplane import DataPlane
from server.http.access_log import AccessLog
from server.http.errors import error_response, install_error_handlers
from server.http.infer import FastInferApp, InferEndpoint
from server.metrics import CONTENT_TYPE, exposition
from server.protocol.v2 import json_object

_EMPTY_JSON = b"{}"

_INFER_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["inputs"],
                    "properties": {
                        "id": {"type": "string"},
                        "parameters": {"type": "object"},
                        "inputs": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["name", "shape", "datatype"],
                                "properties": {
                                    "name": {"type": "string"},
                                    "shape": {"type": "array", "items": {"type": "integer"}},
                                    "datatype": {"type": "string"},
                                    "parameters": {"type": "object"},
                                    "data": {},
                                },
                            },
                        },
                        "outputs": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {"name": {"type": "string"}, "parameters": {"type": "object"}},
                            },
                        },
                    },
                },
                "example": {
                    "inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": ["hello"]}]
                },
            },
            "application/octet-stream": {
                "schema": {"type": "string", "format": "binary"},
                "description": "Triton binary tensor extension: JSON header of "
                "Inference-Header-Content-Length bytes, then the tensors' bytes.",
            },
        },
    }
}


def _json(document: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(document), status_code=status, media_type="application/json")


def _status_only(ok: bool, what: str) -> Response:
    if ok:
        return Response(_EMPTY_JSON, media_type="application/json")
    return error_response(503, f"{what} is not ready")


def create_app(
    plane: DataPlane,
    models: list[str] | None = None,
    max_body_bytes: int = 64 << 20,
    metrics: CollectorRegistry | None = None,
    access_log: AccessLog | None = None,
) -> FastInferApp:
    """The ASGI app; models load in the background once it starts."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        plane.start(models)
        yield
        await plane.stop()

    app = FastAPI(
        title="Batchline",
        version=__version__,
        summary="KServe v2 inference server with dynamic batching",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    v2 = APIRouter(prefix="/v2", tags=["KServe v2"])

    @v2.get("", summary="Server metadata")
    async def server_metadata() -> Response:
        return _json(plane.server_metadata())

    @v2.get("/health/live", summary="Liveness")
    async def live() -> Response:
        return _status_only(True, "server")

    @v2.get("/health/ready", summary="Readiness: every model asked for is loaded and ready")
    async def ready() -> Response:
        return _status_only(plane.server_ready(), "server")

    @v2.get("/models/stats", summary="Statistics of every ready model", tags=["statistics"])
    async def all_stats() -> Response:
        return _json(plane.statistics(None, None))

    @v2.get("/models/{model}", summary="Model metadata")
    @v2.get("/models/{model}/versions/{version}", summary="Model version metadata")
    async def model_metadata(model: str, version: str | None = None) -> Response:
        return _json(plane.model_metadata(model, version))

    @v2.get("/models/{model}/ready", summary="Model readiness")
    @v2.get("/models/{model}/versions/{version}/ready", summary="Model version readiness")
    async def model_ready(model: str, version: str | None = None) -> Response:
        return _status_only(plane.model_ready(model, version), f"model '{model}'")

    @v2.get("/models/{model}/config", summary="Model configuration (Triton's JSON)")
    @v2.get("/models/{model}/versions/{version}/config", summary="Model version configuration")
    async def model_config(model: str, version: str | None = None) -> Response:
        return _json(plane.model_config(model, version))

    @v2.get("/models/{model}/stats", summary="Model statistics", tags=["statistics"])
    @v2.get("/models/{model}/versions/{version}/stats", summary="Model version statistics", tags=["statistics"])
    async def model_stats(model: str, version: str | None = None) -> Response:
        return _json(plane.statistics(model, version))

    @v2.post("/repository/index", summary="Models in the repository and their state", tags=["repository"])
    async def repository_index(request: Request) -> Response:
        options = await _json_object(request)
        return _json(plane.repository_index(bool(options.get("ready", False))))

    @v2.post("/repository/models/{model}/load", summary="Load or reload a model", tags=["repository"])
    async def load(request: Request, model: str) -> Response:
        options = await _json_object(request)
        await plane.load(model, options.get("parameters") or {})
        return _json({})

    @v2.post("/repository/models/{model}/unload", summary="Unload a model", tags=["repository"])
    async def unload(model: str) -> Response:
        await plane.unload(model)
        return _json({})

    app.include_router(v2)

    if metrics is not None:

        @app.get("/metrics", summary="Prometheus metrics", tags=["metrics"])
        async def prometheus_metrics() -> Response:
            return Response(exposition(metrics), media_type=CONTENT_TYPE)

    app.openapi = lambda: _openapi_with_infer(app)  # type: ignore[method-assign]
    return FastInferApp(app, InferEndpoint(plane, max_body_bytes, access_log))


def _openapi_with_infer(app: FastAPI) -> dict[str, Any]:
    """The generated document plus the bare infer endpoint, which FastAPI does not see."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        responses = {
            "200": {"description": "Outputs (JSON, or JSON header + binary tensors)"},
            "400": {"description": "Bad input"},
            "404": {"description": "Unknown model or version"},
            "429": {"description": "Queue full; see Retry-After"},
            "503": {"description": "Model not ready"},
            "504": {"description": "Deadline passed while queued"},
        }
        for path, summary in (
            ("/v2/models/{model}/infer", "Inference"),
            ("/v2/models/{model}/versions/{version}/infer", "Inference on a version"),
        ):
            parameters = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                          for n in ("model", "version") if "{" + n + "}" in path]
            schema["paths"][path] = {"post": {"summary": summary, "tags": ["KServe v2"], "parameters": parameters,
                                              "responses": responses, **_INFER_BODY}}
        app.openapi_schema = schema
    return app.openapi_schema


async def _json_object(request: Request) -> dict[str, Any]:
    """The optional JSON object body of a control-plane call ({} when empty)."""
    body = await request.body()
    return json_object(body) if body.strip() else {}

