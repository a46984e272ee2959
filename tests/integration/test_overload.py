"""The real server past its in-flight cap: requests whose bodies are still arriving fill it, a
flood beyond it is answered 429 at once (never 500), the held ones then complete, a refused
request's connection stays usable, and the server stays live."""

from __future__ import annotations

import http.client
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
import pytest

from tests.integration.conftest import linked_repository, running_server

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
