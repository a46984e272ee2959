"""OpenAI embeddings bodies: the request in, the response out, and the vector arithmetic
between (Matryoshka truncation). Pure functions over bytes and numpy arrays."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import orjson
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from server.config import ModelConfig
from server.openai.errors import InvalidRequest
from server.openai.schemas import EmbeddingRequest

OWNED_BY = "batchline"


def parse_request(body: bytes) -> EmbeddingRequest:
    """The request, or InvalidRequest (400) naming the field at fault."""
    try:
        return EmbeddingRequest.model_validate_json(body)
    except ValidationError as exc:
        raise _invalid(exc.errors()[0]) from None


def _invalid(error: ErrorDetails) -> InvalidRequest:
    """OpenAI's wording where it has one (an unknown field, a missing one), else pydantic's."""
    where = [str(part) for part in error["loc"]]
    param = where[0] if where else None
    message = error["msg"]
    if error["type"] == "json_invalid":
        return InvalidRequest(f"the body is not valid JSON: {error.get('ctx', {}).get('error', message)}")
    if error["type"] in ("model_type", "model_attributes_type"):
        return InvalidRequest("the body must be a JSON object")
    if error["type"] == "extra_forbidden":
        return InvalidRequest(f"unrecognized request argument supplied: {param}", param)
    if error["type"] == "missing":
        return InvalidRequest(f"'{param}' is required", param)
    if error["type"] == "invalid_input":  # the request model's own words
        return InvalidRequest(message, param)
    return InvalidRequest(f"'{'.'.join(where)}': {message}", param)


def texts_of(request: EmbeddingRequest) -> list[str]:
    return [request.input] if isinstance(request.input, str) else request.input


def utf8(texts: list[str], max_item_bytes: int) -> list[bytes]:
    """Each text as UTF-8, as the model's BYTES input takes it. JSON can carry a lone surrogate
    (\\ud800), which is no text at all: refused here, naming the item; so is a text over the
    model's max_item_bytes, before any part of the list is computed."""
    encoded = []
    for i, text in enumerate(texts):
        try:
            item = text.encode()
        except UnicodeEncodeError:
            raise InvalidRequest(f"input[{i}] holds a lone surrogate, which is not text", "input") from None
        if len(item) > max_item_bytes:
            raise InvalidRequest(f"input[{i}] is {len(item)} bytes of UTF-8, over the model's max_item_bytes of "
                                 f"{max_item_bytes}", "input")
        encoded.append(item)
    return encoded


def target_dimensions(config: ModelConfig, requested: int | None) -> int | None:
    """The length to truncate to (None: the full vector), or a 400 for a `dimensions` the model
    cannot answer: only a Matryoshka-trained model's prefixes are embeddings themselves."""
    if requested is None:
        return None
    output = config.embedding_output()
    assert output is not None and config.openai is not None
    full = output.dims[0]
    allowed = config.openai.matryoshka_dimensions
    if not allowed:
        raise InvalidRequest(
            f"model '{config.name}' does not support 'dimensions': it is not Matryoshka-trained, so a shorter "
            f"prefix of its {full}-dimensional vector is not an embedding; leave 'dimensions' out",
            "dimensions",
        )
    if requested == full:
        return None
    if requested not in allowed:
        served = ", ".join(str(d) for d in [*allowed, full])
        raise InvalidRequest(f"model '{config.name}' serves 'dimensions' {served}, not {requested}", "dimensions")
    return requested


def truncated(vectors: np.ndarray, dimensions: int) -> np.ndarray:
    """The first `dimensions` of each vector, re-normalized to unit length as OpenAI's shortened
    embeddings are (a zero vector stays zero)."""
    head = vectors[:, :dimensions].astype(np.float32)
    norms = np.linalg.norm(head, axis=1, keepdims=True)
    return np.divide(head, norms, out=np.zeros_like(head), where=norms > 0)


def encode_embeddings(vectors: np.ndarray, encoding_format: str, model: str, tokens: int) -> bytes:
    """The response body. base64 is each vector's little-endian float32 bytes, which is what
    OpenAI's client decodes (numpy.frombuffer(..., dtype="float32"))."""
    rows = np.ascontiguousarray(vectors, dtype=np.float32)
    data: list[dict[str, Any]]
    if encoding_format == "base64":
        data = [{"object": "embedding", "index": i, "embedding": base64.b64encode(row.astype("<f4", copy=False).tobytes()).decode("ascii")}
                for i, row in enumerate(rows)]
    else:
        data = [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)]
    document = {"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)


def model_object(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": OWNED_BY}
