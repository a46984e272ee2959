"""Health, metadata, configuration and docs endpoints, through tritonclient and httpx."""

from __future__ import annotations

import httpx
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException


@pytest.fixture(scope="module")
def client(host: str) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(host)


def test_health_and_server_metadata(client) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    metadata = client.get_server_metadata()
    assert metadata["name"] == "batchline"
    assert {"binary_tensor_data", "statistics", "model_repository", "model_configuration"} <= set(metadata["extensions"])


@pytest.mark.parametrize("version", ["", "1"])
def test_model_ready(client, version: str) -> None:
    assert client.is_model_ready("minilm", version)
    assert client.is_model_ready("digits", version)


def test_unknown_model_or_version_is_not_ready(server_url, client) -> None:
    assert not client.is_model_ready("nosuchmodel")
    assert httpx.get(f"{server_url}/v2/models/nosuchmodel/ready").status_code == 404
    assert httpx.get(f"{server_url}/v2/models/digits/versions/2/ready").status_code == 404


def test_model_metadata(client) -> None:
    minilm = client.get_model_metadata("minilm")
    assert minilm["name"] == "minilm" and minilm["versions"] == ["1"]
    assert minilm["platform"] == "onnxruntime_onnx"  # as in its config, as Triton says it
    assert minilm["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1, 1]}]
    assert minilm["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}]
    digits = client.get_model_metadata("digits", "1")
    assert digits["inputs"] == [{"name": "image", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
    assert digits["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 10]}]


def test_model_config_is_tritons_json(client) -> None:
    config = client.get_model_config("minilm")
    assert config["max_batch_size"] == 64
    assert config["input"] == [{"name": "text", "data_type": "TYPE_STRING", "dims": [1]}]
    assert config["output"] == [{"name": "embedding", "data_type": "TYPE_FP32", "dims": [384]}]
    assert config["instance_group"][0]["kind"] == "KIND_CPU" and config["instance_group"][0]["count"] == 1
    assert "max_queue_delay_microseconds" in config["dynamic_batching"]
    assert client.get_model_config("digits", "1")["platform"] == "pytorch_libtorch"
    # where the served version runs, in the parameters map tritonclient reads as it is
    from importlib import metadata

    placement = config["parameters"]["placement"]["string_value"]
    assert placement == f"cpu; onnxruntime {metadata.version('onnxruntime')} [CPUExecutionProvider]"
    digits = client.get_model_config("digits")["parameters"]["placement"]["string_value"]
    assert digits.startswith("cpu; torch ") and "[" not in digits


def test_metadata_errors(server_url, client) -> None:
    with pytest.raises(InferenceServerException, match="nosuchmodel"):
        client.get_model_metadata("nosuchmodel")
    response = httpx.get(f"{server_url}/v2/models/digits/versions/7")
    assert response.status_code == 404 and "error" in response.json()
    assert httpx.get(f"{server_url}/v2/models/nosuchmodel/config").status_code == 404
    assert httpx.get(f"{server_url}/v2/nosuchroute").status_code == 404


def test_openapi_docs(server_url) -> None:
    assert httpx.get(f"{server_url}/docs").status_code == 200
    spec = httpx.get(f"{server_url}/openapi.json").json()
    assert "/v2/models/{model}/infer" in spec["paths"]
    assert "requestBody" in spec["paths"]["/v2/models/{model}/infer"]["post"]
