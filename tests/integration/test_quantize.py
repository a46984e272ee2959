"""A quantized variant served by the real server: built into a scratch repository beside its
FP32 source, loaded by `batchline serve`, and answering over HTTP within the quality gate."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from server.config import load_model_config
from server.quantize.api import build
from server.quantize.data import load_eval_data
from server.quantize.quality import cosines, nearest_neighbours
from tests.integration.conftest import MODELS, linked_repository, running_server

pytestmark = pytest.mark.integration
VARIANT = "minilm-onnxruntime-int8"
DIGITS = "digits-onnxruntime-int8"


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = linked_repository(tmp_path_factory.mktemp("served") / "models")
    for model in ("minilm", "digits"):
        report = build(root, model, "onnxruntime", "int8", benchmark=False, progress=lambda m: None)
        assert report.servable, report.quality
    return root


@pytest.fixture(scope="module")
def url(repository: Path) -> Iterator[str]:
    with running_server(repository) as base:
        yield base


def infer_text(url: str, model: str, texts: list[str]) -> np.ndarray:
    body = {"inputs": [{"name": "text", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}]}
    response = httpx.post(f"{url}/v2/models/{model}/infer", json=body, timeout=60)
    response.raise_for_status()
    output = response.json()["outputs"][0]
    return np.asarray(output["data"], dtype=np.float32).reshape(output["shape"])


def test_the_variant_is_listed_and_ready(url: str) -> None:
    index = {e["name"]: e for e in httpx.post(f"{url}/v2/repository/index", json={}).json()}
    assert index[VARIANT]["state"] == "READY" and index[VARIANT]["version"] == "1"
    assert httpx.get(f"{url}/v2/models/{VARIANT}/ready").status_code == 200


def test_served_int8_embeddings_stay_within_the_gate(url: str) -> None:
    data = load_eval_data(MODELS / "minilm", MODELS / "minilm" / "1", load_model_config(MODELS / "minilm" / "config.yaml"))
    sentences = data.sentences
    fp32 = np.concatenate([infer_text(url, "minilm", sentences[i : i + 16]) for i in range(0, len(sentences), 16)])
    int8 = np.concatenate([infer_text(url, VARIANT, sentences[i : i + 16]) for i in range(0, len(sentences), 16)])
    cos = cosines(fp32, int8)
    assert cos.mean() >= 0.99
    assert (nearest_neighbours(fp32) == nearest_neighbours(int8)).mean() >= 0.94
    assert not np.array_equal(fp32, int8)  # really two different models answered


def test_served_int8_digits_keep_accuracy(url: str) -> None:
    with np.load(MODELS / "digits" / "1" / "heldout.npz") as held:
        images, labels = held["images"], held["labels"]
    accuracy = {}
    for model in ("digits", DIGITS):
        parts = []
        for start in range(0, len(labels), 120):  # within max_batch_size
            chunk = images[start : start + 120]
            body = {"inputs": [{"name": "image", "shape": list(chunk.shape), "datatype": "FP32",
                                "data": chunk.ravel().tolist()}]}
            response = httpx.post(f"{url}/v2/models/{model}/infer", json=body, timeout=60)
            response.raise_for_status()
            parts.append(np.asarray(response.json()["outputs"][0]["data"]).reshape(len(chunk), 10))
        accuracy[model] = (np.concatenate(parts).argmax(1) == labels).mean()
    assert accuracy[DIGITS] >= 0.99 * accuracy["digits"]
