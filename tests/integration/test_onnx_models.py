"""Tiny ONNX models served over HTTP: graphs of string tensors end to end, NaN and infinities in
JSON tensors, a config that misdescribes its model refused while the others serve, and Triton's
words and platforms."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.integration.conftest import running_server
from tests.unit.onnx_models import (
    DOUBLING_CONFIG,
    FORMAT_NUMBERS_CONFIG,
    PARSE_AND_DOUBLE_CONFIG,
    doubling,
    format_numbers,
    parse_and_double,
    write_model,
)


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("onnx") / "models"
    write_model(root, "parse", PARSE_AND_DOUBLE_CONFIG, parse_and_double)
    write_model(root, "format", FORMAT_NUMBERS_CONFIG, format_numbers)
    write_model(root, "double", DOUBLING_CONFIG, doubling)
    wrong = {**DOUBLING_CONFIG, "outputs": [{"name": "y", "datatype": "FP32", "dims": [3]}]}
    write_model(root, "misdescribed", wrong, doubling)
    with running_server(root, wait_ready=False) as url:  # never ready: one model fails by design
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            index = {e["name"]: e for e in httpx.post(f"{url}/v2/repository/index", json={}).json()}
            if all(index[m].get("state") in ("READY", "UNAVAILABLE") for m in index):
                break
            time.sleep(0.2)
        yield url


@pytest.fixture(scope="module")
def client(server_url: str) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(server_url.removeprefix("http://"))


def test_numbers_sent_as_text_are_parsed_by_the_graph(client: triton.InferenceServerClient) -> None:
    text = triton.InferInput("text", [3, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"2.25"], [b"-1"], [b"1e3"]], dtype=object), binary_data=True)
    result = client.infer("parse", [text])
    assert result.as_numpy("doubled").ravel().tolist() == [4.5, -2.0, 2000.0]
    assert result.as_numpy("doubled_text").ravel().tolist() == [b"4.5", b"-2", b"2000"]


def test_nan_and_infinities_as_json_tensors_both_ways(client: triton.InferenceServerClient) -> None:
    """tritonclient writes a JSON tensor's NaN and infinities as Python's json does, and Triton
    reads them: so does this server (it refused the body with 400), and answers them in kind."""
    x = triton.InferInput("x", [2, 2], "FP32")
    x.set_data_from_numpy(np.array([[np.nan, np.inf], [-np.inf, 1.5]], np.float32), binary_data=False)
    result = client.infer("double", [x], outputs=[triton.InferRequestedOutput("y", binary_data=False)])
    np.testing.assert_array_equal(result.as_numpy("y"), [[np.nan, np.inf], [-np.inf, 3.0]])


def test_string_outputs_as_json(server_url: str) -> None:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 1], "data": [0.5, 3]}]}
    response = httpx.post(f"{server_url}/v2/models/format/infer", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["outputs"] == [
        {"name": "text", "datatype": "BYTES", "shape": [2, 1], "data": ["0.5", "3"]}
    ]


def test_text_that_is_not_utf8_is_refused_at_the_door(client: triton.InferenceServerClient) -> None:
    text = triton.InferInput("text", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"\xff1"]], dtype=object), binary_data=True)
    with pytest.raises(InferenceServerException, match="input 'text' item 0 is not valid UTF-8"):
        client.infer("parse", [text])


def test_a_misdescribed_model_is_unavailable_with_the_reason(server_url: str) -> None:
    index = {e["name"]: e for e in httpx.post(f"{server_url}/v2/repository/index", json={}).json()}
    assert index["misdescribed"]["state"] == "UNAVAILABLE"
    assert (
        "output 'y': the config says FP32 [-1, 3], the model has FP32 [-1, 2]"
        in index["misdescribed"]["reason"]
    )
    assert index["parse"]["state"] == index["format"]["state"] == "READY"
    assert httpx.get(f"{server_url}/v2/models/misdescribed/ready").status_code != 200


def test_unknown_models_and_versions_in_tritons_words(
    server_url: str, client: triton.InferenceServerClient
) -> None:
    response = httpx.get(f"{server_url}/v2/models/nosuchmodel")
    assert response.status_code == 404
    assert response.json() == {"error": "Request for unknown model: 'nosuchmodel' is not found"}
    response = httpx.get(f"{server_url}/v2/models/parse/versions/4")
    assert response.status_code == 404
    assert response.json() == {"error": "Request for unknown model: 'parse' version 4 is not found"}
    with pytest.raises(
        InferenceServerException, match="Request for unknown model: 'nosuchmodel' is not found"
    ):
        client.get_model_metadata("nosuchmodel")


def test_metadata_names_the_platform_of_the_config(client: triton.InferenceServerClient) -> None:
    assert client.get_model_metadata("parse")["platform"] == client.get_model_config("parse")["platform"]
    assert client.get_model_metadata("parse")["platform"] == "onnxruntime_onnx"
