"""The lifecycle of the real server on loopback: priorities and preserve_ordering as a
config.yaml sets them, a reload under load, and a SIGTERM that drains what is in flight.

A request holds an instance for a while by asking `spin` for many iterations (SLOW); every
step waits on the server's own state (/metrics gauges, the statistics extension, the access
log), never on a sleep, and fails with what it was waiting for.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from loadtest.localserver import ROOT, bound_port, stop
from tests.integration.conftest import access_log_lines, running_server
from tests.unit.http.tiny_models import write_spin_model

SLOW = 90_000.0  # iterations of spin: about 3 s of compute on one core of this machine (30,000 held it
# for 1 s, and the steps a test takes while it holds took up to 1.75 s on a busy machine)
WAIT_S = 60


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting until {what}")
        time.sleep(0.01)


def gauge(url: str, name: str, model: str) -> float:
    """One model's value of a Prometheus gauge, from the server's /metrics."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def stats(url: str, model: str) -> dict[str, Any]:
    return httpx.get(f"{url}/v2/models/{model}/stats", timeout=10).json()["model_stats"][0]


class Call:
    """One infer request in a thread; `finished` is when its response arrived."""

    def __init__(self, url: str, model: str, value: float, **parameters: Any) -> None:
        self.value = value
        self.response: httpx.Response | None = None
        self.error: httpx.HTTPError | None = None
        self.finished = 0.0
        document: dict[str, Any] = {
            "id": f"{model}-{value:g}",  # unique per model: the module's tests share one log
            "inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [value]}],
        }
        if parameters:
            document["parameters"] = parameters
        self._thread = threading.Thread(target=self._run, args=(f"{url}/v2/models/{model}/infer", orjson.dumps(document)))
        self._thread.start()

    def _run(self, endpoint: str, body: bytes) -> None:
        try:
            self.response = httpx.post(endpoint, content=body, timeout=WAIT_S)
        except httpx.HTTPError as exc:  # reported by result(), in the test's thread
            self.error = exc
        self.finished = time.monotonic()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> httpx.Response:
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), f"request {self.value:g} hung"
        assert self.error is None, f"request {self.value:g} failed: {self.error!r}"
        assert self.response is not None
        return self.response

    def echoed(self) -> float:
        response = self.result()
        assert response.status_code == 200, response.text
        return float(response.json()["outputs"][0]["data"][0])


def hold(url: str, model: str) -> Call:
    """A SLOW request, once it runs on an instance (one sent sooner could overtake it)."""
    call = Call(url, model, SLOW)
    wait_until(lambda: gauge(url, "batchline_batches_in_flight", model) >= 1 or call.done,
               f"a slow request runs on {model}")
    assert not call.done, f"the slow request finished at once: {call.result().text}"
    return call


def queued(url: str, model: str, depth: int) -> Callable[[], bool]:
    return lambda: gauge(url, "batchline_queue_depth", model) == depth


def answered_ids(log: Path) -> list[str]:
    """Request ids in the order the server answered them (its JSON access log)."""
    return [line["request_id"] for line in access_log_lines(log)]


# --- one server: models whose config.yaml sets priorities, ordering, or is reloaded ----------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("lifecycle") / "models"
    one_at_a_time = {"batch_sizes": [1], "batch_cap": 1}
    write_spin_model(root, "ranked", warmup=one_at_a_time, dynamic_batching={
        "max_queue_delay_microseconds": 0, "priority_levels": 2, "default_priority_level": 2})
    write_spin_model(root, "ordered", instance_group=[{"count": 2, "kind": "CPU"}], dynamic_batching={
        "max_queue_delay_microseconds": 0, "preserve_ordering": True})
    write_spin_model(root, "reloaded", warmup=one_at_a_time)
    log = tmp_path_factory.mktemp("lifecycle-log") / "server.log"
    with running_server(root, "--access-log", "json", "--model-control", log_path=log) as url:  # loopback: no token
        yield url, log


def test_a_priority_1_request_runs_before_priority_2_ones_queued_earlier(served: tuple[str, Path]) -> None:
    url, log = served
    slow = hold(url, "ranked")
    low = []
    for depth, value in enumerate((1.0, 2.0), start=1):
        low.append(Call(url, "ranked", value, priority=2))
        wait_until(queued(url, "ranked", depth), f"{depth} priority-2 request(s) are queued")
    default = Call(url, "ranked", 3.0)  # the config's default_priority_level: 2
    wait_until(queued(url, "ranked", 3), "the default-level request is queued")
    high = Call(url, "ranked", 4.0, priority=1)
    wait_until(queued(url, "ranked", 4), "the priority-1 request is queued last")
    assert not slow.done, f"SLOW ({SLOW:g} iterations) is too fast on this machine to hold the instance"
    assert [c.echoed() for c in (slow, *low, default, high)] == [SLOW, 1.0, 2.0, 3.0, 4.0]
    ids = {f"ranked-{v:g}" for v in (SLOW, 1, 2, 3, 4)}
    wait_until(lambda: ids <= set(answered_ids(log)), "the access log has every answer")
    ranked = [i for i in answered_ids(log) if i in ids]
    assert ranked == [f"ranked-{SLOW:g}", "ranked-4", "ranked-1", "ranked-2", "ranked-3"]


def test_preserve_ordering_answers_in_arrival_order_across_two_instances(served: tuple[str, Path]) -> None:
    url, log = served
    before = stats(url, "ordered")["execution_count"]
    slow = hold(url, "ordered")
    fast = Call(url, "ordered", 7.0)
    wait_until(lambda: stats(url, "ordered")["execution_count"] == before + 1,
               "the later request ran on the second instance")
    assert not slow.done, f"SLOW ({SLOW:g} iterations) is too fast on this machine to hold the instance"
    assert not fast.done, "the later request was answered while the earlier one still ran"
    assert (slow.echoed(), fast.echoed()) == (SLOW, 7.0)
    wait_until(lambda: "ordered-7" in answered_ids(log), "the access log has the later answer")
    ordered = [i for i in answered_ids(log) if i.startswith("ordered-")]
    assert ordered == [f"ordered-{SLOW:g}", "ordered-7"], ordered


def test_a_reload_under_load_finishes_what_is_queued(served: tuple[str, Path]) -> None:
    url, _ = served
    before = stats(url, "reloaded")["inference_count"]
    slow = hold(url, "reloaded")
    waiting = Call(url, "reloaded", 2.0)
    wait_until(queued(url, "reloaded", 1), "a request is queued behind the slow one")
    assert not slow.done, f"SLOW ({SLOW:g} iterations) is too fast on this machine to hold the instance"
    reload = httpx.post(f"{url}/v2/repository/models/reloaded/load", json={}, timeout=WAIT_S)  # returns once drained
    assert reload.status_code == 200, reload.text
    assert (slow.echoed(), waiting.echoed()) == (SLOW, 2.0)
    fresh = Call(url, "reloaded", 3.0)
    assert fresh.echoed() == 3.0
    # the counts go on across the reload: the two the old version drained, and the fresh one
    assert stats(url, "reloaded")["inference_count"] == before + 3


# --- SIGTERM: its own server, since the test ends it ----------------------------------------


def test_sigterm_drains_requests_in_flight_and_queued(tmp_path: Path) -> None:
    root = tmp_path / "models"
    write_spin_model(root, "spin", warmup={"batch_sizes": [1], "batch_cap": 1})
    log, port_file = tmp_path / "server.log", tmp_path / "port"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "serve", "--model-repository", str(root),
             "--host", "127.0.0.1", "--http-port", "0", "--port-file", str(port_file), "--grpc-port", "0"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        url = f"http://127.0.0.1:{bound_port(port_file, process, log, time.monotonic() + 180)}"
        wait_until(lambda: process.poll() is None and _ready(url), f"the server is ready (log: {log})", 180)
        slow = hold(url, "spin")
        waiting = Call(url, "spin", 2.0)
        wait_until(queued(url, "spin", 1), "a request is queued behind the slow one")
        terminated = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert slow.echoed() == SLOW and waiting.echoed() == 2.0
        assert slow.finished > terminated, "the slow request finished before SIGTERM: nothing was drained"
        assert process.wait(WAIT_S) == 0, log.read_text()[-4000:]  # a clean stop, as an orchestrator reads it
    finally:
        stop(process)
    text = log.read_text()
    assert "stopped: the front ends drained, the models unloaded" in text and "Traceback" not in text, text[-4000:]
    # the start-up log names what the models compute on; this test's assumption about the machine
    # is stated and checked: a GPU shows as cuda:0, none as one line that says so
    devices = next((line for line in text.splitlines() if " devices: " in line), None)
    assert devices is not None, text[-4000:]
    gpu_here = Path("/dev/nvidiactl").exists() and "CUDA_VISIBLE_DEVICES" not in os.environ
    assert ("cuda:0" in devices) if gpu_here else ("no GPU visible" in devices), devices


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
