"""The OpenAPI document, served at /openapi.json and shown at /docs.

FastAPI sees neither the bare infer endpoint nor the statuses the data plane raises, and it
would list 422 for request validation errors, which this server answers with 400. So the error
statuses of every operation are declared here, in one table (`ERROR_STATUSES`), each with the
KServe error body; the tests send each of them to the real app and compare with the table.
The access gate's refusals (401, 403, 415: `auth.py`) are in the table too, and the routes that
may need a bearer token say so (`security`), which gives /docs its Authorize button.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from server.asgi.body import STALLED
from server.http.auth import Access, access_of
from server.http.extensions import EXTENSIONS
from server.http.infer import CONTROL_BODY_BYTES, HEADER_LENGTH
from server.protocol.datatypes import DATATYPES

INFER = "/v2/models/{model}/infer"
VERSION_INFER = "/v2/models/{model}/versions/{version}/infer"

_NO_MODEL = "No model of this name is in the repository"
_NO_VERSION = "No model of this name, or no such version of it, is in the repository"
_NOT_LOADED = "The model is not loaded"
_NOT_READY = "The model is not loaded, or none of its versions is ready"
_VERSION_NOT_READY = "The model is not loaded, or this version of it is not ready"
_NOT_AN_OBJECT = "The body is not a JSON object"
_TOKEN = {401: "An inference token is set and the request does not carry it (or the admin token) as "
               "Authorization: Bearer"}
_CONTROL = {
    401: "An admin token is set and the request does not carry it as Authorization: Bearer (the inference "
         "token is not it)",
    403: "Model control is off (start the server with --model-control); or it is on without an admin token "
         "and the request's Host is not localhost, 127.0.0.1 or [::1]",
    415: "The Content-Type is not application/json",
}
_INFER_ERRORS = {
    400: "The body is malformed, or does not match the model's inputs and outputs",
    408: STALLED,
    413: "The body, or the body once decompressed, is larger than the server accepts",
    429: "The model's queue is full, or the server is at its limit of requests in flight; retry after"
    " Retry-After seconds",
    500: "The engine failed while running the batch that held this request",
    504: "The request's timeout passed while it was queued, or would have before its batch could finish"
    " (it was not run), or its batch ran past the model's execution_timeout_seconds",
}

_SHM_OFF = "The server takes no client shared memory (start it with --allow-client-shm)"
_CONTROL_TOO_LARGE = f"The body is larger than the control plane accepts ({CONTROL_BODY_BYTES >> 10} KiB)"

ERROR_STATUSES: dict[str, dict[int, str]] = {
    "GET /v2": _TOKEN,
    "GET /v2/health/live": {503: "A model lost every instance to a hung engine: only a restart frees them"},
    "GET /v2/health/ready": {503: "A model asked for is still loading, or failed to load"},
    "GET /v2/models/stats": _TOKEN,
    "GET /v2/models/{model}": _TOKEN | {404: _NO_MODEL, 503: _NOT_READY},
    "GET /v2/models/{model}/versions/{version}": _TOKEN | {404: _NO_VERSION, 503: _VERSION_NOT_READY},
    "GET /v2/models/{model}/ready": _TOKEN | {404: _NO_MODEL, 503: _NOT_READY},
    "GET /v2/models/{model}/versions/{version}/ready": _TOKEN | {404: _NO_VERSION, 503: _VERSION_NOT_READY},
    "GET /v2/models/{model}/config": _TOKEN | {
        400: "The model is not loaded and its config.yaml is invalid; the message says where",
        404: _NO_MODEL,
    },
    "GET /v2/models/{model}/versions/{version}/config": _TOKEN | {404: _NO_VERSION, 503: _VERSION_NOT_READY},
    "GET /v2/models/{model}/stats": _TOKEN | {404: _NO_MODEL, 503: _NOT_LOADED},
    "GET /v2/models/{model}/versions/{version}/stats": _TOKEN | {404: _NO_VERSION, 503: _VERSION_NOT_READY},
    "POST /v2/repository/index": _TOKEN | {400: _NOT_AN_OBJECT, 413: _CONTROL_TOO_LARGE},
    "POST /v2/repository/models/{model}/load": _CONTROL | {
        413: _CONTROL_TOO_LARGE,
        400: f"{_NOT_AN_OBJECT}, asks for a config override or files, or the model's config.yaml is invalid",
        404: _NO_MODEL,
        503: "No version of the model could be loaded (or built); the message says why",
    },
    "POST /v2/repository/models/{model}/unload": _CONTROL | {404: _NO_MODEL, 413: _CONTROL_TOO_LARGE},
    "GET /metrics": {},
    "GET /v2/systemsharedmemory/status": _TOKEN | {400: _SHM_OFF},
    "GET /v2/systemsharedmemory/region/{name}/status": _TOKEN | {400: f"{_SHM_OFF}, or no region of this name"},
    "POST /v2/systemsharedmemory/region/{name}/register": _TOKEN | {
        400: f"{_SHM_OFF}; or the name is taken, the key names no shared-memory object, or the region does not fit "
             "in it",
        413: _CONTROL_TOO_LARGE,
    },
    "POST /v2/systemsharedmemory/unregister": _TOKEN | {400: _SHM_OFF, 413: _CONTROL_TOO_LARGE},
    "POST /v2/systemsharedmemory/region/{name}/unregister": _TOKEN | {400: _SHM_OFF, 413: _CONTROL_TOO_LARGE},
    f"POST {INFER}": _TOKEN | _INFER_ERRORS | {404: _NO_MODEL, 503: _NOT_READY},
    f"POST {VERSION_INFER}": _TOKEN | _INFER_ERRORS | {404: _NO_VERSION, 503: _VERSION_NOT_READY},
    **{route: _TOKEN | dict(statuses) for extension in EXTENSIONS for route, statuses in extension.error_statuses.items()},
}
"""'METHOD /path' -> the error statuses that operation sends, and when. Every operation also
answers 200. An operation missing here fails the document: a new route declares its own."""


def _ref(schema: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{schema}"}


_TENSOR_PROPERTIES: dict[str, Any] = {
    "name": {"type": "string"},
    "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "datatype": {"type": "string", "enum": list(DATATYPES)},
    "parameters": {
        "type": "object",
        "description": "binary_data_size: the tensor is binary, this many bytes after the JSON header; "
        "shared_memory_region, shared_memory_byte_size (and shared_memory_offset): the tensor is in that "
        "registered shared-memory region",
    },
}

SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "string", "description": "What went wrong"}},
        "description": "The KServe v2 error body, sent with every error status",
    },
    "InferInputTensor": {
        "type": "object",
        "required": ["name", "shape", "datatype"],
        "properties": {
            **_TENSOR_PROPERTIES,
            "data": {"description": "The elements, flat or nested, in row-major order; absent when binary"},
        },
    },
    "InferRequestedOutput": {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string"},
            "parameters": {"type": "object", "description": "binary_data: true returns this output as binary"},
        },
    },
    "InferRequest": {
        "type": "object",
        "required": ["inputs"],
        "properties": {
            "id": {"type": "string"},
            "parameters": {
                "type": "object",
                "description": "timeout (microseconds it may wait in the queue), priority (1 is the "
                "highest), binary_data_output (every output as binary)",
            },
            "inputs": {"type": "array", "minItems": 1, "items": _ref("InferInputTensor")},
            "outputs": {
                "type": "array",
                "description": "The outputs to return (default: all of them)",
                "items": _ref("InferRequestedOutput"),
            },
        },
    },
    "InferOutputTensor": {
        "type": "object",
        "required": ["name", "shape", "datatype"],
        "properties": {
            **_TENSOR_PROPERTIES,
            "data": {"type": "array", "description": "The elements, flat, in row-major order; absent when binary"},
        },
    },
    "InferResponse": {
        "type": "object",
        "required": ["model_name", "outputs"],
        "properties": {
            "model_name": {"type": "string"},
            "model_version": {"type": "string"},
            "id": {"type": "string", "description": "The request's id, when it had one"},
            "parameters": {"type": "object"},
            "outputs": {"type": "array", "items": _ref("InferOutputTensor")},
        },
    },
}

_BINARY = {"type": "string", "format": "binary"}
_HEADER_LENGTH = {
    HEADER_LENGTH: {
        "description": "Sent with binary outputs: the length of the JSON header before the tensors' bytes",
        "schema": {"type": "integer", "minimum": 0},
    }
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying", "schema": {"type": "integer"}}}
_WWW_AUTHENTICATE = {
    "WWW-Authenticate": {
        "description": 'The challenge: Bearer realm="batchline", with error="invalid_token" when a token was wrong',
        "schema": {"type": "string"},
    }
}
BEARER = "bearer"
SECURITY_SCHEMES = {
    BEARER: {
        "type": "http",
        "scheme": "bearer",
        "description": "The inference token (data routes, when the server sets one) or the admin token (load, "
        "unload and the data routes). Health, /metrics and these pages need none.",
    }
}


def _infer_operation(summary: str, path: str) -> dict[str, Any]:
    """The infer route: a bare ASGI endpoint, which FastAPI does not see."""
    return {
        "summary": summary,
        "tags": ["KServe v2"],
        "parameters": [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in ("model", "version")
            if "{" + name + "}" in path
        ],
        "requestBody": {
            "required": True,
            "description": "An InferRequest as JSON; or, with binary tensors (Triton's binary tensor "
            f"extension), the JSON header, its length in {HEADER_LENGTH}, then the tensors' bytes. "
            "Content-Encoding gzip and deflate are accepted.",
            "content": {
                "application/json": {
                    "schema": _ref("InferRequest"),
                    "example": {
                        "inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": ["hello"]}]
                    },
                },
                "application/octet-stream": {"schema": _BINARY},
            },
        },
        "responses": {
            "200": {
                "description": "The outputs: an InferResponse as JSON; or, when an output is asked for "
                f"as binary, the InferResponse header, its length in {HEADER_LENGTH}, then the tensors' bytes",
                "headers": _HEADER_LENGTH,
                "content": {
                    "application/json": {"schema": _ref("InferResponse")},
                    "application/octet-stream": {"schema": _BINARY},
                },
            }
        },
    }


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document plus the infer routes, with every operation's statuses from the table."""
    document = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    document["paths"][INFER] = {"post": _infer_operation("Inference", INFER)}
    document["paths"][VERSION_INFER] = {"post": _infer_operation("Inference on a version", VERSION_INFER)}
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            route = f"{method.upper()} {path}"
            if route not in ERROR_STATUSES:
                raise LookupError(f"{route} declares no statuses: add it to ERROR_STATUSES in {__name__}")
            error = next((e.error_schema for e in EXTENSIONS if e.owns(path)), "Error")
            operation["responses"] = {"200": operation["responses"]["200"]} | {
                str(status): _error_response(status, why, error)
                for status, why in sorted(ERROR_STATUSES[route].items())
            }
            if access_of(method.upper(), path) is not Access.OPEN:  # a token when the server sets one
                operation["security"] = [{BEARER: []}, {}]
    document.setdefault("components", {})["securitySchemes"] = SECURITY_SCHEMES
    schemas = document["components"].setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):  # the 422 FastAPI would list; never sent
        schemas.pop(unused, None)
    schemas.update(SCHEMAS)
    for extension in EXTENSIONS:
        schemas.update(extension.component_schemas())
    return document


def _error_response(status: int, why: str, schema: str = "Error") -> dict[str, Any]:
    response: dict[str, Any] = {"description": why, "content": {"application/json": {"schema": _ref(schema)}}}
    if status == 429:
        response["headers"] = _RETRY_AFTER
    if status == 401:
        response["headers"] = _WWW_AUTHENTICATE
    return response
