"""The /v1 routes: thin, as the v2 ones are. Each turns its failure into OpenAI's error body
through `errors`; /v1/embeddings writes an access log line as the v2 infer route does.

The body is read here, bounded by the server's body limit (the HTTP front end leaves /v1
bodies to this route, not to the control plane's small limit), once the server's bounds on
requests in flight and their bytes (shared with v2 and gRPC) let it in: past them, a 429 before
the body is read. Parsing a large body and encoding many vectors run on a worker thread, as
v2's do, so one big call never stalls the event loop every other request shares. A client that
disconnects while its texts wait has them dropped before compute, as on v2.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.access_log import AccessLog
from server.asgi.body import read_body
from server.asgi.disconnect import unless_client_leaves
from server.asgi.lengths import declared_length
from server.dataplane import DataPlane
from server.errors import Cancelled, InvalidInput, ModelNotFound, ServerBusy, Unavailable
from server.inflight import Hold, InFlight, body_reservation
from server.model import ModelVersion
from server.openai import PREFIX, codec
from server.openai.embeddings import embed
from server.openai.errors import InvalidRequest, error_response
from server.openai.schemas import EmbeddingRequest, EmbeddingResponse, Model, ModelList
from server.scheduler.request import RequestRecord

INLINE_BODY_BYTES = 16 << 10  # as v2: ~1 ms of parsing at most on the loop
INLINE_FLOATS = 16 << 10  # 16k floats, ~1 ms of encoding
EMBEDDINGS = f"{PREFIX}/embeddings"
MODELS = f"{PREFIX}/models"
_REQUEST_BODY = {
    "required": True,
    "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/EmbeddingRequest"},
        "example": {"model": "minilm", "input": ["The cat sat on the mat.", "A dog barked."]},
    }},
}


def _json(document: Any) -> Response:
    return Response(orjson.dumps(document), media_type="application/json")


def openai_router(
    plane: DataPlane, max_body_bytes: int, access_log: AccessLog | None = None, flight: InFlight | None = None
) -> APIRouter:
    """The OpenAI-compatible routes over `plane`; `max_body_bytes` bounds an embeddings body,
    `flight` (the server's) the requests in flight."""
    router = APIRouter(tags=["OpenAI"])
    log = access_log or AccessLog()
    bound = flight or InFlight()

    @router.post(EMBEDDINGS, summary="Create embeddings (OpenAI)", response_model=EmbeddingResponse,
                 openapi_extra={"requestBody": _REQUEST_BODY})
    async def create_embeddings(request: Request) -> Response:
        started = time.perf_counter_ns()
        record = RequestRecord()
        model = "-"  # for the access log line: the model the body names, once it is read
        declared = declared_length(request.headers.get("content-length", "").encode("latin-1"))
        try:
            plane.refuse_when_stopping()  # before a 429
            hold = bound.hold(body_reservation(declared, max_body_bytes), arriving=True)
        except (ServerBusy, Unavailable) as exc:
            response = error_response(exc)
        else:
            try:
                parsed = await _parsed(request, max_body_bytes, declared, hold)
                model = parsed.model
                outcome = await unless_client_leaves(
                    request.receive, lambda: _embeddings(plane, parsed, record, started), request.scope)
                if outcome is None:
                    outcome = Cancelled("the client disconnected before its embeddings were computed")
                response = outcome if isinstance(outcome, Response) else error_response(outcome)
            except Exception as exc:  # noqa: BLE001 (every failure is answered in OpenAI's shape)
                response = error_response(exc)
            finally:
                hold.release()
        if log.enabled:
            client = request.client
            log.write(f"{client.host}:{client.port}" if client else "-", request.scope["path"], model,
                      response.status_code, started, record)
        return response

    @router.get(MODELS, summary="List the embedding models (OpenAI)", response_model=ModelList)
    async def list_models() -> Response:
        try:
            served = [m for m in plane.repository.loaded() if m.ready and m.config.openai is not None]
            latest = {m.config.name: m for m in sorted(served, key=lambda m: m.version)}
            return _json({"object": "list", "data": [_model(m) for _, m in sorted(latest.items())]})
        except Exception as exc:  # noqa: BLE001 (every failure is answered in OpenAI's shape)
            return error_response(exc)

    @router.get(f"{MODELS}/{{model}}", summary="Describe an embedding model (OpenAI)", response_model=Model)
    async def retrieve_model(model: str) -> Response:
        try:
            return _json(_model(_embedding_model(plane.repository.get(model, None))))
        except Exception as exc:  # noqa: BLE001 (every failure is answered in OpenAI's shape)
            return error_response(exc)

    @router.api_route(f"{PREFIX}/{{path:path}}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
                      include_in_schema=False)
    async def unknown(request: Request) -> Response:
        """Any other path under /v1 (chat, completions, a model name with a slash): OpenAI's 404,
        in its words and shape, which its clients read."""
        return error_response(InvalidRequest(f"Invalid URL ({request.method} {request.scope['path']}): this "
                                             "server serves /v1/embeddings and /v1/models", None), status=404)

    return router


async def _parsed(request: Request, limit: int, declared: int | None, hold: Hold) -> EmbeddingRequest:
    """The body's coding, size (413) and shape (400), checked before anything else. A
    compressed body is refused in words (it was read as JSON that did not parse): v2 inflates
    gzip and deflate, this route takes its texts as they are."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise InvalidInput(f"Content-Encoding {encoding[:64]!r} is not taken on {EMBEDDINGS}: send the body "
                           "uncompressed")
    body = await read_body(request.receive, limit, declared, hold)
    if len(body) > INLINE_BODY_BYTES:
        return await asyncio.to_thread(codec.parse_request, body)
    return codec.parse_request(body)


async def _embeddings(
    plane: DataPlane, request: EmbeddingRequest, record: RequestRecord, received_ns: int
) -> Response:
    """As on v2, the model (404, 503) and its queue (429) are refused before any text is encoded
    or tokenized, and what the model cannot answer (400) before any compute."""
    model = _embedding_model(plane.admit(request.model, None))
    record.model_version = model.version
    try:
        dimensions = codec.target_dimensions(model.config, request.dimensions)
        texts = codec.utf8(codec.texts_of(request), model.config.max_item_bytes)
    except InvalidInput:
        model.stats.count_failure("invalid")  # counted as v2 counts a request its model refuses
        raise
    vectors = await embed(plane, model, texts, record, received_ns)
    if dimensions is not None:
        vectors = codec.truncated(vectors, dimensions)
    encode = (vectors, request.encoding_format, request.model, record.tokens)
    if vectors.size > INLINE_FLOATS:
        content = await asyncio.to_thread(codec.encode_embeddings, *encode)
    else:
        content = codec.encode_embeddings(*encode)
    return Response(content, media_type="application/json")


def _embedding_model(model: ModelVersion) -> ModelVersion:
    """`model`, if it serves OpenAI embeddings; else a 404, as OpenAI answers a model it lacks."""
    if model.config.openai is None:
        raise ModelNotFound(f"model '{model.config.name}' is not served as OpenAI embeddings (its configuration "
                            "declares no openai task); GET /v1/models lists those that are")
    return model


def _model(model: ModelVersion) -> dict[str, Any]:
    created = 0
    with contextlib.suppress(OSError):
        created = int(model.path.stat().st_mtime)
    return codec.model_object(model.config.name, created)
