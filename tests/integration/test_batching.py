"""Batching and admission through the real server: concurrent clients, queue bound,
deadlines, priorities and client disconnects.

No sleep stands in for "the server has it by now", and no wall-clock threshold stands in for
"at once": each test keeps the model's one instance busy with a slow request, waits on the
server's own gauges (/metrics: queue depth, batches in flight) for the state it needs, and
proves orders from the server's own record (statistics, the JSON access log, which the server
writes in the order it answers). The one premise, checked where it matters, is that the slow
request outlasts the few requests a test sends behind it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as triton
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from tests.integration.conftest import MODELS, access_log_lines, running_server

SLOW_TEXTS = ["word " * 400] * 32  # seconds of encoder time on a CPU: the instance stays busy meanwhile
BOUNDED = "minilm_bounded"  # one instance, a queue of one, two priority levels
PRIORITY = "minilm_priority"  # one instance, an unbounded queue, two priority levels
WAIT_S = 120.0  # bound of every wait on the server's state: a failure bound, not a speed claim


# --- the server's own state ---------------------------------------------------------------------


def _gauges(url: str, model: str) -> dict[str, float]:
    """One scrape of /metrics (one consistent snapshot): the model's queue depth, batches in
    flight and pending requests."""
    wanted = {"batchline_queue_depth", "batchline_batches_in_flight", "batchline_pending_requests"}
    values = {name: 0.0 for name in wanted}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name in wanted and sample.labels.get("model") == model:
                values[sample.name] = sample.value
    return values


def _wait_until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Poll the server's state until `condition` holds; fail naming `what` if it never does."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        time.sleep(0.02)


def _queued_behind_the_slow_one(url: str, model: str, depth: int) -> Callable[[], bool]:
    """At least `depth` requests wait while a batch runs, in one snapshot. If the slow batch
    ended first, the queue drained and this never holds: the test fails instead of testing
    nothing."""

    def check() -> bool:
        gauges = _gauges(url, model)
        return gauges["batchline_queue_depth"] >= depth and gauges["batchline_batches_in_flight"] >= 1

    return check


def _stats(url: str, model: str = BOUNDED) -> dict:
    return httpx.get(f"{url}/v2/models/{model}/stats", timeout=30).json()["model_stats"][0]




def _answer_order(log: Path, since: int, wanted: dict[str, Callable[[dict], bool]]) -> list[str]:
    """The names of `wanted` (each matching one access-log line after the first `since`) in the
    order the server answered them. A line is written as its answer goes out, possibly just
    after the client has it: this waits until each has one."""
    order: list[str] = []

    def all_logged() -> bool:
        nonlocal order
        lines = access_log_lines(log)[since:]
        order = [name for line in lines for name, match in wanted.items() if match(line)]
        return sorted(order) == sorted(wanted)

    _wait_until(all_logged, f"one access-log line each for {sorted(wanted)}")
    return order


def _request(request_id: str) -> Callable[[dict], bool]:
    return lambda line: line.get("request_id") == request_id


def _body(texts: list[str], request_id: str | None = None, **parameters: object) -> bytes:
    document: dict = {"inputs": [{"name": "text", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}]}
    if request_id is not None:
        document["id"] = request_id
    if parameters:
        document["parameters"] = parameters
    return orjson.dumps(document)


def _post(url: str, body: bytes, model: str = BOUNDED) -> httpx.Response:
    return httpx.post(f"{url}/v2/models/{model}/infer", content=body, timeout=WAIT_S)


class Background:
    """A slow request in a thread; returns once it runs on the model's one instance, so that
    whatever the test sends next has to queue."""

    def __init__(self, url: str, model: str = BOUNDED, request_id: str = "slow") -> None:
        self.response: httpx.Response | None = None
        self._thread = threading.Thread(target=self._run, args=(url, model, request_id))
        self._thread.start()
        _wait_until(lambda: _gauges(url, model)["batchline_batches_in_flight"] >= 1 or not self._thread.is_alive(),
                    "the slow request runs")
        assert self._thread.is_alive(), f"the slow request ended before it was seen running: {self.response}"

    def _run(self, url: str, model: str, request_id: str) -> None:
        self.response = _post(url, _body(SLOW_TEXTS, request_id), model)

    @property
    def answered(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> httpx.Response:
        self._thread.join(WAIT_S)
        assert self.response is not None, "the slow request got no answer"
        return self.response


# --- the default repository: many concurrent clients -------------------------------------------


def _embed(client: triton.InferenceServerClient, sentences: list[str]) -> np.ndarray:
    text = triton.InferInput("text", [len(sentences), 1], "BYTES")
    text.set_data_from_numpy(np.array(sentences, dtype=object).reshape(-1, 1))
    return client.infer("minilm", [text]).as_numpy("embedding")


@pytest.fixture(scope="module")
def batched_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """minilm as shipped, but with the batch cap fixed (the warm-up profile measures a shared
    machine, and this test is about batching, not about what the profile chose) and no bound
    on the queue or its wait."""
    root = tmp_path_factory.mktemp("batched") / "models"
    (root / "minilm").mkdir(parents=True)
    (root / "minilm" / "1").symlink_to(MODELS / "minilm" / "1", target_is_directory=True)
    config = yaml.safe_load((MODELS / "minilm" / "config.yaml").read_text())
    config["warmup"]["batch_cap"] = 16
    # no default deadline: on a slow machine the clients queued behind the slow request must not time out
    config["dynamic_batching"]["default_queue_policy"] = {"default_timeout_microseconds": 0}
    (root / "minilm" / "config.yaml").write_text(yaml.safe_dump(config))
    with running_server(root) as url:
        yield url


def test_concurrent_clients_are_batched_and_each_gets_its_own_answer(batched_url: str) -> None:
    """Clients that arrive while the instance is busy wait together, so they must share
    batches; and each must get the answer to its own sentence, as if it had run alone."""
    host = batched_url.removeprefix("http://")
    sentences = [f"Sentence number {i} about {topic}." for i, topic in enumerate(["cats", "GPUs", "rain", "tea"] * 12)]
    client = triton.InferenceServerClient(host, network_timeout=WAIT_S)
    alone = np.concatenate([_embed(client, [s]) for s in sentences[:8]])  # unbatched reference
    before = _stats(batched_url, "minilm")
    busy = Background(batched_url, "minilm")

    def one(sentence: str) -> np.ndarray:
        return _embed(triton.InferenceServerClient(host, network_timeout=WAIT_S), [sentence])[0]

    with ThreadPoolExecutor(24) as pool:
        answers = pool.map(one, sentences)
        _wait_until(_queued_behind_the_slow_one(batched_url, "minilm", 2), "two clients queue behind the slow request")
        results = np.stack(list(answers))
    assert busy.join().status_code == 200
    after = _stats(batched_url, "minilm")
    np.testing.assert_allclose(results[:8], alone, atol=2e-5)  # padding in a batch changes nothing
    executions = after["execution_count"] - before["execution_count"] - 1  # less the slow request's
    inferences = after["inference_count"] - before["inference_count"] - len(SLOW_TEXTS)
    assert inferences == len(sentences)
    assert executions < inferences, "requests that queued together should share batches"
    assert sum(after["dispatch_reasons"].values()) == after["execution_count"]


# --- a repository with a tightly bounded queue, and one with priorities --------------------------


@dataclass(frozen=True)
class SlowServer:
    url: str
    log: Path  # its output, with the JSON access log


def _variant(root: Path, name: str, max_queue_size: int) -> None:
    """minilm under another name, with two priority levels, a queue of `max_queue_size` (0:
    unbounded) and no default deadline: on a slow machine the requests queued behind the slow
    one must not time out, whatever the shipped config holds. No token budget: the slow request
    must run as one request (past the budget it would run as chunks, each a place in the queue)."""
    model = root / name
    model.mkdir(parents=True)
    (model / "1").symlink_to(MODELS / "minilm" / "1", target_is_directory=True)
    config = yaml.safe_load((MODELS / "minilm" / "config.yaml").read_text())
    config["name"] = name
    config["dynamic_batching"].pop("max_batch_tokens", None)
    config["dynamic_batching"] |= {
        "priority_levels": 2,
        "default_queue_policy": {"max_queue_size": max_queue_size, "default_timeout_microseconds": 0},
    }
    (model / "config.yaml").write_text(yaml.safe_dump(config))


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlowServer]:
    root = tmp_path_factory.mktemp("batching") / "models"
    _variant(root, BOUNDED, 1)
    _variant(root, PRIORITY, 0)
    log = root.parent / "server.log"
    with running_server(root, "--access-log", "json", log_path=log) as url:
        yield SlowServer(url, log)


@pytest.fixture
def slow_url(slow_server: SlowServer) -> str:
    return slow_server.url


def test_a_full_queue_answers_429_at_once(slow_server: SlowServer) -> None:
    """A request that finds the queue full is refused while the instance is still busy: the
    server answers it before the slow request, never holding it until there is room."""
    url = slow_server.url
    before, logged = _stats(url), len(access_log_lines(slow_server.log))
    busy = Background(url, request_id="busy-429")
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(_post, url, _body(["I wait my turn"], "queued-429"))
        _wait_until(_queued_behind_the_slow_one(url, BOUNDED, 1), "the second request queues behind the slow one")
        refused = _post(url, _body(["no room for me"], "refused-429"))
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        assert "full" in refused.json()["error"]
        assert queued.result().status_code == 200
    assert busy.join().status_code == 200
    after = _stats(url)
    assert after["failures"]["queue_full"] == before["failures"].get("queue_full", 0) + 1
    order = _answer_order(slow_server.log, logged, {  # the refusal may come before its body is read: no id
        "busy": _request("busy-429"), "queued": _request("queued-429"), "refused": lambda line: line["status"] == 429})
    assert order[0] == "refused", f"the refusal waited for the busy instance: answered in the order {order}"


def test_a_deadline_that_passes_in_the_queue_is_504_and_never_runs(slow_server: SlowServer) -> None:
    """The deadline, not the end of the slow request, ends the wait: the 504 goes out while the
    slow request still runs, and the expired request never reaches the engine."""
    url = slow_server.url
    before, logged = _stats(url), len(access_log_lines(slow_server.log))
    busy = Background(url, request_id="busy-504")
    client = triton.InferenceServerClient(url.removeprefix("http://"), network_timeout=WAIT_S)
    text = triton.InferInput("text", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([["too late"]], dtype=object))
    with pytest.raises(InferenceServerException, match="deadline") as raised:
        client.infer(BOUNDED, [text], request_id="late-504", timeout=100_000)  # microseconds, as KServe/Triton
    assert raised.value.status() == "504"
    assert busy.join().status_code == 200
    after = _stats(url)
    assert after["failures"]["deadline"] == before["failures"].get("deadline", 0) + 1
    assert after["inference_count"] - before["inference_count"] == len(SLOW_TEXTS)  # only the slow one ran
    order = _answer_order(slow_server.log, logged, {"busy": _request("busy-504"), "late": _request("late-504")})
    assert order == ["late", "busy"], "the 504 waited for the slow request to end"


def test_a_client_that_disconnects_is_dropped_before_compute(slow_url: str) -> None:
    busy = Background(slow_url)
    before = _stats(slow_url)
    body = _body(["nobody will read this answer"])
    host, port = slow_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(
            f"POST /v2/models/{BOUNDED}/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        _wait_until(_queued_behind_the_slow_one(slow_url, BOUNDED, 1), "the request queues behind the slow one")

    def cancelled() -> bool:
        return _stats(slow_url)["failures"].get("cancelled", 0) > before["failures"].get("cancelled", 0)

    # Once the slow request is answered, the instance has taken the queued one if it was still there.
    _wait_until(lambda: cancelled() or busy.answered, "the disconnect is counted or the slow request answered")
    assert cancelled(), "the server did not drop the request of the client that left while it waited"
    assert busy.join().status_code == 200
    after = _stats(slow_url)
    assert after["inference_count"] - before["inference_count"] == len(SLOW_TEXTS)  # it never ran
    assert _gauges(slow_url, BOUNDED)["batchline_pending_requests"] == 0


@pytest.mark.parametrize("parameters", [{"priority": 3}, {"priority": "high"}, {"timeout": -1}, {"timeout": 1.5}])
def test_bad_priority_or_timeout_is_400(slow_url: str, parameters: dict) -> None:
    response = _post(slow_url, _body(["x"], **parameters))
    assert response.status_code == 400, response.text


def test_priority_and_timeout_parameters_are_accepted(slow_url: str) -> None:
    response = _post(slow_url, _body(["fine"], priority=1, timeout=10_000_000))
    assert response.status_code == 200, response.text


def test_a_high_priority_request_queued_last_runs_first(slow_server: SlowServer) -> None:
    """With the one instance busy, two low-priority requests queue, then a high-priority one:
    when the instance frees, the high one runs first, and the server answers it before them.
    Its text falls in another length bucket than theirs, so it cannot share their batch: the
    order of the answers is the order of the batches."""
    url = slow_server.url
    logged = len(access_log_lines(slow_server.log))
    low_text = ["a low priority request with a sentence long enough for a longer length bucket " * 2]
    busy = Background(url, PRIORITY, request_id="busy-priority")
    with ThreadPoolExecutor(3) as pool:
        lows = [pool.submit(_post, url, _body(low_text, f"low-{i}", priority=2), PRIORITY) for i in range(2)]
        _wait_until(_queued_behind_the_slow_one(url, PRIORITY, 2), "the low-priority requests queue")
        high = pool.submit(_post, url, _body(["urgent"], "high", priority=1), PRIORITY)
        _wait_until(_queued_behind_the_slow_one(url, PRIORITY, 3), "the high-priority request queues behind them")
        assert all(f.result().status_code == 200 for f in [*lows, high])
    assert busy.join().status_code == 200
    order = _answer_order(slow_server.log, logged, {name: _request(name) for name in ("low-0", "low-1", "high")})
    assert order[0] == "high", f"answered in the order {order}"


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
