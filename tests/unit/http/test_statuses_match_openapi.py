"""Every status a route sends is declared for it in the OpenAPI document, and every declared
status is one the route really sends: each is provoked here against the real app (real data
plane, repository and engine, driven through ASGI), so the document cannot drift from it.

The app serves with model control on and both tokens set, so the access gate's refusals (401,
403, 415) are provoked on the routes that declare them, and every other probe carries the token
its route takes (the admin token and a JSON Content-Type on load and unload).
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import orjson
import pytest
import pytest_asyncio
import yaml
from prometheus_client import CollectorRegistry

from server.asgi import body
from server.dataplane import DataPlane
from server.http.app import create_app
from server.http.auth import Access, AccessPolicy, access_of
from server.http.infer import CONTROL_BODY_BYTES, HEADER_LENGTH
from server.repository import ModelRepository
from server.shared_memory import SystemSharedMemory
from tests.integration.conftest import MODELS, require_built_models

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_BODY_BYTES = 4096
INFER = "/v2/models/{model}/infer"
VERSION_INFER = "/v2/models/{model}/versions/{version}/infer"
LOAD = "/v2/repository/models/{model}/load"
UNLOAD = "/v2/repository/models/{model}/unload"
ADMIN_TOKEN = "admin-7f3c9e1d5b2a4c6e8f0a"
INFERENCE_TOKEN = "inference-2b4d6f8a0c1e3a5c"
ACCESS = AccessPolicy(model_control=True, admin_token=ADMIN_TOKEN, inference_token=INFERENCE_TOKEN)
Headers = tuple[tuple[str, str], ...]
AS_ADMIN: Headers = (("authorization", f"Bearer {ADMIN_TOKEN}"), ("content-type", "application/json"))
AS_CLIENT: Headers = (("authorization", f"Bearer {INFERENCE_TOKEN}"),)
JSON: Headers = (("content-type", "application/json"),)
IMAGE = {"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [0.0] * 64}


def infer_body(**parameters: object) -> bytes:
    return orjson.dumps({"inputs": [IMAGE], "parameters": parameters})


EMBEDDINGS = "/v1/embeddings"
REGISTER = "/v2/systemsharedmemory/region/probe/register"
SHM_OBJECT = "batchline-probe-images"  # a file in the app's shared-memory folder: 256 zero bytes, one image


def shm_image(byte_size: int) -> dict[str, object]:
    return {"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32",
            "parameters": {"shared_memory_region": "probe", "shared_memory_byte_size": byte_size}}



def embeddings_body(model: str = "minilm", **fields: object) -> bytes:
    return orjson.dumps({"model": model, "input": "hello", **fields})


@dataclass(frozen=True)
class Probe:
    """One request and the status it must get."""

    method: str
    path: str
    status: int
    body: bytes = b""
    what: str = ""  # what the body or the headers are, when it matters
    headers: Headers | None = None  # None: the credentials the route takes (see `credentials`)

    def __str__(self) -> str:
        return " ".join(part for part in (self.method, self.path, self.what, "->", str(self.status)) if part)

    def sent_headers(self) -> Headers:
        return credentials(self.method, self.path) if self.headers is None else self.headers


def credentials(method: str, path: str) -> Headers:
    """What a rightful client sends: the admin token and JSON to load and unload, the inference
    token elsewhere (the open routes ignore it)."""
    return AS_ADMIN if access_of(method, path) is Access.CONTROL else AS_CLIENT


# The repository (see `served`): digits (version 1 serves, version 2 fails to load), idle (never
# loaded), broken (no artifact), badconfig (invalid config.yaml). Probes run in this order.
PROBES = [
    Probe("GET", "/v2", 200),
    Probe("GET", "/v2/health/live", 200),
    Probe("GET", "/v2/models/stats", 200),
    *(
        probe
        for route in ("", "/ready", "/config", "/stats")
        for probe in (
            Probe("GET", f"/v2/models/digits{route}", 200),
            Probe("GET", f"/v2/models/nope{route}", 404),
            Probe("GET", f"/v2/models/digits/versions/1{route}", 200),
            Probe("GET", f"/v2/models/digits/versions/9{route}", 404),
            Probe("GET", f"/v2/models/digits/versions/2{route}", 503),
        )
    ),
    Probe("GET", "/v2/models/idle", 503),
    Probe("GET", "/v2/models/idle/ready", 503),
    Probe("GET", "/v2/models/idle/stats", 503),
    # OpenAI's /v1: minilm declares embeddings, digits does not, idle is not loaded
    Probe("GET", "/v1/models", 200),
    Probe("GET", "/v1/models/minilm", 200),
    Probe("GET", "/v1/models/nope", 404),
    Probe("GET", "/v1/models/digits", 404, what="no OpenAI task"),
    Probe("GET", "/v1/models/idle", 503),
    Probe("POST", EMBEDDINGS, 200, embeddings_body(), "one text"),
    Probe("POST", EMBEDDINGS, 200, embeddings_body(input=["a", "bb"], encoding_format="base64"), "a list, base64"),
    Probe("POST", EMBEDDINGS, 400, b"{not json", "bad JSON"),
    Probe("POST", EMBEDDINGS, 400, embeddings_body(input=""), "an empty text"),
    Probe("POST", EMBEDDINGS, 400, embeddings_body(input=[1, 2]), "token ids"),
    Probe("POST", EMBEDDINGS, 400, embeddings_body(dimensions=128), "dimensions of a model without Matryoshka"),
    Probe("POST", EMBEDDINGS, 404, embeddings_body("nope")),
    Probe("POST", EMBEDDINGS, 404, embeddings_body("digits"), "no OpenAI task"),
    Probe("POST", EMBEDDINGS, 503, embeddings_body("idle")),
    Probe("POST", EMBEDDINGS, 413, embeddings_body(input="x" * MAX_BODY_BYTES), "a body over the limit"),
    Probe("GET", "/v2/models/badconfig/config", 400),
    Probe("POST", "/v2/repository/index", 200),
    Probe("POST", "/v2/repository/index", 200, b'{"ready": true}', "ready only"),
    Probe("POST", "/v2/repository/index", 400, b"{not json", "bad JSON"),
    Probe("POST", "/v2/repository/index", 400, b"[]", "a list"),
    Probe("POST", "/v2/repository/models/nope/load", 404),
    Probe("POST", "/v2/repository/models/digits/load", 400, b"{not json", "bad JSON"),
    Probe("POST", "/v2/repository/models/digits/load", 400, b'{"parameters": {"config": "{}"}}', "config override"),
    Probe("POST", "/v2/repository/models/digits/load", 400, b'{"parameters": ["config"]}', "parameters a list"),
    Probe("POST", "/v2/repository/models/badconfig/load", 400),
    Probe("POST", "/v2/repository/models/broken/load", 503),
    Probe("POST", "/v2/repository/models/digits/load", 503),  # version 2 fails: nothing swaps, 1 serves on
    Probe("POST", "/v2/repository/models/idle/load", 200),
    Probe("POST", "/v2/repository/models/nope/unload", 404),
    Probe("POST", "/v2/repository/models/idle/unload", 200),
    *(
        Probe("POST", path, 413, orjson.dumps({"padding": "x" * CONTROL_BODY_BYTES}), "a body over the control limit")
        for path in ("/v2/repository/index", "/v2/repository/models/idle/load", "/v2/repository/models/idle/unload")
    ),
    Probe("GET", "/metrics", 200),
    *(
        probe
        for path in ("/v2/models/digits/infer", "/v2/models/digits/versions/1/infer")
        for probe in (
            Probe("POST", path, 200, infer_body(), "JSON outputs"),
            Probe("POST", path, 200, infer_body(binary_data_output=True), "binary outputs"),
            Probe("POST", path, 400, b"{not json", "bad JSON"),
            Probe("POST", path, 400, orjson.dumps({"inputs": [{**IMAGE, "shape": [1, 1, 8, 7], "data": [0.0] * 56}]}),
                  "an image of the wrong shape"),
            Probe("POST", path, 413, infer_body(padding="x" * MAX_BODY_BYTES), "a body over the limit"),
        )
    ),
    Probe("POST", "/v2/models/nope/infer", 404, infer_body()),
    Probe("POST", "/v2/models/digits/versions/9/infer", 404, infer_body()),
    Probe("POST", "/v2/models/idle/infer", 503, infer_body()),
    Probe("POST", "/v2/models/digits/versions/2/infer", 503, infer_body()),
    # system shared memory: regions of the object in the app's shared-memory folder (see `served`)
    Probe("GET", "/v2/systemsharedmemory/status", 200),
    Probe("POST", REGISTER, 200, orjson.dumps({"key": f"/{SHM_OBJECT}", "offset": 0, "byte_size": 256})),
    Probe("POST", REGISTER, 400, orjson.dumps({"key": f"/{SHM_OBJECT}", "byte_size": 8}), "a name taken"),
    Probe("POST", "/v2/systemsharedmemory/region/other/register", 400,
          orjson.dumps({"key": "/none", "byte_size": 8}), "no such object"),
    Probe("POST", "/v2/systemsharedmemory/region/other/register", 400, b"{}", "no key"),
    Probe("GET", "/v2/systemsharedmemory/region/probe/status", 200),
    Probe("GET", "/v2/systemsharedmemory/region/nope/status", 400),
    Probe("POST", "/v2/models/digits/infer", 200, orjson.dumps({"inputs": [shm_image(256)]}), "the image in shared memory"),
    Probe("POST", "/v2/models/digits/infer", 400, orjson.dumps({"inputs": [shm_image(512)]}), "past its region"),
    Probe("POST", "/v2/systemsharedmemory/region/probe/unregister", 200),
    Probe("POST", "/v2/systemsharedmemory/unregister", 200),
    *(
        Probe("POST", path, 413, orjson.dumps({"padding": "x" * CONTROL_BODY_BYTES}), "a body over the control limit")
        for path in (REGISTER, "/v2/systemsharedmemory/region/probe/unregister", "/v2/systemsharedmemory/unregister")
    ),
]

# The gate: every route but the open ones refuses a request without its token (each probe that
# answered 200 above, sent bare); load and unload refuse the wrong token, the inference token
# and what a web page's form or fetch could send without a CORS preflight.
OPEN_WITHOUT_A_TOKEN = [
    Probe("GET", path, 200, what="no token", headers=()) for path in ("/v2/health/live", "/metrics")
]
WRONG_TOKEN: Headers = (("authorization", "Bearer not-the-token-at-all-000"),)
REFUSED = [
    *(
        Probe(p.method, p.path, 401, p.body, f"{p.what} no token".strip(), headers=())
        for p in dict.fromkeys(p for p in PROBES if p.status == 200)
        if access_of(p.method, p.path) is not Access.OPEN
    ),
    Probe("POST", "/v2/models/digits/infer", 401, infer_body(), "a wrong token", WRONG_TOKEN),
    Probe("POST", "/v2/models/digits/infer", 401, infer_body(), "Basic, not Bearer",
          (("authorization", f"Basic {INFERENCE_TOKEN}"),)),
    Probe("GET", "/v2/models/digits", 401, what="the token twice", headers=AS_CLIENT + AS_CLIENT),
    *(
        probe
        for path in ("/v2/repository/models/idle/load", "/v2/repository/models/idle/unload")
        for probe in (
            Probe("POST", path, 401, what="no token", headers=JSON),
            Probe("POST", path, 401, what="a wrong token", headers=WRONG_TOKEN + JSON),
            Probe("POST", path, 401, what="the inference token", headers=AS_CLIENT + JSON),
            Probe("POST", path, 415, b"parameters=x", "a form",
                  AS_ADMIN[:1] + (("content-type", "application/x-www-form-urlencoded"),)),
            Probe("POST", path, 415, b"{}", "JSON as text/plain", AS_ADMIN[:1] + (("content-type", "text/plain"),)),
            Probe("POST", path, 415, what="no Content-Type", headers=AS_ADMIN[:1]),
        )
    ),
]

# What the tests below provoke besides PROBES: readiness in its own apps; a busy model's queue
# and an engine failure on each infer route.
READINESS = {("GET", "/v2/health/ready", status) for status in (200, 503)} | {("GET", "/v2/health/live", 503)}
ON_A_BUSY_OR_FAILING_MODEL = {("POST", route, status) for route in (INFER, VERSION_INFER) for status in (429, 500, 504)}
CONTROL_OFF_OR_FOREIGN_HOST = {("POST", LOAD, 403), ("POST", UNLOAD, 403)}
SHARED_MEMORY_ROUTES = [("GET", "/v2/systemsharedmemory/status"), ("GET", "/v2/systemsharedmemory/region/{name}/status"),
                        ("POST", "/v2/systemsharedmemory/region/{name}/register"),
                        ("POST", "/v2/systemsharedmemory/unregister"),
                        ("POST", "/v2/systemsharedmemory/region/{name}/unregister")]
SHARED_MEMORY_OFF = {(method, route, 400) for method, route in SHARED_MEMORY_ROUTES}
ON_A_BUSY_OR_FAILING_EMBEDDINGS_MODEL = {("POST", EMBEDDINGS, status) for status in (429, 500, 504)}
STALLED_BODY = {("POST", route, 408) for route in (INFER, VERSION_INFER, EMBEDDINGS)}


# --- the app under test -------------------------------------------------------------------------


def _write_config(root: Path, name: str, **overrides: Any) -> None:
    """digits' config under another name, with `overrides` of its top-level fields."""
    config = yaml.safe_load((MODELS / "digits" / "config.yaml").read_text())
    config |= {"name": name, "warmup": {"batch_sizes": [1]}, **overrides}  # no profiling: statuses, not speed
    (root / name).mkdir(parents=True)
    (root / name / "config.yaml").write_text(yaml.safe_dump(config))


def repository(root: Path) -> Path:
    require_built_models(("digits",))
    _write_config(
        root, "digits",
        version_policy={"all": {}},
        instance_group=[{"count": 1, "kind": "CPU"}],  # one instance to hold busy
        dynamic_batching={"default_queue_policy": {"max_queue_size": 1}},  # a queue of one to fill
    )
    (root / "digits" / "1").symlink_to(MODELS / "digits" / "1", target_is_directory=True)
    (root / "digits" / "2").mkdir()  # no artifact: this version fails to load, version 1 serves
    _write_config(root, "idle")
    require_built_models(("minilm",))
    minilm = yaml.safe_load((MODELS / "minilm" / "config.yaml").read_text())
    minilm |= {"warmup": {"batch_sizes": [1]}, "instance_group": [{"count": 1, "kind": "CPU"}],
               # a queue of one to fill, and a deadline that a request held behind a busy instance misses
               "dynamic_batching": {"default_queue_policy": {"max_queue_size": 1,
                                                             "default_timeout_microseconds": 300_000}}}
    (root / "minilm").mkdir()
    (root / "minilm" / "config.yaml").write_text(yaml.safe_dump(minilm))
    (root / "minilm" / "1").symlink_to(MODELS / "minilm" / "1", target_is_directory=True)
    (root / "idle" / "1").symlink_to(MODELS / "digits" / "1", target_is_directory=True)
    _write_config(root, "broken")
    (root / "broken" / "1").mkdir()  # no artifact
    _write_config(root, "badconfig", max_batch_size="many")
    (root / "badconfig" / "1").mkdir()
    return root


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[httpx.AsyncClient, DataPlane]]:
    """The app as `batchline serve` builds it, serving digits, with a small body limit, model
    control on and both tokens set. The client sends the inference token unless told otherwise."""
    shm_folder = tmp_path_factory.mktemp("shm")
    (shm_folder / SHM_OBJECT).write_bytes(bytes(256))
    plane = DataPlane(ModelRepository(repository(tmp_path_factory.mktemp("statuses") / "models")),
                      shared_memory=SystemSharedMemory(allowed=True, folder=str(shm_folder)))
    app = create_app(plane, max_body_bytes=MAX_BODY_BYTES, metrics=CollectorRegistry(), access=ACCESS)
    async with started(plane, ["digits", "minilm"]), client_of(app, dict(AS_CLIENT)) as client:
        assert plane.model_ready("digits", "1"), plane.repository.versions("digits")[0].reason
        assert plane.model_ready("minilm", "1"), plane.repository.versions("minilm")[0].reason
        yield client, plane


@asynccontextmanager
async def started(plane: DataPlane, models: list[str]) -> AsyncIterator[None]:
    """What the app's lifespan does, which ASGITransport does not run: load `models` (until each
    has loaded or failed), and stop the plane at the end."""
    plane.start(models)
    try:
        await until(lambda: all(plane.repository.versions(m) for m in models), f"{models} to load")
        yield
    finally:
        await plane.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def document(served: tuple[httpx.AsyncClient, DataPlane]) -> dict[str, Any]:
    response = await served[0].get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def client_of(app: Any, headers: dict[str, str] | None = None, base_url: str = "http://batchline.test") -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url, headers=headers)


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        await asyncio.sleep(0.01)


# --- checking an answer against the document -----------------------------------------------------


def route_of(document: dict[str, Any], method: str, path: str) -> str:
    """The document's path template that serves `path` (a literal segment wins over a parameter,
    as in the app's routing: /v2/models/stats is not the metadata of a model named "stats")."""
    matches = [
        template
        for template, operations in document["paths"].items()
        if method.lower() in operations
        and re.fullmatch(re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(template)), path)
    ]
    assert matches, f"no operation of the document serves {method} {path}"
    return min(matches, key=lambda template: template.count("{"))


def schema_validator(document: dict[str, Any], name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(
        {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
    )


def check(document: dict[str, Any], method: str, path: str, response: httpx.Response, status: int) -> None:
    """The answer has the expected status, declared for its route, with the declared body."""
    assert response.status_code == status, f"{method} {path}: {response.status_code} {response.text[:300]}"
    route = route_of(document, method, path)
    declared = document["paths"][route][method.lower()]["responses"]
    assert str(status) in declared, f"{method} {route} sends {status}, which the document does not declare"
    media_type = response.headers["content-type"].split(";")[0]
    assert media_type in declared[str(status)]["content"], (method, route, status, media_type)
    if status == 401:
        assert response.headers["www-authenticate"].startswith('Bearer realm="batchline"'), response.headers
        assert "WWW-Authenticate" in declared["401"]["headers"]
    if status >= 400:  # OpenAI's error body under /v1, KServe's elsewhere
        schema_validator(document, "OpenAIError" if path.startswith("/v1/") else "Error").validate(response.json())
    elif route in (INFER, VERSION_INFER):
        header_length = int(response.headers.get(HEADER_LENGTH, len(response.content)))
        schema_validator(document, "InferResponse").validate(orjson.loads(response.content[:header_length]))


# --- the tests ------------------------------------------------------------------------------------


async def send(client: httpx.AsyncClient, probe: Probe) -> httpx.Response:
    """The probe's request with exactly its headers (not the client's defaults)."""
    request = client.build_request(probe.method, probe.path, content=probe.body)
    kept = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in ("authorization", "content-type")]
    request.headers = httpx.Headers([*kept, *probe.sent_headers()])
    return await client.send(request)


@pytest.mark.parametrize("probe", PROBES, ids=str)
async def test_a_route_answers_a_status_its_document_declares(
    served: tuple[httpx.AsyncClient, DataPlane], document: dict[str, Any], probe: Probe
) -> None:
    response = await send(served[0], probe)
    check(document, probe.method, probe.path, response, probe.status)


@pytest.mark.parametrize("probe", OPEN_WITHOUT_A_TOKEN + REFUSED, ids=str)
async def test_the_gate_refuses_what_lacks_the_token_or_the_media_type_its_route_takes(
    served: tuple[httpx.AsyncClient, DataPlane], document: dict[str, Any], probe: Probe
) -> None:
    client, plane = served
    serving = plane.repository.get("digits", "1")
    response = await send(client, probe)
    check(document, probe.method, probe.path, response, probe.status)
    assert plane.repository.get("digits", "1") is serving  # a refused call changed nothing


@pytest.mark.parametrize("path", ["/v2/repository/models/digits/load", "/v2/repository/models/digits/unload"])
async def test_load_and_unload_are_refused_with_403_while_model_control_is_off(
    served: tuple[httpx.AsyncClient, DataPlane], document: dict[str, Any], path: str
) -> None:
    """Off is the default: even a rightful caller is refused, in Triton's words (Triton answers 503)."""
    _, plane = served
    serving = plane.repository.get("digits", "1")
    async with client_of(create_app(plane)) as closed:
        response = await closed.post(path, json={}, headers=dict(AS_ADMIN))
        check(document, "POST", path, response, 403)
        assert "explicit model load / unload is not allowed" in response.json()["error"]
        assert "--model-control" in response.json()["error"]
        index = await closed.post("/v2/repository/index")  # the index stays readable
        assert index.status_code == 200 and {"name": "digits", "version": "1", "state": "READY", "reason": ""} in index.json()
    assert plane.repository.get("digits", "1") is serving


async def test_model_control_without_an_admin_token_takes_only_calls_addressed_to_loopback(
    served: tuple[httpx.AsyncClient, DataPlane], document: dict[str, Any]
) -> None:
    """A page can rebind its own DNS name to 127.0.0.1 and reach a laptop's server, but its
    requests still carry its own name in Host."""
    _, plane = served
    app = create_app(plane, access=AccessPolicy(model_control=True))
    async with client_of(app, base_url="http://attacker.example:8000") as rebound:
        response = await rebound.post(UNLOAD.format(model="idle"), json={})
        check(document, "POST", UNLOAD.format(model="idle"), response, 403)
        assert "localhost" in response.json()["error"]
    for local in ("http://127.0.0.1:8000", "http://localhost", "http://[::1]:8000"):
        async with client_of(app, base_url=local) as client:
            assert (await client.post(UNLOAD.format(model="nope"), json={})).status_code == 404  # past the gate


async def test_readiness_is_503_when_a_model_failed_to_load_and_200_when_all_serve(
    document: dict[str, Any], tmp_path: Path
) -> None:
    _write_config(tmp_path / "failing", "broken")
    (tmp_path / "failing" / "broken" / "1").mkdir()  # no artifact
    failing = DataPlane(ModelRepository(tmp_path / "failing"))
    async with started(failing, ["broken"]), client_of(create_app(failing)) as client:
        check(document, "GET", "/v2/health/ready", await client.get("/v2/health/ready"), 503)

    empty = DataPlane(ModelRepository(tmp_path / "empty"))
    async with started(empty, []), client_of(create_app(empty)) as client:
        await until(empty.server_ready, "an empty repository to load")
        check(document, "GET", "/v2/health/ready", await client.get("/v2/health/ready"), 200)


async def test_liveness_is_503_once_a_model_lost_every_instance_to_a_hung_engine(
    served: tuple[httpx.AsyncClient, DataPlane], document: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The route reads the repository's liveness (how a model gets wedged is tested with the
    watchdog, in tests/unit/test_model_faults.py)."""
    client, plane = served
    check(document, "GET", "/v2/health/live", await client.get("/v2/health/live"), 200)
    monkeypatch.setattr(type(plane.repository.get("digits", "1")), "wedged", property(lambda _: True))
    check(document, "GET", "/v2/health/live", await client.get("/v2/health/live"), 503)


@pytest.mark.parametrize("path", ["/v2/models/digits/infer", "/v2/models/digits/versions/1/infer"])
async def test_a_busy_model_expires_what_waits_too_long_and_refuses_what_it_cannot_queue(
    served: tuple[httpx.AsyncClient, DataPlane], document: dict[str, Any], path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client, plane = served
    model = plane.repository.get("digits", "1")
    engine = model.instances[0].pipeline.engine
    release = threading.Event()
    run = engine.run

    def held(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        release.wait(60)
        return run(feed)

    monkeypatch.setattr(engine, "run", held)
    try:
        running = asyncio.create_task(client.post(path, content=infer_body()))
        await until(lambda: model.batches_in_flight == 1, "a request to hold the only instance")
        expired = await client.post(path, content=infer_body(timeout=20_000))  # microseconds
        check(document, "POST", path, expired, 504)
        queued = asyncio.create_task(client.post(path, content=infer_body()))
        await until(lambda: model.queue_depth == 1, "a request to wait in the queue of one")
        refused = await client.post(path, content=infer_body())
        check(document, "POST", path, refused, 429)
        assert int(refused.headers["Retry-After"]) >= 1
    finally:
        release.set()
    check(document, "POST", path, await running, 200)
    check(document, "POST", path, await queued, 200)


@pytest.mark.parametrize("path", ["/v2/models/digits/infer", "/v2/models/digits/versions/1/infer"])
async def test_an_engine_that_fails_fails_its_requests_with_500(
    served: tuple[httpx.AsyncClient, DataPlane], document: dict[str, Any], path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client, plane = served
    model = plane.repository.get("digits", "1")

    def fail(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise RuntimeError("the accelerator fell off the bus")

    monkeypatch.setattr(model.instances[0].pipeline.engine, "run", fail)
    response = await client.post(path, content=infer_body())
    check(document, "POST", path, response, 500)
    assert "fell off the bus" in response.json()["error"]


async def test_a_busy_embeddings_model_expires_what_waits_too_long_and_refuses_what_it_cannot_queue(
    served: tuple[httpx.AsyncClient, DataPlane], document: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    client, plane = served
    model = plane.repository.get("minilm", "1")
    engine = model.instances[0].pipeline.engine
    release = threading.Event()
    run = engine.run

    def held(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        release.wait(60)
        return run(feed)

    monkeypatch.setattr(engine, "run", held)
    try:
        running = asyncio.create_task(client.post(EMBEDDINGS, content=embeddings_body()))
        await until(lambda: model.batches_in_flight == 1, "a request to hold the only instance")
        expiring = asyncio.create_task(client.post(EMBEDDINGS, content=embeddings_body()))
        await until(lambda: model.queue_depth == 1, "a request to wait in the queue of one")
        refused = await client.post(EMBEDDINGS, content=embeddings_body())
        check(document, "POST", EMBEDDINGS, refused, 429)
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        expired = await expiring  # past the model's 300 ms queue timeout
        check(document, "POST", EMBEDDINGS, expired, 504)
        assert expired.json()["error"]["type"] == "server_error"
    finally:
        release.set()
    late = await running  # held past the queue timeout too: its result came after its deadline
    check(document, "POST", EMBEDDINGS, late, 504)
    assert "after its deadline" in late.json()["error"]["message"]


async def test_an_engine_that_fails_fails_its_embeddings_with_500(
    served: tuple[httpx.AsyncClient, DataPlane], document: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    client, plane = served
    model = plane.repository.get("minilm", "1")

    def fail(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise RuntimeError("the accelerator fell off the bus")

    monkeypatch.setattr(model.instances[0].pipeline.engine, "run", fail)
    response = await client.post(EMBEDDINGS, content=embeddings_body(input=["a", "b"]))
    check(document, "POST", EMBEDDINGS, response, 500)
    assert "fell off the bus" in response.json()["error"]["message"]
    assert response.json()["error"]["type"] == "server_error"


async def test_shared_memory_routes_answer_400_while_clients_may_not_register(tmp_path: Path,
                                                                            document: dict[str, Any]) -> None:
    plane = DataPlane(ModelRepository(tmp_path))  # the default: no client shared memory
    app = create_app(plane, max_body_bytes=MAX_BODY_BYTES, metrics=CollectorRegistry(), access=ACCESS)
    async with client_of(app, dict(AS_CLIENT)) as client:
        for method, route in SHARED_MEMORY_ROUTES:
            path = route.replace("{name}", "r")
            body = orjson.dumps({"key": "/r", "byte_size": 8}) if path.endswith("register") else b""
            response = await client.request(method, path, content=body)
            check(document, method, path, response, 400)
            assert "--allow-client-shm" in response.json()["error"]


@pytest.mark.parametrize("path", ["/v2/models/digits/infer", "/v2/models/digits/versions/1/infer", EMBEDDINGS])
async def test_a_body_that_stops_part_way_is_refused_with_408(
    served: tuple[httpx.AsyncClient, DataPlane], document: dict[str, Any], path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client that stops sending its body (a process frozen mid-upload) gets 408 once no part
    has come for the idle timeout, with Connection: close (that uvicorn closes it: test_door.py)."""
    monkeypatch.setattr(body, "BODY_IDLE_TIMEOUT_S", 0.2)
    stalled = asyncio.Event()

    async def stops_part_way() -> AsyncIterator[bytes]:
        yield b'{"inputs": ['
        stalled.set()
        await asyncio.sleep(30)
        yield b"]}"

    response = await served[0].post(path, content=stops_part_way())
    assert stalled.is_set()
    check(document, "POST", path, response, 408)
    assert response.headers["connection"] == "close"


async def test_every_status_the_document_declares_is_provoked_above(document: dict[str, Any]) -> None:
    declared = {
        (method.upper(), route, int(status))
        for route, operations in document["paths"].items()
        for method, operation in operations.items()
        for status in operation["responses"]
    }
    probes = PROBES + OPEN_WITHOUT_A_TOKEN + REFUSED
    provoked = {(p.method, route_of(document, p.method, p.path), p.status) for p in probes}
    provoked |= READINESS | ON_A_BUSY_OR_FAILING_MODEL | CONTROL_OFF_OR_FOREIGN_HOST | ON_A_BUSY_OR_FAILING_EMBEDDINGS_MODEL
    provoked |= SHARED_MEMORY_OFF | STALLED_BODY
    assert sorted(declared - provoked) == [], "declared, but no test sends it: add a probe"
    assert sorted(provoked - declared) == []
