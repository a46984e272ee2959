"""Batching and admission through the real server: concurrent clients, queue bound,
deadlines, priorities and client disconnects."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as triton
import yaml
from tritonclient.utils import InferenceServerException

from tests.integration.conftest import MODELS, running_server

SLOW_TEXTS = ["word " * 400] * 32  # a few seconds of encoder time on this CPU


# --- the default repository: many concurrent clients -------------------------------------------


def _embed(client: triton.InferenceServerClient, sentences: list[str]) -> np.ndarray:
    text = triton.InferInput("text", [len(sentences), 1], "BYTES")
    text.set_data_from_numpy(np.array(sentences, dtype=object).reshape(-1, 1))
    return client.infer("minilm", [text]).as_numpy("embedding")


@pytest.fixture(scope="module")
def batched_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """minilm as shipped, but with the batch cap fixed: the warm-up profile measures a shared
    machine, and this test is about batching, not about what the profile chose."""
    root = tmp_path_factory.mktemp("batched") / "models"
    (root / "minilm").mkdir(parents=True)
    (root / "minilm" / "1").symlink_to(MODELS / "minilm" / "1", target_is_directory=True)
    config = yaml.safe_load((MODELS / "minilm" / "config.yaml").read_text())
    config["warmup"]["batch_cap"] = 16
    (root / "minilm" / "config.yaml").write_text(yaml.safe_dump(config))
    with running_server(root) as url:
        yield url.removeprefix("http://")


def test_concurrent_clients_are_batched_and_each_gets_its_own_answer(batched_host: str) -> None:
    host = batched_host
    sentences = [f"Sentence number {i} about {topic}." for i, topic in enumerate(["cats", "GPUs", "rain", "tea"] * 12)]
    client = triton.InferenceServerClient(host)
    alone = np.concatenate([_embed(client, [s]) for s in sentences[:8]])  # unbatched reference
    before = client.get_inference_statistics("minilm")["model_stats"][0]

    def one(sentence: str) -> np.ndarray:
        return _embed(triton.InferenceServerClient(host), [sentence])[0]

    with ThreadPoolExecutor(24) as pool:
        results = np.stack(list(pool.map(one, sentences)))
    after = client.get_inference_statistics("minilm")["model_stats"][0]
    np.testing.assert_allclose(results[:8], alone, atol=2e-5)  # padding in a batch changes nothing
    executions = after["execution_count"] - before["execution_count"]
    inferences = after["inference_count"] - before["inference_count"]
    assert inferences == len(sentences)
    assert executions < inferences, "concurrent requests should share batches"
    assert sum(after["dispatch_reasons"].values()) == after["execution_count"]


# --- a repository with a tightly bounded queue ------------------------------------------------


@pytest.fixture(scope="module")
def slow_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("batching") / "models"
    model = root / "minilm_bounded"
    model.mkdir(parents=True)
    (model / "1").symlink_to(MODELS / "minilm" / "1", target_is_directory=True)
    config = (MODELS / "minilm" / "config.yaml").read_text().replace("name: minilm", "name: minilm_bounded")
    config = config.replace(
        "dynamic_batching:\n  max_queue_delay_microseconds: 0\n",
        "dynamic_batching:\n  max_queue_delay_microseconds: 0\n  priority_levels: 2\n"
        "  default_queue_policy:\n    max_queue_size: 1\n",
    )
    assert "max_queue_size: 1" in config
    (model / "config.yaml").write_text(config)
    with running_server(root) as url:
        yield url


def _body(texts: list[str], **parameters: object) -> bytes:
    document: dict = {"inputs": [{"name": "text", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}]}
    if parameters:
        document["parameters"] = parameters
    return orjson.dumps(document)


class Background:
    """A slow request in a thread, so the single instance is busy while the test probes."""

    def __init__(self, url: str) -> None:
        self.response: httpx.Response | None = None
        self._thread = threading.Thread(target=self._run, args=(url,))
        self._thread.start()
        deadline = time.monotonic() + 30  # until it runs on the instance: a probe sent sooner could run first
        while not _in_flight(url):
            assert time.monotonic() < deadline and self._thread.is_alive(), "the slow request never ran"
            time.sleep(0.02)

    def _run(self, url: str) -> None:
        self.response = httpx.post(f"{url}/v2/models/minilm_bounded/infer", content=_body(SLOW_TEXTS), timeout=120)

    def join(self) -> httpx.Response:
        self._thread.join(120)
        assert self.response is not None
        return self.response


def _in_flight(url: str) -> bool:
    """Whether a batch of minilm_bounded is running now (the server's own gauge)."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("batchline_batches_in_flight{") and 'model="minilm_bounded"' in line:
            return float(line.rsplit(" ", 1)[1]) >= 1
    return False


def _stats(url: str) -> dict:
    return httpx.get(f"{url}/v2/models/minilm_bounded/stats").json()["model_stats"][0]


def _post(url: str, body: bytes, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v2/models/minilm_bounded/infer", content=body, timeout=timeout)


def test_a_full_queue_answers_429_at_once(slow_url: str) -> None:
    busy = Background(slow_url)
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(_post, slow_url, _body(["I wait my turn"]))
        time.sleep(0.3)
        started = time.perf_counter()
        refused = _post(slow_url, _body(["no room for me"]))
        assert time.perf_counter() - started < 1.0
        assert refused.status_code == 429
        assert int(refused.headers["Retry-After"]) >= 1
        assert "full" in refused.json()["error"]
        assert queued.result().status_code == 200
    assert busy.join().status_code == 200
    assert _stats(slow_url)["failures"]["queue_full"] == 1


def test_a_deadline_that_passes_in_the_queue_is_504_and_never_runs(slow_url: str) -> None:
    busy = Background(slow_url)
    before = _stats(slow_url)
    client = triton.InferenceServerClient(slow_url.removeprefix("http://"))
    text = triton.InferInput("text", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([["too late"]], dtype=object))
    started = time.perf_counter()
    with pytest.raises(InferenceServerException, match="deadline") as raised:
        client.infer("minilm_bounded", [text], timeout=200_000)  # microseconds, as KServe/Triton
    assert time.perf_counter() - started < 2.0  # the deadline, not the slow request, ended the wait
    assert raised.value.status() == "504"
    busy.join()
    after = _stats(slow_url)
    assert after["failures"]["deadline"] == before["failures"].get("deadline", 0) + 1
    assert after["inference_count"] - before["inference_count"] == len(SLOW_TEXTS)  # only the slow one ran


def test_a_client_that_disconnects_is_dropped_before_compute(slow_url: str) -> None:
    busy = Background(slow_url)
    before = _stats(slow_url)
    body = _body(["nobody will read this answer"])
    host, port = slow_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(
            b"POST /v2/models/minilm_bounded/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        time.sleep(0.3)
    busy.join()
    deadline = time.monotonic() + 5
    while _stats(slow_url)["failures"].get("cancelled", 0) == before["failures"].get("cancelled", 0):
        assert time.monotonic() < deadline, "the disconnect was not noticed"
        time.sleep(0.05)
    after = _stats(slow_url)
    assert after["inference_count"] - before["inference_count"] == len(SLOW_TEXTS)


@pytest.mark.parametrize("parameters", [{"priority": 3}, {"priority": "high"}, {"timeout": -1}, {"timeout": 1.5}])
def test_bad_priority_or_timeout_is_400(slow_url: str, parameters: dict) -> None:
    response = _post(slow_url, _body(["x"], **parameters))
    assert response.status_code == 400, response.text


def test_priority_and_timeout_parameters_are_accepted(slow_url: str) -> None:
    response = _post(slow_url, _body(["fine"], priority=1, timeout=10_000_000))
    assert response.status_code == 200, response.text


def test_the_warm_up_profile_is_exported_and_sets_the_cap(host: str) -> None:
    stats = triton.InferenceServerClient(host).get_inference_statistics("minilm")["model_stats"][0]
    profile = stats["batch_profile"]
    assert [p["batch_size"] for p in profile] == [1, 2, 4, 8, 16, 32, 64]
    assert all(p["items_per_second"] > 0 and p["seconds"] > 0 for p in profile)
    best = max(p["items_per_second"] for p in profile)
    cap = stats["batch_cap"]
    chosen = next(p for p in profile if p["batch_size"] == cap)
    assert chosen["items_per_second"] >= 0.95 * best
    assert all(p["items_per_second"] < 0.95 * best for p in profile if p["batch_size"] < cap)
