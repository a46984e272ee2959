"""The repository extension and failure isolation, on a scratch repository of its own."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.integration.conftest import running_server

JSON = {"Content-Type": "application/json"}  # load and unload take JSON only; tritonclient sends no type


@pytest.fixture(scope="module")
def scratch_url(scratch_repository: Path) -> Iterator[str]:
    with running_server(scratch_repository, "--model-control", wait_ready=False) as url:  # loopback: no token
        client = triton.InferenceServerClient(url.removeprefix("http://"))
        for _ in range(600):
            states = {e["name"]: e.get("state") for e in client.get_model_repository_index()}
            # every model settled: one's batch profile may wait for another's load, in any order
            if states and all(state in ("READY", "UNAVAILABLE") for state in states.values()):
                break
            time.sleep(0.1)
        yield url


@pytest.fixture(scope="module")
def client(scratch_url: str) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(scratch_url.removeprefix("http://"))


def _digits_infer(client: triton.InferenceServerClient) -> np.ndarray:
    image = triton.InferInput("image", [1, 1, 8, 8], "FP32")
    image.set_data_from_numpy(np.zeros((1, 1, 8, 8), dtype=np.float32))
    return client.infer("digits", [image]).as_numpy("probabilities")


def test_a_broken_model_is_not_ready_and_the_others_serve(scratch_url, client) -> None:
    index = {e["name"]: e for e in client.get_model_repository_index()}
    assert index["digits"]["state"] == "READY"
    assert index["broken"]["state"] == "UNAVAILABLE" and "model.pt2" in index["broken"]["reason"]
    assert index["badconfig"]["state"] == "UNAVAILABLE"
    assert "config.yaml" in index["badconfig"]["reason"] and "max_batch_size" in index["badconfig"]["reason"]
    assert not client.is_model_ready("broken")
    assert not client.is_server_ready()  # strict readiness, as Triton
    assert client.is_server_live()
    assert _digits_infer(client).shape == (1, 10)
    response = httpx.post(f"{scratch_url}/v2/models/broken/infer", json={"inputs": []})
    assert response.status_code in (400, 503)
    image = {"inputs": [{"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [0] * 64}]}
    response = httpx.post(f"{scratch_url}/v2/models/broken/infer", json=image)
    assert response.status_code == 503 and "not ready" in response.json()["error"]


def test_index_ready_filter(scratch_url) -> None:
    ready = httpx.post(f"{scratch_url}/v2/repository/index", json={"ready": True}).json()
    assert sorted({e["name"] for e in ready}) == ["digits", "digits_versions"]
    assert all(e["state"] == "READY" for e in ready)


def test_unload_then_load(scratch_url, client) -> None:
    client.unload_model("digits", headers=JSON)
    assert not client.is_model_ready("digits")
    entry = next(e for e in client.get_model_repository_index() if e["name"] == "digits")
    assert entry["state"] == "UNAVAILABLE" and entry["reason"] == "unloaded"
    with pytest.raises(InferenceServerException, match="not loaded"):
        _digits_infer(client)
    client.load_model("digits", headers=JSON)
    assert client.is_model_ready("digits")
    assert _digits_infer(client).shape == (1, 10)
    assert client.get_inference_statistics("digits")["model_stats"][0]["inference_count"] == 1


def test_load_errors(scratch_url, client) -> None:
    response = httpx.post(f"{scratch_url}/v2/repository/models/nosuchmodel/load", json={})
    assert response.status_code == 404 and "nosuchmodel" in response.json()["error"]
    response = httpx.post(f"{scratch_url}/v2/repository/models/badconfig/load", json={})
    assert response.status_code == 400 and "max_batch_size" in response.json()["error"]
    response = httpx.post(f"{scratch_url}/v2/repository/models/broken/load", json={})
    assert response.status_code == 503 and "model.pt2" in response.json()["error"]
    response = httpx.post(f"{scratch_url}/v2/repository/models/digits/load", json={"parameters": {"config": "{}"}})
    assert response.status_code == 400
    with pytest.raises(InferenceServerException):
        client.load_model("badconfig", headers=JSON)


def test_the_version_policy_picks_what_serves(scratch_url, client) -> None:
    metadata = client.get_model_metadata("digits_versions")
    assert metadata["versions"] == ["1", "3"]
    image = triton.InferInput("image", [1, 1, 8, 8], "FP32")
    image.set_data_from_numpy(np.zeros((1, 1, 8, 8), dtype=np.float32))
    assert client.infer("digits_versions", [image]).get_response()["model_version"] == "3"  # the latest serves
    assert client.infer("digits_versions", [image], model_version="1").get_response()["model_version"] == "1"
    assert not client.is_model_ready("digits_versions", "2")
    response = httpx.post(f"{scratch_url}/v2/models/digits_versions/versions/2/infer",
                          json={"inputs": [{"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [0] * 64}]})
    assert response.status_code == 404
    index = {(e["name"], e.get("version")) for e in client.get_model_repository_index()}
    assert {("digits_versions", "1"), ("digits_versions", "3")} <= index
