"""The access gate on the real server, driven by tritonclient as users drive it: the inference
token on data routes (JSON, binary and compressed infer bodies, which tritonclient sends without
a Content-Type), the admin token and JSON on load and unload, health and metrics open, and model
control off by default."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.integration.conftest import linked_repository, running_server

ADMIN_TOKEN = "integration-admin-5d1c7a9e3b"
INFERENCE_TOKEN = "integration-inference-8e2f4a6c0d"


# Functions, not constants: tritonclient adds Inference-Header-Content-Length to the dict it is given.
def as_client() -> dict[str, str]:
    return {"Authorization": f"Bearer {INFERENCE_TOKEN}"}


def as_admin(json: bool = True) -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"} | ({"Content-Type": "application/json"} if json else {})


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return linked_repository(tmp_path_factory.mktemp("control") / "models", ("digits",))


@pytest.fixture(scope="module")
def guarded(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """digits, model control on, both tokens read from files of mode 0600."""
    secrets = tmp_path_factory.mktemp("secrets")
    for name, token in (("admin", ADMIN_TOKEN), ("inference", INFERENCE_TOKEN)):
        (secrets / name).write_text(token + "\n")
        (secrets / name).chmod(0o600)
    flags = ("--model-control", "--admin-token-file", str(secrets / "admin"),
             "--inference-token-file", str(secrets / "inference"), "--model", "digits")
    with running_server(repository, *flags) as url:
        yield url


def image(binary: bool) -> triton.InferInput:
    tensor = triton.InferInput("image", [1, 1, 8, 8], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 1, 8, 8), dtype=np.float32), binary_data=binary)
    return tensor


@pytest.mark.parametrize(("binary", "compression"), [(True, None), (False, None), (True, "gzip"), (False, "deflate")])
def test_tritonclient_infers_with_the_inference_token(guarded: str, binary: bool, compression: str | None) -> None:
    client = triton.InferenceServerClient(guarded.removeprefix("http://"))
    result = client.infer("digits", [image(binary)], headers=as_client(), request_compression_algorithm=compression)
    assert result.as_numpy("probabilities").shape == (1, 10)
    with pytest.raises(InferenceServerException, match="needs the inference token"):
        client.infer("digits", [image(binary)], request_compression_algorithm=compression)


def test_every_data_route_takes_the_inference_token_and_health_and_metrics_need_none(guarded: str) -> None:
    client = triton.InferenceServerClient(guarded.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready()  # what kubelet probes, bare
    assert client.get_server_metadata(headers=as_client())["name"] == "batchline"
    assert client.get_model_metadata("digits", headers=as_client())["versions"] == ["1"]
    assert client.is_model_ready("digits", headers=as_client())
    assert client.get_model_config("digits", headers=as_client())["name"] == "digits"
    assert client.get_inference_statistics("digits", headers=as_client())["model_stats"]
    assert {e["name"] for e in client.get_model_repository_index(headers=as_client())} == {"digits"}
    for call in (client.get_server_metadata, client.get_model_repository_index):
        with pytest.raises(InferenceServerException, match="needs the inference token"):
            call()
    wrong = httpx.get(f"{guarded}/v2/models/digits", headers={"Authorization": "Bearer not-it-not-it-not-it"})
    assert wrong.status_code == 401 and 'error="invalid_token"' in wrong.headers["www-authenticate"]
    assert httpx.get(f"{guarded}/metrics").status_code == 200  # what Prometheus scrapes, bare


def test_load_and_unload_take_the_admin_token_and_json_only(guarded: str) -> None:
    """Readiness after an unload follows Triton's strict readiness, which skips a model unloaded
    on purpose: the server stays ready, the model does not."""
    client = triton.InferenceServerClient(guarded.removeprefix("http://"))
    unload = f"{guarded}/v2/repository/models/digits/unload"
    refused = {
        "no token": httpx.post(unload, json={}),
        "the inference token": httpx.post(unload, json={}, headers=as_client()),
        "a form": httpx.post(unload, data={"model": "digits"}, headers=as_admin(json=False)),
    }
    assert {what: r.status_code for what, r in refused.items()} == {"no token": 401, "the inference token": 401,
                                                                     "a form": 415}
    with pytest.raises(InferenceServerException, match="Content-Type: application/json"):
        client.unload_model("digits", headers=as_admin(json=False))  # tritonclient sends none
    assert client.is_model_ready("digits", headers=as_client())

    client.unload_model("digits", headers=as_admin())
    assert not client.is_model_ready("digits", headers=as_client())
    assert client.is_server_ready()  # as Triton: an unloaded model does not count against readiness
    entry = client.get_model_repository_index(headers=as_client())[0]
    assert (entry["state"], entry["reason"]) == ("UNAVAILABLE", "unloaded")
    client.load_model("digits", headers=as_admin())
    assert client.is_model_ready("digits", headers=as_client())
    assert client.infer("digits", [image(True)], headers=as_admin()).as_numpy("probabilities").shape == (1, 10)


def test_model_control_is_off_by_default(repository: Path) -> None:
    with running_server(repository, "--model", "digits") as url:
        client = triton.InferenceServerClient(url.removeprefix("http://"))
        for change in (client.load_model, client.unload_model):
            with pytest.raises(InferenceServerException, match="explicit model load / unload is not allowed"):
                change("digits", headers={"Content-Type": "application/json"})
        response = httpx.post(f"{url}/v2/repository/models/digits/unload", json={})
        assert response.status_code == 403 and "--model-control" in response.json()["error"]
        assert client.is_model_ready("digits")
        assert client.get_model_repository_index()[0]["state"] == "READY"  # the index stays readable
