"""Every route against its OpenAPI document, with requests schemathesis generates, plus odd but
well-formed paths, versions, parameters and headers by hand: no request a client can make is
answered 5xx, and every answer conforms to the document (status declared, content type, body
schema, headers). A 5xx here is a server bug and an ERROR traceback in the log per request: a
flood vector.

The app is the real one (data plane, repository, the shipped digits model on onnxruntime), run
in-process over ASGI by schemathesis, lifespan included. The only 500 the document declares is
an engine that fails, which no generated request can provoke (tested in
test_statuses_match_openapi.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import orjson
import pytest
import schemathesis
import yaml
from hypothesis import given
from hypothesis import strategies as st
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.python import asgi
from schemathesis.schemas import BaseSchema

from server.dataplane import DataPlane
from server.http.app import create_app
from server.http.infer import HEADER_LENGTH
from server.http.openapi import ERROR_STATUSES
from server.metrics import build_registry
from server.repository import ModelRepository
from tests.integration.conftest import MODELS, require_built_models
from tests.unit.hypothesis_profile import bounded

MAX_BODY_BYTES = 1 << 16
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
IMAGE = {"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [0.0] * 64}


def _write_model(root: Path, name: str) -> None:
    """digits, version 1 linked from the shipped build, warmed up at batch 1 only (fast)."""
    config = yaml.safe_load((MODELS / "digits" / "config.yaml").read_text())
    config |= {"name": name, "warmup": {"batch_sizes": [1]}, "instance_group": [{"count": 1, "kind": "CPU"}]}
    (root / name).mkdir(parents=True)
    (root / name / "config.yaml").write_text(yaml.safe_dump(config))
    (root / name / "1").symlink_to(MODELS / "digits" / "1", target_is_directory=True)


class ServedOnce:
    """The app with a lifespan that starts the data plane once and stops it only when the module
    is done. Schemathesis's pytest plugin ends an ASGI app's lifespan after every test (and the
    next request starts it again): with the app's own lifespan, every test would unload and
    reload the models."""

    def __init__(self, app: Any, plane: DataPlane, models: list[str]) -> None:
        self.app = app
        self._plane = plane
        self._models = models
        self._started = False
        self.finished = False  # set by the fixture: the next lifespan shutdown stops the plane

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                if not self._started:
                    self._plane.start(self._models)  # on the loop that serves the requests
                    self._started = True
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.finished:
                    await self._plane.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedOnce]:
    """The app as `batchline serve` builds it, run by schemathesis on its ASGI loop, serving digits."""
    require_built_models(("digits",))
    root = tmp_path_factory.mktemp("schemathesis") / "models"
    _write_model(root, "digits")
    _write_model(root, "idle")  # never loaded: 503 on its routes
    plane = DataPlane(ModelRepository(root))
    metrics = build_registry(plane.repository)
    served = ServedOnce(create_app(plane, max_body_bytes=MAX_BODY_BYTES, metrics=metrics), plane, ["digits"])
    with asgi.get_client(served) as client:  # starts the lifespan: the models load
        deadline = time.monotonic() + 120
        while client.get("/v2/health/ready").status_code != 200:
            assert time.monotonic() < deadline, "digits did not load in 120 s"
            time.sleep(0.05)
    yield served
    served.finished = True
    with asgi.get_client(served):
        pass  # a lifespan to end, whatever the plugin ended already
    asgi.shutdown_lifespans()


@pytest.fixture(scope="module")
def api(app: ServedOnce) -> BaseSchema:
    return schemathesis.openapi.from_asgi("/openapi.json", app)


@pytest.fixture(scope="module")
def client(app: ServedOnce) -> Iterator[asgi.ASGIClient]:
    with asgi.get_client(app) as session:
        yield session


# The model and version that serve: half the cases of a route with them reach the engine, not
# only the 404 of a random name. Never for the repository routes: a generated unload of digits
# would leave the rest of the module a 503.
SERVING = {"model": "digits", "version": "1"}


def _strategy(api: BaseSchema, route: str, mode: schemathesis.GenerationMode) -> st.SearchStrategy[schemathesis.Case]:
    method, path = route.split(" ", 1)
    operation = api[path][method]
    generated = operation.as_strategy(mode)
    names = {name: value for name, value in SERVING.items() if "{" + name + "}" in path}
    if not names or path.startswith("/v2/repository"):
        return generated
    return st.one_of(generated, operation.as_strategy(mode, path_parameters=names))


# Requests that break the document's schemas, for the operations that declare a body: the others
# take only strings in their path, which a string cannot break.
WITH_A_BODY = [route for route in sorted(ERROR_STATUSES) if route.endswith(("/infer", "/v1/embeddings"))]
CASES = [(route, schemathesis.GenerationMode.POSITIVE) for route in sorted(ERROR_STATUSES)]
CASES += [(route, schemathesis.GenerationMode.NEGATIVE) for route in WITH_A_BODY]


@pytest.mark.parametrize(("route", "mode"), CASES, ids=lambda v: str(v))
def test_no_generated_request_gets_a_5xx_and_every_answer_conforms(
    api: BaseSchema, route: str, mode: schemathesis.GenerationMode
) -> None:
    """Schemathesis's pytest integration (`from_fixture`) does not run on pytest 9, so each
    operation is driven here, one test per operation and generation mode."""

    @bounded(10)
    @given(case=_strategy(api, route, mode))
    def answers_conform(case: schemathesis.Case) -> None:
        case.call_and_validate(checks=CHECKS)

    answers_conform()


# --- by hand: odd but well-formed requests -------------------------------------------------------


def assert_client_error(response: Any, what: str) -> None:
    """A 4xx with the KServe error body."""
    assert 400 <= response.status_code < 500, f"{what}: {response.status_code} {response.text[:300]}"
    assert response.headers["content-type"].startswith("application/json"), what
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), (what, body)


ODD_VERSIONS = ["0", "-1", "01x", "1.5", " 1", "1 ", "+1", "0x1", "9" * 30, "9" * 5000, "²", "١", "①", "\x00", "%"]
ODD_NAMES = ["a/b", "digits.", ".hidden", "ü", "😀", "x" * 300, "x" * 5000, "\x00", "digits\n", "%2F", "..."]
VERSION_ROUTES = ["", "/ready", "/config", "/stats"]


def path_of(model: str, version: str | None = None, route: str = "") -> str:
    """The route's path with `model` and `version` percent-encoded, as a client sends them."""
    path = f"/v2/models/{quote(model, safe='')}"
    if version is not None:
        path += f"/versions/{quote(version, safe='')}"
    return path + route


def infer_body(**parameters: Any) -> bytes:
    return orjson.dumps({"inputs": [IMAGE], "parameters": parameters})


@pytest.mark.parametrize("version", ODD_VERSIONS, ids=lambda v: repr(v[:12]))
def test_odd_versions_are_a_404_on_every_version_route(client: asgi.ASGIClient, version: str) -> None:
    for route in VERSION_ROUTES:
        response = client.get(path_of("digits", version, route))
        if route == "/ready":
            assert response.status_code in (404, 503), (route, response.status_code, response.text[:200])
        else:
            assert response.status_code == 404, (route, response.status_code, response.text[:200])
        assert_client_error(response, f"GET version {version[:12]!r}{route}")
    assert_client_error(client.post(path_of("digits", version, "/infer"), data=infer_body()), "infer")


def test_a_version_with_leading_zeros_is_that_version(client: asgi.ASGIClient) -> None:
    """As Triton reads it: "01" is version 1."""
    assert client.get(path_of("digits", "01")).status_code == 200
    assert client.post(path_of("digits", "01", "/infer"), data=infer_body()).status_code == 200


@pytest.mark.parametrize("name", ODD_NAMES, ids=lambda n: repr(n[:12]))
def test_odd_model_names_are_a_4xx_on_every_route(client: asgi.ASGIClient, name: str) -> None:
    for route in VERSION_ROUTES:
        assert_client_error(client.get(path_of(name, None, route)), f"GET {name[:12]!r}{route}")
        assert_client_error(client.get(path_of(name, "1", route)), f"GET {name[:12]!r} version 1{route}")
    for action in ("load", "unload"):
        response = client.post(f"/v2/repository/models/{quote(name, safe='')}/{action}")
        assert_client_error(response, f"{action} {name[:12]!r}")
    assert_client_error(client.post(path_of(name, None, "/infer"), data=infer_body()), "infer")


def assert_openai_client_error(response: Any, what: str) -> None:
    """A 4xx with OpenAI's error body (the /v1 routes)."""
    assert 400 <= response.status_code < 500, f"{what}: {response.status_code} {response.text[:300]}"
    assert response.headers["content-type"].startswith("application/json"), what
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), (what, error)


@pytest.mark.parametrize("name", ODD_NAMES, ids=lambda n: repr(n[:12]))
def test_odd_model_names_are_openais_4xx_on_the_v1_routes(client: asgi.ASGIClient, name: str) -> None:
    assert_openai_client_error(client.get(f"/v1/models/{quote(name, safe='')}"), f"GET /v1/models/{name[:12]!r}")
    response = client.post("/v1/embeddings", data=orjson.dumps({"model": name, "input": "hello"}))
    assert_openai_client_error(response, f"embeddings of {name[:12]!r}")


EMBEDDINGS_VALUES: list[Any] = [None, True, 0, -1, 1.5, 2**63 - 1, "", "x", [], [""], [1], [[1]], ["a", 1], {},
                                {"a": 1}]


@pytest.mark.parametrize("value", EMBEDDINGS_VALUES, ids=repr)
@pytest.mark.parametrize("field", ["input", "model", "encoding_format", "dimensions", "user", "other"])
def test_embeddings_fields_of_every_json_type_never_reach_a_5xx(client: asgi.ASGIClient, field: str,
                                                                value: Any) -> None:
    response = client.post("/v1/embeddings", data=orjson.dumps({"model": "digits", "input": "hi", field: value}))
    assert response.status_code < 500, (field, value, response.status_code, response.text[:300])
    assert_openai_client_error(response, f"{field}={value!r}")


JSON_VALUES: list[Any] = [None, True, False, 0, -1, 1, 2**63 - 1, 2**64 - 1, 1.5, -0.0, 1e308, "", "1", "x" * 100,
                          [], [1], {}, {"a": 1}]


def _a_deadline_too_short_to_meet(parameter: str, value: Any, response: Any) -> bool:
    """`timeout: 1` (one microsecond, or True read as 1) is a valid deadline that no batch can
    meet: its answer is the deadline's 504, in the error shape, not a server fault."""
    if parameter != "timeout" or value not in (1, True) or response.status_code != 504:
        return False
    assert "deadline" in orjson.loads(response.content)["error"], response.text
    return True


@pytest.mark.parametrize("parameter", ["priority", "timeout", "binary_data_output", "binary_data_size",
                                       "shared_memory_region", "classification", "sequence_id", "custom"])
def test_request_parameters_of_every_json_type_never_reach_a_5xx(client: asgi.ASGIClient, parameter: str) -> None:
    for value in JSON_VALUES:
        response = client.post(path_of("digits", None, "/infer"), data=infer_body(**{parameter: value}))
        if not _a_deadline_too_short_to_meet(parameter, value, response):
            assert response.status_code < 500, (parameter, value, response.status_code, response.text[:300])
        if 400 <= response.status_code < 500:
            assert_client_error(response, f"{parameter}={value!r}")
        tensor_parameters = orjson.dumps({"inputs": [{**IMAGE, "parameters": {parameter: value}}]})
        response = client.post(path_of("digits", None, "/infer"), data=tensor_parameters)
        assert response.status_code < 500, (parameter, value, response.status_code, response.text[:300])
        outputs = orjson.dumps({"inputs": [IMAGE], "outputs": [{"name": "probabilities", "parameters": {parameter: value}}]})
        response = client.post(path_of("digits", None, "/infer"), data=outputs)
        assert response.status_code < 500, (parameter, value, response.status_code, response.text[:300])


ODD_SHAPES: list[Any] = [[1, 1, 8, -8], [0, 1, 8, 8], [1, 1, 8, 0], [2**63 - 1, 1, 8, 8], [2**64 - 1] * 4,
                         [1] * 65, [2**63 - 1] * 2000, [], [1, 1, 64], "1,1,8,8", [1.0, 1, 8, 8], [True, 1, 8, 8]]


@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: repr(s)[:20])
def test_odd_shapes_are_a_400(client: asgi.ASGIClient, shape: Any) -> None:
    response = client.post(path_of("digits", None, "/infer"), data=orjson.dumps({"inputs": [{**IMAGE, "shape": shape}]}))
    assert response.status_code == 400, (response.status_code, response.text[:300])
    assert_client_error(response, f"shape {shape!r}"[:40])


def binary_request(size: Any, extra: bytes = b"", header_length_delta: int = 0) -> tuple[bytes, dict[str, str]]:
    tensor = {"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32", "parameters": {"binary_data_size": size}}
    header = orjson.dumps({"inputs": [tensor]})
    return header + b"\x00" * 256 + extra, {HEADER_LENGTH: str(len(header) + header_length_delta)}


@pytest.mark.parametrize(
    ("size", "extra", "delta"),
    [(256, b"", 0), (255, b"", 0), (257, b"", 0), (0, b"", 0), (256, b"\x00", 0), (256, b"", 1), (256, b"", -1),
     (2**63, b"", 0), (-1, b"", 0), ("256", b"", 0), (256.0, b"", 0), (None, b"", 0), (256, b"", 10**6)],
)
def test_binary_data_size_mismatches_are_a_400(client: asgi.ASGIClient, size: Any, extra: bytes, delta: int) -> None:
    body, headers = binary_request(size, extra, delta)
    response = client.post(path_of("digits", None, "/infer"), data=body, headers=headers)
    if type(size) is int and (size, extra, delta) == (256, b"", 0):
        assert response.status_code == 200, response.text[:300]
        return
    assert response.status_code == 400, (response.status_code, response.text[:300])
    assert_client_error(response, f"binary_data_size {size!r}")


@pytest.mark.parametrize(
    "value", ["-1", "abc", "", "1e3", "0x10", "9" * 30, "²", "9" * 5000],
    ids=lambda v: repr(v[:12]),
)
def test_odd_header_lengths_are_a_4xx(client: asgi.ASGIClient, value: str) -> None:
    response = client.post(path_of("digits", None, "/infer"), data=infer_body(), headers={HEADER_LENGTH: value})
    assert_client_error(response, f"{HEADER_LENGTH}: {value[:12]!r}")


@pytest.mark.parametrize("value", ["1" * 30, "9" * 5000], ids=lambda v: repr(v[:12]))
def test_a_huge_content_length_is_a_413(app: ServedOnce, value: str) -> None:
    """Content-Length as the ASGI server passes it on (requests would write its own). A body
    declared over the limit is refused before it is read, so the data plane is not involved and
    a loop of the test's own will do."""
    sent: list[dict[str, Any]] = []
    scope = {"type": "http", "method": "POST", "path": "/v2/models/digits/infer", "client": ("127.0.0.1", 1),
             "headers": [(b"content-length", value.encode())]}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": infer_body(), "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(_call(app.app, scope, receive, send))
    assert sent[0]["status"] == 413, (sent[0]["status"], sent[1]["body"][:200])


async def _call(app: Any, scope: dict[str, Any], receive: Any, send: Any) -> None:
    await app(scope, receive, send)
