"""KServe v2 routes over HTTP. Thin: read bytes and headers, call the data plane, answer.

The control plane is ordinary FastAPI routes, documented at /docs; the infer route is a bare
ASGI endpoint in front of them (`infer.py`), described in the same OpenAPI document (`openapi.py`).
The documentation pages load their scripts and styles from this server, never from a CDN:
it often runs where there is no internet. In front of both sits the access gate (`auth.py`):
tokens, model control and the media type of state-changing calls are checked there, before
any route runs.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import orjson
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from fastapi_offline import FastAPIOffline
from prometheus_client import CollectorRegistry

from server import __version__
from server.access_log import AccessLog
from server.dataplane import DataPlane
from server.errors import InvalidInput
from server.http.auth import AccessGate, AccessPolicy
from server.http.errors import error_response, install_error_handlers
from server.http.extensions import EXTENSIONS
from server.http.infer import FastInferApp, InferEndpoint
from server.http.openapi import openapi_document
from server.http.shared_memory import shared_memory_router
from server.inflight import InFlight
from server.metrics import CONTENT_TYPE, exposition
from server.paced import PacedRender
from server.protocol.v2 import json_object

_EMPTY_JSON = b"{}"

def _json(document: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(document), status_code=status, media_type="application/json")


def _status_only(ok: bool, what: str) -> Response:
    if ok:
        return Response(_EMPTY_JSON, media_type="application/json")
    return error_response(503, f"{what} is not ready")


def create_app(
    plane: DataPlane,
    max_body_bytes: int = 64 << 20,
    metrics: CollectorRegistry | None = None,
    access_log: AccessLog | None = None,
    access: AccessPolicy | None = None,
    flight: InFlight | None = None,
) -> AccessGate:
    """The ASGI app over `plane`, whose lifecycle (loading, stopping) is its owner's: the
    Server in `batchline serve`. `access` defaults to the closed policy: model control off, no
    tokens. `flight` bounds requests in flight (and their bytes) server-wide: the server's
    other front ends take from the same one."""
    flight = flight or InFlight()
    app = FastAPIOffline(  # /docs and /redoc, their scripts and styles served from /docs/static
        static_url="/docs/static",
        title="Batchline",
        version=__version__,
        summary="KServe v2 inference server with dynamic batching",
    )
    install_error_handlers(app)
    v2 = APIRouter(prefix="/v2", tags=["KServe v2"])

    @v2.get("", summary="Server metadata")
    async def server_metadata() -> Response:
        return _json(plane.server_metadata())

    @v2.get("/health/live", summary="Liveness")
    async def live() -> Response:
        if plane.server_live():
            return Response(_EMPTY_JSON, media_type="application/json")
        return error_response(503, "a model lost every instance to a hung engine; restart the server")

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
        ready = (await _json_object(request)).get("ready", False)
        if not isinstance(ready, bool):  # bool("false") is True
            raise InvalidInput("'ready' must be true or false")
        return _json(await plane.repository_index(ready))

    @v2.post("/repository/models/{model}/load", summary="Load or reload a model", tags=["repository"])
    async def load(request: Request, model: str) -> Response:
        parameters = (await _json_object(request)).get("parameters")
        if parameters is None:
            parameters = {}
        if not isinstance(parameters, dict):  # [] was taken for no parameters
            raise InvalidInput("'parameters' must be an object")
        await plane.load(model, parameters)
        return _json({})

    @v2.post("/repository/models/{model}/unload", summary="Unload a model", tags=["repository"])
    async def unload(model: str) -> Response:
        await plane.unload(model)
        return _json({})

    app.include_router(v2)
    app.include_router(shared_memory_router(plane))
    for extension in EXTENSIONS:  # OpenAI's /v1, for embedding models
        app.include_router(extension.router(plane, max_body_bytes, access_log or AccessLog(), flight))

    if metrics is not None:
        scrape = PacedRender(partial(exposition, metrics))  # scrapes back to back share the loop

        @app.get("/metrics", summary="Prometheus metrics", tags=["metrics"], response_class=PlainTextResponse)
        async def prometheus_metrics() -> Response:
            return Response(await scrape(), media_type=CONTENT_TYPE)

    app.openapi = lambda: _cached_openapi(app)  # type: ignore[method-assign]
    routes = FastInferApp(app, InferEndpoint(plane, max_body_bytes, access_log, flight),
                          own_bodies=tuple(f"{extension.prefix}/" for extension in EXTENSIONS))
    return AccessGate(routes, access or AccessPolicy(), EXTENSIONS)


def _cached_openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is None:
        app.openapi_schema = openapi_document(app)
    return app.openapi_schema


async def _json_object(request: Request) -> dict[str, Any]:
    """The optional JSON object body of a control-plane call ({} when empty)."""
    body = await request.body()
    return json_object(body) if body.strip() else {}

