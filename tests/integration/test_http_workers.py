"""`--http-workers`: front-end processes on one port in front of one server process, started as
a user starts it and driven by tritonclient and httpx.

Calls go through the front ends unchanged (JSON, binary, tensors large enough to cross in
shared memory, the client's own shared memory); statistics, /metrics, readiness and model
control read one state whichever front end answers; errors keep their statuses; a front end
killed under load is replaced while the other serves on; a stop drains what is in flight.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as th
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from loadtest import localserver
from loadtest.fanout import children
from loadtest.localmodels import onnx_bytes, write_onnx_model
from server.http.workers import SILENT_S
from tests.integration.test_lifecycle import SLOW, WAIT_S, Call, hold, wait_until
from tests.unit.http.tiny_models import write_spin_model

WIDTH = 1 << 16  # echo's floats per item: 256 KiB, past the size that crosses in shared memory


def write_echo_model(root: Path) -> None:
    """`echo`: y = x over WIDTH floats per item, so a test sees its own tensor come back."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "echo",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDTH])])
    write_onnx_model(root, {
        "name": "echo", "max_batch_size": 4,
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [WIDTH]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [WIDTH]}],
        "onnxruntime": {"intra_op_num_threads": 1, "inter_op_num_threads": 1},
        "warmup": {"batch_sizes": [1]},
    }, onnx_bytes(graph))


@contextmanager
def workers_server(root: Path, *extra: str, log_path: Path | None = None) -> Iterator[localserver.StartedServer]:
    logs = Path(tempfile.gettempdir()) / "batchline-test-logs"
    logs.mkdir(exist_ok=True)
    with localserver.started_server(root, "--http-workers", "2", "--allow-grpc", "false", *extra,
                                    log_path=log_path or logs / f"workers-{time.monotonic_ns()}.log",
                                    startup_timeout_s=180) as server:
        yield server


def front_ends(server: localserver.StartedServer) -> list[int]:
    return sorted(children(server.process.pid))


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("workers") / "models"
    root.mkdir()
    write_echo_model(root)
    write_spin_model(root, "spin")
    return root


@pytest.fixture(scope="module")
def served(repository: Path) -> Iterator[localserver.StartedServer]:
    with workers_server(repository, "--allow-client-shm", "--model-control", "--max-body-bytes", str(4 << 20)) as server:
        yield server


def _client(server: localserver.StartedServer) -> th.InferenceServerClient:
    return th.InferenceServerClient(server.url.removeprefix("http://"))


def _echo(client: th.InferenceServerClient, batch: np.ndarray, binary: bool) -> np.ndarray:
    tensor = th.InferInput("x", list(batch.shape), "FP32")
    tensor.set_data_from_numpy(batch, binary_data=binary)
    wanted = th.InferRequestedOutput("y", binary_data=binary)
    return client.infer("echo", [tensor], outputs=[wanted]).as_numpy("y")


def test_two_front_end_processes_serve_the_port(served: localserver.StartedServer) -> None:
    assert len(front_ends(served)) == 2  # both accept before the server reads as ready
    metadata = httpx.get(f"{served.url}/v2", timeout=10).json()
    assert metadata["name"] == "batchline" and "system_shared_memory" in metadata["extensions"]


@pytest.mark.parametrize("binary", [True, False])
def test_tensors_come_back_as_sent(served: localserver.StartedServer, binary: bool) -> None:
    """Tensors large enough to cross in shared memory both ways (256 KiB an item, one item and
    three), and a small one that goes inline (spin's one float)."""
    rng = np.random.default_rng(3)
    client = _client(served)
    for rows in (1, 3):
        batch = rng.standard_normal((rows, WIDTH)).astype(np.float32)
        np.testing.assert_array_equal(_echo(client, batch, binary), batch)
    answer = httpx.post(f"{served.url}/v2/models/spin/infer", timeout=10, json={
        "id": "call-7", "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [2.5]}]}).json()
    assert answer["id"] == "call-7" and answer["model_name"] == "spin" and answer["model_version"] == "1"
    assert answer["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [1, 1], "data": [2.5]}]


def test_statistics_metrics_and_readiness_are_one_view(served: localserver.StartedServer) -> None:
    def successes() -> int:
        stats = httpx.get(f"{served.url}/v2/models/spin/stats", timeout=10).json()
        return int(stats["model_stats"][0]["inference_stats"]["success"]["count"])

    before = successes()
    for value in range(20):  # a new connection each: the kernel spreads them over the front ends
        assert Call(served.url, "spin", float(value)).echoed() == value
    assert successes() == before + 20
    metrics = httpx.get(f"{served.url}/metrics", timeout=10).text
    counted = [line for line in metrics.splitlines()
               if line.startswith("batchline_requests_total{") and 'model="spin"' in line and "success" in line]
    assert counted and float(counted[0].rsplit(" ", 1)[1]) == before + 20
    assert httpx.get(f"{served.url}/v2/health/ready", timeout=10).status_code == 200


def test_model_control_through_a_front_end(served: localserver.StartedServer) -> None:
    client = _client(served)
    json_body = {"Content-Type": "application/json"}  # load and unload refuse other types (a web form's)
    client.unload_model("spin", headers=json_body)
    assert not client.is_model_ready("spin")
    refused = httpx.post(f"{served.url}/v2/models/spin/infer", timeout=10, json={
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]})
    assert refused.status_code in (400, 404, 503) and "spin" in refused.json()["error"]
    client.load_model("spin", headers=json_body)
    assert client.is_model_ready("spin")
    assert Call(served.url, "spin", 4.0).echoed() == 4.0


def test_errors_keep_their_status_and_shape(served: localserver.StartedServer) -> None:
    one = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]}
    unknown = httpx.post(f"{served.url}/v2/models/nothing/infer", json=one, timeout=10)
    assert unknown.status_code == 404 and "nothing" in unknown.json()["error"]
    wrong = httpx.post(f"{served.url}/v2/models/spin/infer", timeout=10,
                       json={"inputs": [{"name": "z", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]})
    assert wrong.status_code == 400 and "'z'" in wrong.json()["error"]
    garbled = httpx.post(f"{served.url}/v2/models/spin/infer", content=b"{not json", timeout=10)
    assert garbled.status_code == 400 and "error" in garbled.json()
    too_big = httpx.post(f"{served.url}/v2/models/spin/infer", content=b" " * (5 << 20), timeout=10)
    assert too_big.status_code == 413
    assert Call(served.url, "spin", 1.0).echoed() == 1.0  # and the server serves on


def test_a_clients_own_parameters_stay_in_the_front_end(served: localserver.StartedServer) -> None:
    """Nested past what the link's encoder writes: the call is served, as one process serves it
    (only the parameters admission reads cross, and those are still checked there)."""
    one = '{"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [2.0]}], "parameters": '
    deep = httpx.post(f"{served.url}/v2/models/spin/infer", timeout=WAIT_S,
                      content=one + '{"mine": ' + "[" * 300 + "]" * 300 + ', "priority": 0}}')
    assert deep.status_code == 200 and deep.json()["outputs"][0]["data"] == [2.0], deep.text
    wrong = httpx.post(f"{served.url}/v2/models/spin/infer", timeout=WAIT_S, content=one + '{"priority": "high"}}')
    assert wrong.status_code == 400 and "'priority' must be an integer" in wrong.json()["error"]


def test_forwarded_routes_answer_as_the_server_process_does(served: localserver.StartedServer) -> None:
    metadata = httpx.get(f"{served.url}/v2", timeout=10)
    assert metadata.status_code == 200
    assert len(metadata.headers.get_list("date")) == 1 and len(metadata.headers.get_list("server")) == 1

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(20):
            yield b" " * (8 << 10)

    too_big = httpx.post(f"{served.url}/v2/repository/index", content=chunks(), timeout=10,
                         headers={"Content-Type": "application/json"})
    assert too_big.status_code == 413 and "65536" in too_big.json()["error"]
    index = httpx.post(f"{served.url}/v2/repository/index", json={}, timeout=10)
    assert index.status_code == 200 and {entry["name"] for entry in index.json()} >= {"echo", "spin"}
    for method in ("GET", "OPTIONS"):  # a body on a method whose body is not passed on is left here
        answered = httpx.request(method, f"{served.url}/v2/health/ready", content=b"x" * 10, timeout=10)
        without = httpx.request(method, f"{served.url}/v2/health/ready", timeout=10)
        assert (answered.status_code, answered.content) == (without.status_code, without.content)
        assert answered.status_code < 500, (method, answered.status_code, answered.text)
    with_body = httpx.request("GET", f"{served.url}/v2", content=b"{}", timeout=10)
    assert with_body.status_code == 200 and with_body.json()["name"] == "batchline"


def test_the_clients_shared_memory_through_a_front_end(served: localserver.StartedServer) -> None:
    client = _client(served)
    batch = np.random.default_rng(5).standard_normal((1, WIDTH)).astype(np.float32)
    key = f"/batchline-test-workers-{time.monotonic_ns()}"
    region = shm.create_shared_memory_region("workers-io", key, 2 * batch.nbytes)
    try:
        shm.set_shared_memory_region(region, [batch])
        client.register_system_shared_memory("workers-io", key, 2 * batch.nbytes)
        tensor = th.InferInput("x", list(batch.shape), "FP32")
        tensor.set_shared_memory("workers-io", batch.nbytes)
        wanted = th.InferRequestedOutput("y")
        wanted.set_shared_memory("workers-io", batch.nbytes, offset=batch.nbytes)
        client.infer("echo", [tensor], outputs=[wanted])
        written = shm.get_contents_as_numpy(region, np.float32, [2, WIDTH])
        np.testing.assert_array_equal(written[1], batch[0])
        client.unregister_system_shared_memory("workers-io")
        with pytest.raises(InferenceServerException, match="no shared-memory region 'workers-io'"):
            client.infer("echo", [tensor])
    finally:
        shm.destroy_shared_memory_region(region)


def test_a_front_end_killed_under_load_is_replaced_and_the_other_serves_on(repository: Path) -> None:
    with workers_server(repository) as server:
        first = front_ends(server)
        stop = threading.Event()
        outcomes: list[int | str] = []

        def load() -> None:
            with httpx.Client(timeout=WAIT_S) as client:
                while not stop.is_set():
                    try:
                        outcomes.append(client.post(f"{server.url}/v2/models/spin/infer", json={
                            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]}).status_code)
                    except httpx.HTTPError as exc:
                        outcomes.append(type(exc).__name__)

        threads = [threading.Thread(target=load) for _ in range(8)]
        for thread in threads:
            thread.start()
        try:
            wait_until(lambda: len(outcomes) > 50, "the load runs")
            os.kill(first[0], signal.SIGKILL)
            wait_until(lambda: len(front_ends(server)) == 2 and front_ends(server) != first,
                       "a new front end replaces the killed one")
            served_before = len(outcomes)
            wait_until(lambda: len(outcomes) > served_before + 50, "the load runs on")
        finally:
            stop.set()
            for thread in threads:
                thread.join(WAIT_S)
        assert first[1] in front_ends(server)  # the other front end was never touched
        failures = [o for o in outcomes if o != 200]
        assert len(failures) <= 8, failures  # at most the calls the killed front end held, one per client
        assert all(isinstance(o, str) for o in failures), failures  # connections lost, never a wrong answer
        with httpx.Client(timeout=WAIT_S) as client:  # new connections reach both front ends again
            for _ in range(20):
                assert client.post(f"{server.url}/v2/models/spin/infer", json={
                    "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [2.0]}]},
                    headers={"Connection": "close"}).status_code == 200


def test_a_front_end_that_stops_answering_is_replaced(repository: Path, tmp_path: Path) -> None:
    """Stopped (SIGSTOP), it would keep taking its share of new connections and hang them:
    not heard from for a while, it is killed and another takes its place."""
    log = tmp_path / "server.log"
    with workers_server(repository, log_path=log) as server:
        first = front_ends(server)
        os.kill(first[0], signal.SIGSTOP)
        try:
            wait_until(lambda: len(front_ends(server)) == 2 and first[0] not in front_ends(server),
                       "the stopped front end is replaced", timeout_s=SILENT_S + 30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(first[0], signal.SIGCONT)
        assert first[1] in front_ends(server)  # the one still answering was left alone
        with httpx.Client(timeout=10) as client:  # new connections, spread over both, are answered
            for _ in range(20):
                assert client.get(f"{server.url}/v2/health/ready", headers={"Connection": "close"}).status_code == 200
        assert "has not been heard from" in log.read_text()


def test_a_stop_drains_calls_in_flight_and_ends_every_process(repository: Path) -> None:
    """As a terminal's Ctrl-C (SIGINT to every process) or a stopper that signals the whole group
    (SIGTERM to every process) would: the front ends drain once, whatever reaches them."""
    with workers_server(repository) as server:
        processes = front_ends(server)
        slow = hold(server.url, "spin")
        for pid in processes:
            os.kill(pid, signal.SIGINT)
            os.kill(pid, signal.SIGTERM)
        server.process.send_signal(signal.SIGTERM)
        assert slow.echoed() == SLOW  # answered during the drain
        assert server.process.wait(WAIT_S) == 0
    for pid in processes:
        wait_until(lambda pid=pid: not Path(f"/proc/{pid}").exists() or _zombie(pid), f"front end {pid} has ended")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
