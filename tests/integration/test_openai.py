"""OpenAI's /v1 embeddings and models, driven by the official `openai` client against the real
server: the same vectors as KServe v2, lists, base64, Matryoshka dimensions, OpenAI's errors,
the inference token, usage from the tokenizer, and batches shared with v2 requests."""

from __future__ import annotations

import base64
import gzip
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import orjson
import pytest
import yaml
from openai import OpenAI
from tokenizers import Tokenizer

from tests.integration.conftest import MODELS, access_log_lines, linked_repository, running_server

TOKEN = "openai-test-token-5e1d7c9a3b"
MRL = "minilm-mrl"  # minilm under another name, declaring Matryoshka dimensions (for the test only)
NO_GRPC_CLASH = ("--grpc-port", "0")  # two servers at once must not both take gRPC's default port
TEXTS = ["The cat sat on the mat.", "hi", "Batchline batches requests from every front end into one queue.",
         "Embeddings map text to vectors; similar meanings land close together."]


@pytest.fixture(scope="module")
def open_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The shipped digits and minilm, no token: the /v1 routes take any api_key."""
    repository = linked_repository(tmp_path_factory.mktemp("openai-open") / "models")
    with running_server(repository, *NO_GRPC_CLASH) as url:
        yield url


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """minilm-mrl on one instance (so it can be held busy), no profiling (the cap is
    max_batch_size), an inference token and a JSON access log; its URL and its log file."""
    folder = tmp_path_factory.mktemp("openai-guarded")
    root = folder / "models"
    (root / MRL).mkdir(parents=True)
    config = yaml.safe_load((MODELS / "minilm" / "config.yaml").read_text())
    config |= {"name": MRL, "openai": {"task": "embeddings", "matryoshka_dimensions": [128, 256]},
               "warmup": {"batch_sizes": [1]}, "instance_group": [{"count": 1, "kind": "CPU"}]}
    (root / MRL / "config.yaml").write_text(yaml.safe_dump(config))
    (root / MRL / "1").symlink_to(MODELS / "minilm" / "1", target_is_directory=True)
    (folder / "token").write_text(TOKEN + "\n")
    log = folder / "server.log"
    with running_server(root, *NO_GRPC_CLASH, "--inference-token-file", str(folder / "token"),
                        "--access-log", "json", log_path=log) as url:
        yield url, log


def client(url: str, api_key: str = "any key will do") -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=120)


def v2_embeddings(url: str, model: str, texts: list[str], headers: dict[str, str] | None = None) -> np.ndarray:
    body = {"inputs": [{"name": "text", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}]}
    response = httpx.post(f"{url}/v2/models/{model}/infer", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return np.array(response.json()["outputs"][0]["data"], dtype=np.float32).reshape(len(texts), -1)


def vectors(response: Any) -> np.ndarray:
    return np.array([item.embedding for item in response.data], dtype=np.float32)


def openai_error(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_the_openai_client_gets_what_v2_answers_for_the_same_texts(open_url: str) -> None:
    response = client(open_url).embeddings.create(model="minilm", input=TEXTS)  # the client asks for base64
    assert [item.index for item in response.data] == list(range(len(TEXTS)))
    assert response.model == "minilm" and response.object == "list"
    got = vectors(response)
    assert got.shape == (len(TEXTS), 384)
    np.testing.assert_allclose(got, v2_embeddings(open_url, "minilm", TEXTS), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)


def test_a_list_keeps_its_order_and_each_text_is_its_own_embedding(open_url: str) -> None:
    together = vectors(client(open_url).embeddings.create(model="minilm", input=TEXTS, encoding_format="float"))
    for i, text in enumerate(TEXTS):
        alone = client(open_url).embeddings.create(model="minilm", input=text, encoding_format="float")
        assert len(alone.data) == 1
        np.testing.assert_allclose(together[i], vectors(alone)[0], atol=1e-5)


def test_base64_is_the_float_answer_as_little_endian_float32(open_url: str) -> None:
    floats = client(open_url).embeddings.create(model="minilm", input=TEXTS[:2], encoding_format="float")
    encoded = client(open_url).embeddings.create(model="minilm", input=TEXTS[:2], encoding_format="base64")
    for f, b in zip(floats.data, encoded.data, strict=True):
        assert isinstance(b.embedding, str)  # asked for explicitly, the client leaves it as sent
        decoded = np.frombuffer(base64.b64decode(b.embedding), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.array(f.embedding, dtype=np.float32))


def test_usage_is_the_tokenizers_count(open_url: str) -> None:
    tokenizer = Tokenizer.from_file(str(MODELS / "minilm" / "1" / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=256)  # minilm's max_length
    texts = [*TEXTS, "word " * 300]  # the last is truncated: what the model read is what is counted
    expected = sum(len(tokenizer.encode(t).ids) for t in texts)
    usage = client(open_url).embeddings.create(model="minilm", input=texts).usage
    assert usage.prompt_tokens == usage.total_tokens == expected
    assert expected == sum(len(tokenizer.encode(t).ids) for t in TEXTS) + 256


def test_models_lists_the_embedding_models_that_serve(open_url: str) -> None:
    listing = client(open_url).models.list()
    assert [m.id for m in listing.data] == ["minilm"]  # digits serves too, but declares no OpenAI task
    model = client(open_url).models.retrieve("minilm")
    assert (model.id, model.object, model.owned_by) == ("minilm", "model", "batchline") and model.created > 0
    for name in ("digits", "nope"):
        with pytest.raises(openai.NotFoundError) as caught:
            client(open_url).models.retrieve(name)
        assert openai_error(caught.value)["code"] == "model_not_found"


def test_an_unknown_model_or_one_without_embeddings_is_openais_404(open_url: str) -> None:
    for name in ("nope", "digits"):
        with pytest.raises(openai.NotFoundError) as caught:
            client(open_url).embeddings.create(model=name, input="hello")
        error = openai_error(caught.value)
        assert (error["type"], error["code"]) == ("invalid_request_error", "model_not_found")
        assert name in error["message"]


def test_a_compressed_body_is_refused_in_words_not_as_broken_json(open_url: str) -> None:
    body = gzip.compress(orjson.dumps({"model": "minilm", "input": "hello"}))
    answer = httpx.post(f"{open_url}/v1/embeddings", content=body,
                        headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert answer.status_code == 400, answer.text
    assert "Content-Encoding 'gzip' is not taken on /v1/embeddings" in answer.json()["error"]["message"]


@pytest.mark.parametrize(
    ("request_", "param", "words"),
    [
        ({"input": ""}, "input", "empty string"),
        ({"input": ["ok", ""]}, "input", "input[1] is an empty string"),
        ({"input": []}, "input", "empty list"),
        ({"input": [101, 7592, 102]}, "input", "token ids are not supported"),
        ({"input": ["x"] * 2049}, "input", "at most 2048"),
        ({"input": "hello", "dimensions": 128}, "dimensions", "not Matryoshka-trained"),
        ({"input": "hello", "extra_body": {"truncate": True}}, "truncate", "unrecognized request argument"),
    ],
)
def test_a_bad_request_is_openais_400_naming_the_field(
    open_url: str, request_: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(open_url).embeddings.create(model="minilm", **request_)
    error = openai_error(caught.value)
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert words in error["message"], error["message"]


def test_matryoshka_dimensions_are_the_prefix_renormalized(guarded: tuple[str, Path]) -> None:
    url, _ = guarded
    full = vectors(client(url, TOKEN).embeddings.create(model=MRL, input=TEXTS, encoding_format="float"))
    for size in (128, 256):
        short = vectors(client(url, TOKEN).embeddings.create(model=MRL, input=TEXTS, dimensions=size))
        assert short.shape == (len(TEXTS), size)
        np.testing.assert_allclose(np.linalg.norm(short, axis=1), 1.0, rtol=1e-5)
        prefix = full[:, :size] / np.linalg.norm(full[:, :size], axis=1, keepdims=True)
        np.testing.assert_allclose(short, prefix, atol=1e-5)
    assert vectors(client(url, TOKEN).embeddings.create(model=MRL, input="x", dimensions=384)).shape == (1, 384)
    with pytest.raises(openai.BadRequestError) as caught:
        client(url, TOKEN).embeddings.create(model=MRL, input="x", dimensions=200)
    assert openai_error(caught.value)["message"] == f"model '{MRL}' serves 'dimensions' 128, 256, 384, not 200"


def test_the_inference_token_is_the_api_key(guarded: tuple[str, Path]) -> None:
    url, _ = guarded
    assert client(url, TOKEN).embeddings.create(model=MRL, input="hello").data
    for call in (lambda c: c.embeddings.create(model=MRL, input="hello"), lambda c: c.models.list()):
        with pytest.raises(openai.AuthenticationError) as caught:
            call(client(url, "not-the-token-at-all"))
        error = openai_error(caught.value)
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
        assert 'error="invalid_token"' in caught.value.response.headers["www-authenticate"]
    bare = httpx.post(f"{url}/v1/embeddings", json={"model": MRL, "input": "hello"})
    assert bare.status_code == 401 and "needs the inference token" in bare.json()["error"]["message"]


def stats(url: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/v2/models/{MRL}/stats", headers={"Authorization": f"Bearer {TOKEN}"})
    return response.json()["model_stats"][0]


def batches_of(statistics: dict[str, Any], size: int) -> int:
    return next((b["compute_infer"]["count"] for b in statistics["batch_stats"] if b["batch_size"] == size), 0)


def gauge(url: str, name: str) -> float:
    """A gauge of MRL's, as /metrics shows it now."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"{name}{{") and f'model="{MRL}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def in_flight(url: str) -> float:
    return gauge(url, "batchline_batches_in_flight")


def test_openai_and_v2_requests_share_a_batch_and_the_models_statistics(guarded: tuple[str, Path]) -> None:
    """The only instance is held by a long v2 batch (8 texts at 256 tokens: the token budget,
    one batch); one v2 and one OpenAI request for the same text queue behind it and leave
    together, as one batch of 2."""
    url, log = guarded
    auth = {"Authorization": f"Bearer {TOKEN}"}
    before = stats(url)
    long_texts = ["a long sentence about batching, queues and the cost of padding " * 20] * 8
    results: dict[str, Any] = {}
    hold = threading.Thread(target=lambda: results.update(hold=v2_embeddings(url, MRL, long_texts, auth)))
    hold.start()
    deadline = time.monotonic() + 60
    while in_flight(url) < 1:
        assert time.monotonic() < deadline and hold.is_alive(), "the long batch never ran"
        time.sleep(0.005)
    text = "a text sent over both protocols"
    v2 = threading.Thread(target=lambda: results.update(v2=v2_embeddings(url, MRL, [text], auth)))
    via_openai = threading.Thread(target=lambda: results.update(
        openai=vectors(client(url, TOKEN).embeddings.create(model=MRL, input=text, encoding_format="float"))))
    v2.start()
    via_openai.start()
    for thread in (hold, v2, via_openai):
        thread.join(120)
    assert not any(t.is_alive() for t in (hold, v2, via_openai)), "a call did not finish in 120 s"
    after = stats(url)
    assert batches_of(after, 2) - batches_of(before, 2) == 1, after["batch_stats"]
    assert after["execution_count"] - before["execution_count"] == 2  # the held batch, then the pair
    assert after["inference_count"] - before["inference_count"] == 8 + 2
    np.testing.assert_allclose(results["openai"], results["v2"], atol=1e-6)  # one batch: the same padding
    deadline = time.monotonic() + 5
    while '"/v1/embeddings"' not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    logged = [line for line in access_log_lines(log) if line["path"] == "/v1/embeddings" and line["status"] == 200]
    assert logged and logged[-1]["model"] == MRL and logged[-1]["version"] == 1
    assert logged[-1]["queue_ms"] > 0 and logged[-1]["compute_ms"] > 0


def test_a_client_that_leaves_has_its_texts_dropped_before_compute(guarded: tuple[str, Path]) -> None:
    """The only instance is held by a long v2 batch; an embeddings call queues behind it and its
    client disconnects: the texts never run, and the model counts the call as cancelled."""
    url, _ = guarded
    auth = {"Authorization": f"Bearer {TOKEN}"}
    before = stats(url)
    long_texts = ["a long sentence about batching, queues and the cost of padding " * 6] * 64
    hold = threading.Thread(target=lambda: v2_embeddings(url, MRL, long_texts, auth))
    hold.start()
    deadline = time.monotonic() + 60
    while in_flight(url) < 1:
        assert time.monotonic() < deadline and hold.is_alive(), "the long batch never ran"
        time.sleep(0.005)
    body = orjson.dumps({"model": MRL, "input": "nobody will read these numbers"})
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        while gauge(url, "batchline_queue_depth") < 1:
            assert time.monotonic() < deadline and hold.is_alive(), "the call never queued"
            time.sleep(0.005)

    def cancelled() -> int:
        return stats(url)["failures"].get("cancelled", 0) - before["failures"].get("cancelled", 0)

    while not cancelled() and hold.is_alive():
        time.sleep(0.01)
    hold.join(120)
    assert cancelled() == 1, "the server did not drop the texts of the client that left"
    after = stats(url)
    assert after["inference_count"] - before["inference_count"] == 64  # the held batch alone ran


@pytest.fixture(scope="module")
def short_timeout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """minilm on one instance of one thread with a 5 s timeout, batches of 16 at most (no
    profiling) and a JSON access log: a list of 1,024 long texts takes it many times that (about
    0.4 s a batch of 16), on a machine of any number of cores."""
    folder = tmp_path_factory.mktemp("openai-short-timeout")
    root = folder / "models"
    (root / "minilm").mkdir(parents=True)
    config = yaml.safe_load((MODELS / "minilm" / "config.yaml").read_text())
    config["dynamic_batching"]["default_queue_policy"]["default_timeout_microseconds"] = 5_000_000
    config |= {"max_batch_size": 16, "warmup": {"batch_sizes": [1]}, "instance_group": [{"count": 1, "kind": "CPU"}]}
    (root / "minilm" / "config.yaml").write_text(yaml.safe_dump(config))
    (root / "minilm" / "1").symlink_to(MODELS / "minilm" / "1", target_is_directory=True)
    log = folder / "server.log"
    with running_server(root, *NO_GRPC_CLASH, "--engine-threads", "1", "--access-log", "json", log_path=log) as url:
        yield url, log


def test_a_list_too_long_for_the_models_timeout_is_not_retried_by_the_client(
    short_timeout: tuple[str, Path],
) -> None:
    """Its first parts are computed, then its deadline passes: 504, and the official client, which
    retries a 5xx twice by default, sends it once (x-should-retry: false), told in words why."""
    url, log = short_timeout
    texts = [f"text {i}: a long sentence about batching, queues and the cost of padding " * 8 for i in range(1024)]
    retrying = OpenAI(base_url=f"{url}/v1", api_key="any", max_retries=2, timeout=120)
    with pytest.raises(openai.InternalServerError) as caught:
        retrying.embeddings.create(model="minilm", input=texts)
    error = openai_error(caught.value)
    assert (caught.value.status_code, caught.value.response.headers.get("x-should-retry")) == (504, "false"), error
    assert (error["type"], error["code"]) == ("server_error", "timeout")
    assert "more than its timeout allows: send fewer items a request" in error["message"], error["message"]
    calls = [line for line in access_log_lines(log) if line.get("path") == "/v1/embeddings"]
    assert len(calls) == 1, calls
