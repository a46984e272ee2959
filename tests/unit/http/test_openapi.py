"""The OpenAPI document at /openapi.json: valid, and honest about what each route answers.

That the declared statuses are the ones the routes really send is checked against the running
app in test_statuses_match_openapi.py; here, the document's shape.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import orjson
import pytest
from fastapi import FastAPI
from openapi_spec_validator import validate
from prometheus_client import CollectorRegistry

from server.dataplane import DataPlane
from server.http.app import create_app
from server.http.openapi import ERROR_STATUSES, openapi_document
from server.openai import codec as openai_codec
from server.openai import errors as openai_errors
from server.protocol.v2 import encode_error, encode_response
from server.repository import ModelRepository

INFER_ROUTES = ["/v2/models/{model}/infer", "/v2/models/{model}/versions/{version}/infer"]
INFER_STATUSES = {"200", "400", "401", "404", "408", "413", "429", "500", "503", "504"}
OPEN_ROUTES = {"GET /v2/health/live", "GET /v2/health/ready", "GET /metrics"}
CONTROL_ROUTES = {"POST /v2/repository/models/{model}/load", "POST /v2/repository/models/{model}/unload"}


def operations(document: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """('METHOD /path', operation) for every operation of the document."""
    return [(f"{m.upper()} {p}", op) for p, ops in document["paths"].items() for m, op in ops.items()]


def schema_validator(document: dict[str, Any], name: str) -> jsonschema.Draft202012Validator:
    """A validator for one of the document's schemas, its $refs resolved within the document."""
    return jsonschema.Draft202012Validator(
        {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
    )


@pytest.fixture(scope="module")
def document(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The document as the server serves it, with every optional route (/metrics) present."""
    app = create_app(DataPlane(ModelRepository(tmp_path_factory.mktemp("empty"))), metrics=CollectorRegistry())

    async def fetch() -> dict[str, Any]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            response = await client.get("/openapi.json")
            assert response.status_code == 200
            return response.json()

    return asyncio.run(fetch())


def test_the_document_is_valid_openapi(document: dict[str, Any]) -> None:
    validate(document)


def test_no_route_lists_422_which_the_server_never_sends(document: dict[str, Any]) -> None:
    listing = {route: sorted(op["responses"]) for route, op in operations(document)}
    assert not {route for route, statuses in listing.items() if "422" in statuses}, listing
    assert "ValidationError" not in orjson.dumps(document).decode()


def test_every_error_response_is_the_kserve_error_body_or_openais_under_v1(document: dict[str, Any]) -> None:
    errors = [(route, status, response) for route, op in operations(document)
              for status, response in op["responses"].items() if int(status) >= 400]
    assert len(errors) > 20
    for route, status, response in errors:
        schema = "OpenAIError" if route.split(" ", 1)[1].startswith("/v1/") else "Error"
        assert response["content"] == {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}, (
            route, status)
        assert response["description"], (route, status)
    error = schema_validator(document, "Error")
    error.validate(orjson.loads(encode_error("model 'x' is not in the repository")))
    assert not error.is_valid({"detail": "FastAPI's shape, not ours"})
    openai_error = schema_validator(document, "OpenAIError")
    openai_error.validate(orjson.loads(openai_errors.error_body("no such model", "invalid_request_error", None,
                                                                "model_not_found")))
    assert not openai_error.is_valid(orjson.loads(encode_error("the KServe shape is not OpenAI's")))


def test_the_openai_routes_declare_their_statuses_and_bodies(document: dict[str, Any]) -> None:
    embeddings = document["paths"]["/v1/embeddings"]["post"]
    assert set(embeddings["responses"]) == {"200", "400", "401", "404", "408", "413", "429", "500", "503", "504"}
    assert "Retry-After" in embeddings["responses"]["429"]["headers"]
    assert embeddings["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/EmbeddingRequest"}
    request = schema_validator(document, "EmbeddingRequest")
    request.validate({"model": "minilm", "input": ["a", "b"], "encoding_format": "base64"})
    assert not request.is_valid({"model": "minilm", "input": "a", "encoding_format": "int8"})
    response = schema_validator(document, "EmbeddingResponse")
    response.validate(orjson.loads(openai_codec.encode_embeddings(np.ones((2, 3), np.float32), "float", "m", 7)))
    response.validate(orjson.loads(openai_codec.encode_embeddings(np.ones((2, 3), np.float32), "base64", "m", 7)))
    assert set(document["paths"]["/v1/models"]["get"]["responses"]) == {"200", "401"}
    assert set(document["paths"]["/v1/models/{model}"]["get"]["responses"]) == {"200", "401", "404", "503"}
    schema_validator(document, "ModelList").validate(
        {"object": "list", "data": [openai_codec.model_object("minilm", 1700000000)]})


def test_a_full_queue_declares_retry_after(document: dict[str, Any]) -> None:
    for route in INFER_ROUTES:
        assert "Retry-After" in document["paths"][route]["post"]["responses"]["429"]["headers"]


@pytest.mark.parametrize("route", INFER_ROUTES)
def test_the_infer_routes_declare_every_status_they_send(document: dict[str, Any], route: str) -> None:
    responses = document["paths"][route]["post"]["responses"]
    assert set(responses) == INFER_STATUSES
    assert set(responses["200"]["content"]) == {"application/json", "application/octet-stream"}
    assert responses["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/InferResponse"}
    assert "Inference-Header-Content-Length" in responses["200"]["headers"]


def test_the_infer_response_schema_is_what_the_server_encodes(document: dict[str, Any]) -> None:
    schema = document["components"]["schemas"]["InferResponse"]
    assert set(schema["properties"]) == {"model_name", "model_version", "id", "parameters", "outputs"}
    tensor = document["components"]["schemas"]["InferOutputTensor"]
    assert set(tensor["properties"]) == {"name", "shape", "datatype", "parameters", "data"}
    body, header_length = encode_response("digits", 1, "request-7", [
        ("probabilities", "FP32", np.full((2, 10), 0.1, dtype=np.float32), False),
        ("label", "BYTES", np.array([[b"seven"], [b"one"]], dtype=object), True),
    ])
    assert header_length is not None
    response = schema_validator(document, "InferResponse")
    response.validate(orjson.loads(body[:header_length]))
    assert not response.is_valid({"model_name": "digits", "outputs": [{"name": "y", "shape": [1]}]})


def test_the_infer_request_schema_takes_a_kserve_request(document: dict[str, Any]) -> None:
    request = schema_validator(document, "InferRequest")
    request.validate({"id": "1", "parameters": {"timeout": 1000}, "outputs": [{"name": "probabilities"}],
                      "inputs": [{"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [0.0] * 64}]})
    assert not request.is_valid({"inputs": []})


def test_health_and_metrics_are_open_and_every_other_route_may_need_a_bearer_token(document: dict[str, Any]) -> None:
    """Probes and scrapes carry no credentials; the rest says so to /docs' Authorize button."""
    scheme = document["components"]["securitySchemes"]["bearer"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    for route, op in operations(document):
        if route in OPEN_ROUTES:
            assert "security" not in op and "401" not in op["responses"], route
        else:
            assert op["security"] == [{"bearer": []}, {}], route  # {}: no token when the server sets none
            assert "WWW-Authenticate" in op["responses"]["401"]["headers"], route
    assert {route for route, op in operations(document) if {"403", "415"} <= set(op["responses"])} == CONTROL_ROUTES


def test_the_table_names_exactly_the_routes_of_the_app(document: dict[str, Any]) -> None:
    assert {route for route, _ in operations(document)} == set(ERROR_STATUSES)


def test_a_route_without_declared_statuses_fails_the_document(tmp_path: Path) -> None:
    app = create_app(DataPlane(ModelRepository(tmp_path))).app.app  # the gate, the infer router, FastAPI
    assert isinstance(app, FastAPI)

    @app.get("/v2/undeclared")
    async def undeclared() -> dict[str, str]:
        return {}

    with pytest.raises(LookupError, match="GET /v2/undeclared declares no statuses"):
        openapi_document(app)
