"""What the OpenAPI document says of the /v1 routes: their error statuses, each with OpenAI's
error body, and the request schema FastAPI cannot see (the route reads its own body, to bound
it). The HTTP front end's document (`server/http/openapi.py`) merges these."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from server.asgi.body import STALLED
from server.openai.routes import EMBEDDINGS, MODELS
from server.openai.schemas import EmbeddingRequest, ErrorBody

ERROR_SCHEMA = "OpenAIError"

ERROR_STATUSES: dict[str, dict[int, str]] = {
    f"POST {EMBEDDINGS}": {
        400: "The body is not an embeddings request (bad JSON, an unknown field, no text, an empty text, more "
        "than 2048 texts, token ids), or asks for 'dimensions' the model does not serve; 'param' names the field",
        404: "No model of this name serves OpenAI embeddings",
        408: STALLED,
        413: "The body is larger than the server accepts",
        429: "The model's queue is full, or the server is at its limit of requests in flight; retry after "
        "Retry-After seconds",
        500: "The engine failed while running a batch that held this request",
        503: "The model is not loaded or not ready, or the server is shutting down",
        504: "The model's queue timeout passed before the request's batch could finish, or its batch ran past "
        "execution_timeout_seconds",
    },
    f"GET {MODELS}": {},
    f"GET {MODELS}/{{model}}": {
        404: "No model of this name serves OpenAI embeddings",
        503: "The model is not loaded, or none of its versions is ready",
    },
}
"""'METHOD /path' -> the error statuses of each /v1 operation (besides 401, which the gate sends)."""


def component_schemas() -> dict[str, Any]:
    """The schemas the /v1 routes' document refers to, beyond those of their response models."""
    return {**_components(EmbeddingRequest), **_components(ErrorBody, ERROR_SCHEMA)}


def _components(model: type[BaseModel], name: str | None = None) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    nested = schema.pop("$defs", {})
    return {**nested, name or model.__name__: schema}
