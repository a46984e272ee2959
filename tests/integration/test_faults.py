"""Reloads on the real server, with a repository of tiny ONNX models of its own: a new version
folder taken over under load fails no request (the old version drains, the new one warms up
before it takes traffic), and a reload whose new version cannot load keeps the old one serving.

Hangs and memory faults cannot be injected into another process deterministically; they are
tested at the model and instance level (tests/unit/test_model_faults.py, workers/, scheduler/)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import running_server
from tests.unit.onnx_models import DOUBLING_CONFIG, doubling, write_model

pytestmark = pytest.mark.integration

WAIT_S = 60
CLIENTS = 4
CONFIG = {**DOUBLING_CONFIG, "dynamic_batching": {"max_queue_delay_microseconds": 500}}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("faults") / "models"
    for name in ("reloaded", "kept"):
        write_model(root, name, CONFIG, doubling)
    log = tmp_path_factory.mktemp("faults-log") / "server.log"
    with running_server(root, "--engine-threads", "1", "--model-control", log_path=log) as url:  # loopback: no token
        yield url, root


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    """Wait on the test's or the server's own state, bounded; fail with `what`."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {WAIT_S} s waiting until {what}")
        time.sleep(0.01)


def body(value: float) -> dict[str, object]:
    return {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [value, value]}]}


class Client(threading.Thread):
    """Calls the model back to back until told to stop; keeps every (status, version, error)."""

    def __init__(self, url: str, model: str, value: float, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self._url, self._model, self._value, self._halt = url, model, value, stop
        self.answers: list[tuple[int, str, str]] = []

    def run(self) -> None:
        with httpx.Client(base_url=self._url, timeout=WAIT_S) as http:
            while not self._halt.is_set():
                try:
                    response = http.post(f"/v2/models/{self._model}/infer", json=body(self._value))
                    document = response.json()
                except (httpx.HTTPError, ValueError) as exc:  # counted as a failure, never lost
                    self.answers.append((-1, "", repr(exc)))
                    continue
                status, error = response.status_code, document.get("error", "")
                if status == 200 and document["outputs"][0]["data"] != [2 * self._value, 2 * self._value]:
                    status, error = -1, f"wrong result {document['outputs'][0]['data']}"
                self.answers.append((status, document.get("model_version", ""), error))

    def versions(self) -> list[str]:
        return [version for _, version, _ in self.answers]


class ReadinessProbe(threading.Thread):
    """Asks whether the model is ready, again and again, as a load balancer would."""

    def __init__(self, url: str, model: str, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self._url, self._model, self._halt = url, model, stop
        self.statuses: list[int] = []

    def run(self) -> None:
        with httpx.Client(base_url=self._url, timeout=WAIT_S) as http:
            while not self._halt.is_set():
                self.statuses.append(http.get(f"/v2/models/{self._model}/ready").status_code)


def index(url: str, model: str) -> list[tuple[str, str]]:
    entries = httpx.post(f"{url}/v2/repository/index", json={}).json()
    return [(e.get("version", ""), e["state"]) for e in entries if e["name"] == model]


def test_a_reload_to_a_new_version_under_load_fails_no_request(served: tuple[str, Path]) -> None:
    url, root = served
    stop = threading.Event()
    clients = [Client(url, "reloaded", float(i + 1), stop) for i in range(CLIENTS)]
    probe = ReadinessProbe(url, "reloaded", stop)
    for thread in (*clients, probe):
        thread.start()
    try:
        wait_until(lambda: all(len(c.answers) >= 10 for c in clients), "every client was answered by version 1")
        doubling(root / "reloaded" / "2")
        reload = httpx.post(f"{url}/v2/repository/models/reloaded/load", json={}, timeout=WAIT_S)
        assert reload.status_code == 200, reload.text
        wait_until(lambda: all(c.versions().count("2") >= 10 for c in clients), "every client was answered by version 2")
    finally:
        stop.set()
        for thread in (*clients, probe):
            thread.join(WAIT_S)
    failures = [a for c in clients for a in c.answers if a[0] != 200]
    assert failures == [], failures[:5]
    for client in clients:  # once version 2 answered a client, version 1 never did again
        versions = client.versions()
        first_2 = versions.index("2")
        assert set(versions[:first_2]) == {"1"} and set(versions[first_2:]) == {"2"}
    assert probe.statuses and set(probe.statuses) == {200}  # never unready during the swap
    assert index(url, "reloaded") == [("2", "READY")]
    stats = httpx.get(f"{url}/v2/models/reloaded/versions/2/stats").json()["model_stats"][0]
    served_by_2 = sum(c.versions().count("2") for c in clients)
    assert stats["inference_count"] == served_by_2  # every request version 2 took was answered


def test_a_reload_whose_new_version_cannot_load_keeps_the_old_one_serving(served: tuple[str, Path]) -> None:
    url, root = served
    broken = root / "kept" / "2"
    broken.mkdir()
    (broken / "model.onnx").write_bytes(b"this is not an ONNX model")
    response = httpx.post(f"{url}/v2/repository/models/kept/load", json={}, timeout=WAIT_S)
    assert response.status_code == 503, response.text
    assert index(url, "kept") == [("1", "READY")]
    assert httpx.get(f"{url}/v2/models/kept/ready").status_code == 200
    assert httpx.get(f"{url}/v2/health/ready").status_code == 200
    answer = httpx.post(f"{url}/v2/models/kept/infer", json=body(1.5))
    assert answer.status_code == 200 and answer.json()["model_version"] == "1"
    assert answer.json()["outputs"][0]["data"] == [3.0, 3.0]
    error = response.json()["error"]  # the reason, and what still serves
    assert "version 2: ONNX Runtime cannot load" in error and error.endswith("(version 1 serves on)")
