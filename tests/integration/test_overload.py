"""The real server past its means. Past its in-flight cap: requests whose bodies are still
arriving fill it, a flood beyond it is answered 429 at once (never 500), the held ones then
complete, a refused request's connection stays usable, and the server stays live. At three times
its measured capacity, open loop: it refuses the excess fast, keeps serving about its capacity
within each request's deadline, keeps its memory bounded, and stays up."""

from __future__ import annotations

import http.client
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import orjson
import pytest

from loadtest import overload, payloads
from tests.integration.conftest import linked_repository, require_tool, running_server
from tests.unit.onnx_models import SLOW_CLASSIFIER_CONFIG, slow_classifier, write_model

CAP = 4


def body(value: float) -> bytes:
    image = [[[value] * 8] * 8]
    return orjson.dumps({"id": str(value), "inputs": [{"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32",
                                                       "data": [image]}]})


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    repository = linked_repository(tmp_path_factory.mktemp("overload") / "models", ("digits",))
    with running_server(repository, "--max-in-flight", str(CAP)) as base:
        yield base


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def post(url: str, payload: bytes, connection: http.client.HTTPConnection | None = None) -> tuple[int, dict[str, str], bytes, float]:
    own = connection or http.client.HTTPConnection("127.0.0.1", port_of(url), timeout=30)
    start = time.perf_counter()
    own.request("POST", "/v2/models/digits/infer", payload, {"content-type": "application/json"})
    response = own.getresponse()
    data = response.read()
    elapsed = time.perf_counter() - start
    if connection is None:
        own.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, data, elapsed


def half_sent(url: str, payload: bytes) -> socket.socket:
    """A request whose headers and first half of the body are sent: in flight until the rest comes."""
    sock = socket.create_connection(("127.0.0.1", port_of(url)), timeout=30)
    head = (f"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    sock.sendall(head + payload[: len(payload) // 2])
    return sock


def finish(sock: socket.socket, payload: bytes) -> int:
    sock.sendall(payload[len(payload) // 2:])
    response = http.client.HTTPResponse(sock)
    response.begin()
    response.read()
    sock.close()
    return response.status


def test_a_flood_past_the_in_flight_cap_is_refused_fast_and_the_held_requests_complete(url: str) -> None:
    payloads = [body(float(i)) for i in range(CAP)]
    held = [half_sent(url, p) for p in payloads]
    deadline = time.monotonic() + 30
    while post(url, body(9.0))[0] != 429:  # the server has taken all CAP requests in
        assert time.monotonic() < deadline, "the held requests never filled the in-flight cap"
        time.sleep(0.01)
    reused = http.client.HTTPConnection("127.0.0.1", port_of(url), timeout=30)
    status, headers, _, _ = post(url, body(9.0), reused)
    assert status == 429 and headers["retry-after"] == "1"
    with ThreadPoolExecutor(32) as pool:
        flood = list(pool.map(lambda i: post(url, body(float(i))), range(128)))
    statuses = {s for s, *_ in flood}
    assert statuses == {429}, statuses
    slowest = max(elapsed for *_, elapsed in flood)
    assert slowest < 5, f"a refusal took {slowest:.2f} s"
    assert [finish(sock, p) for sock, p in zip(held, payloads)] == [200] * CAP
    # the refused request's body was drained: its connection serves the next request
    status, _, data, _ = post(url, body(1.0), reused)
    assert status == 200 and orjson.loads(data)["id"] == "1.0"
    reused.close()
    with ThreadPoolExecutor(16) as pool:
        mixed = list(pool.map(lambda i: post(url, body(float(i))), range(64)))
    assert {s for s, *_ in mixed} <= {200, 429}
    for status, _, data, _ in mixed:
        if status == 200:
            assert len(orjson.loads(data)["outputs"][0]["data"]) == 10
    live = http.client.HTTPConnection("127.0.0.1", port_of(url), timeout=10)
    live.request("GET", "/v2/health/live")
    assert live.getresponse().status == 200


def test_shipped_configs_bound_their_queues() -> None:
    """Every shipped model refuses past a queue bound and expires what waits too long."""
    import yaml

    for config in sorted(Path(__file__).resolve().parents[2].glob("models/*/config.yaml")):
        policy = yaml.safe_load(config.read_text())["dynamic_batching"]["default_queue_policy"]
        assert policy["max_queue_size"] > 0 and policy["default_timeout_microseconds"] > 0, config


# The guarantees the overload test holds the server to (docs/operations.md states them).
FACTOR = 3.0
DEADLINE_MS = 2000.0
QUEUE = 32  # drained in a fraction of DEADLINE_MS at the model's capacity (~100-150 req/s here)
LEAST_BUSY_FRACTION = 0.9  # the instance kept running batches while the excess was refused ...
LEAST_BATCH_FILL = 0.9  # ... full ones (items per execution over max_batch_size)
# Accepted throughput over the capacity wrk found: about 1 on a quiet machine; beside a CPU hog
# 0.78-0.95 was seen (the open-loop client and 3x the HTTP work take cores from the engine).
LEAST_SHARE_OF_CAPACITY = 0.6
MOST_RSS_GROWTH_MIB = 64.0  # peak resident memory during the overload over the idle server's


@pytest.mark.integration
def test_three_times_capacity_open_loop_is_refused_fast_and_served_at_capacity(tmp_path: Path) -> None:
    """A model whose cost is compute (as on a GPU, where HTTP is cheap beside the model), so that
    what is measured is the server's shedding, not the machine's share of cores: on this model a
    refusal costs the server about 1% of a served request."""
    require_tool("wrk", "wrk")  # the capacity is wrk's closed-loop rate, as `batchline bench overload` finds it
    root = tmp_path / "models"
    folder = write_model(root, "digits", {**SLOW_CLASSIFIER_CONFIG, "dynamic_batching": {"default_queue_policy": {
        "max_queue_size": QUEUE, "default_timeout_microseconds": 30_000_000}}}, slow_classifier)
    images = np.random.default_rng(0).uniform(0, 16, (64, 1, 8, 8)).astype(np.float32)
    np.savez(folder / "1" / "heldout.npz", images=images)  # the bench's digits bodies come from here
    requests = [overload.with_deadline(r, DEADLINE_MS)
                for r in payloads.build_requests("digits", 1, False, 16, repository=root)]
    with running_server(root, "--engine-threads", "1") as url:
        pid = overload.listening_pid(port_of(url))
        assert pid is not None
        capacity = overload.measure_capacity(url, requests, 16, 4.0, 10.0, None, tmp_path / "wrk")["req_s"]
        held = overload.hold(url, requests, capacity, FACTOR, 8.0, deadline_ms=DEADLINE_MS, connections=256,
                             timeout_s=10.0, settle_s=1.0, pid=pid)
    result = held.result
    figures = orjson.dumps({k: result[k] for k in ("capacity_req_s", "offered_req_s", "accepted_req_s", "counts",
                                                   "latency_ms", "rss_mib", "client_send_lag_ms")}).decode()
    signals = result["server_signals"]
    figures += f"; server: busy {signals['busy_fraction']}, items per execution {signals['stats']['items_per_execution']}"
    assert result["offered_factor"] >= 0.85 * FACTOR, f"the client did not offer {FACTOR}x: {figures}"
    assert result["live_after"] and result["server_alive_after"], figures
    assert result["counts"]["other_errors"] == 0, (result["first_errors"], figures)
    assert result["unsent"] == 0 and result["cut_by_the_drain"] == 0, figures  # every request answered
    assert result["shares"]["refused_429"] >= 0.5, f"the excess was not refused: {figures}"
    latency = result["latency_ms"]
    assert latency["refused_429"]["p99"] < latency["accepted"]["p50"], f"refusals are not fast: {figures}"
    assert result["accepted_after_deadline"] == 0, f"accepted answers came after their deadline: {figures}"
    assert signals["busy_fraction"] >= LEAST_BUSY_FRACTION, f"the instance idled while requests were refused: {figures}"
    fill = signals["stats"]["items_per_execution"] / SLOW_CLASSIFIER_CONFIG["max_batch_size"]
    assert fill >= LEAST_BATCH_FILL, f"batches ran part-empty under overload: {figures}"
    assert result["accepted_share_of_capacity"] >= LEAST_SHARE_OF_CAPACITY, f"throughput collapsed: {figures}"
    assert result["rss_mib"]["peak_over_idle"] <= MOST_RSS_GROWTH_MIB, f"memory grew: {figures}"
