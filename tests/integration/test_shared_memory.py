"""System shared memory on the real server, driven by tritonclient as Triton's users drive it:
`tritonclient.utils.shared_memory` makes and fills the regions, both clients register them, and
inputs and outputs go through them instead of the request; an object the client makes smaller
is refused, not touched; a region unregistered while a queued request uses it still serves that
request; a server started without --allow-client-shm refuses.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from server.grpc.codec import plain_parameters
from tests.integration.conftest import linked_repository
from tests.integration.test_grpc import Served, serving
from tests.integration.test_lifecycle import SLOW, WAIT_S, Call, gauge, wait_until
from tests.unit.http.tiny_models import write_spin_model

IMAGES = np.random.default_rng(7).uniform(0, 16, size=(3, 1, 8, 8)).astype(np.float32)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = linked_repository(tmp_path_factory.mktemp("shm") / "models", ("digits",))
    write_spin_model(root, "spin")
    with serving(root, "--allow-client-shm") as server:
        yield server


@pytest.fixture
def regions() -> Iterator[dict[str, Any]]:
    """Regions made by this test (name -> handle), destroyed after it whatever happens."""
    made: dict[str, Any] = {}
    yield made
    for handle in made.values():
        shm.destroy_shared_memory_region(handle)


def _region(made: dict[str, Any], name: str, byte_size: int) -> Any:
    handle = shm.create_shared_memory_region(name, f"/batchline-test-{name}-{time.monotonic_ns()}", byte_size)
    made[name] = handle
    return handle


def _key(handle: Any) -> str:
    return handle._shm_key


def _clients(served: Served) -> tuple[th.InferenceServerClient, tg.InferenceServerClient]:
    return th.InferenceServerClient(served.url.removeprefix("http://")), tg.InferenceServerClient(served.target)


def _expected(served: Served, images: np.ndarray) -> np.ndarray:
    """digits' answer for `images`, sent the ordinary way."""
    client = th.InferenceServerClient(served.url.removeprefix("http://"))
    tensor = th.InferInput("image", list(images.shape), "FP32")
    tensor.set_data_from_numpy(images, binary_data=True)
    return client.infer("digits", [tensor]).as_numpy("probabilities")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_inputs_and_outputs_go_through_shared_memory(served: Served, regions: dict[str, Any],
                                                     protocol: str) -> None:
    http, grpc = _clients(served)
    client, module = (http, th) if protocol == "http" else (grpc, tg)
    images = IMAGES[:2]
    inputs = _region(regions, f"{protocol}-in", 64 + images.nbytes)  # the tensor at offset 64
    outputs = _region(regions, f"{protocol}-out", 2 * 10 * 4)
    shm.set_shared_memory_region(inputs, [images], offset=64)
    client.register_system_shared_memory(f"{protocol}-in", _key(inputs), 64 + images.nbytes)
    client.register_system_shared_memory(f"{protocol}-out", _key(outputs), 2 * 10 * 4)
    try:
        tensor = module.InferInput("image", list(images.shape), "FP32")
        tensor.set_shared_memory(f"{protocol}-in", images.nbytes, offset=64)
        wanted = module.InferRequestedOutput("probabilities")
        wanted.set_shared_memory(f"{protocol}-out", 2 * 10 * 4)
        result = client.infer("digits", [tensor], outputs=[wanted])
        output = result.get_output("probabilities")
        parameters = output["parameters"] if protocol == "http" else plain_parameters(output.parameters)
        assert parameters == {"shared_memory_region": f"{protocol}-out", "shared_memory_byte_size": 80}
        answer = shm.get_contents_as_numpy(outputs, np.float32, [2, 10])
        np.testing.assert_allclose(answer, _expected(served, images), rtol=1e-6)
        status = client.get_system_shared_memory_status()
        listed = status if protocol == "http" else [
            {"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size} for r in status.regions.values()]
        assert {"name": f"{protocol}-in", "key": _key(inputs), "offset": 0, "byte_size": 64 + images.nbytes} in listed
    finally:
        client.unregister_system_shared_memory(f"{protocol}-in")
        client.unregister_system_shared_memory(f"{protocol}-out")
    with pytest.raises(InferenceServerException, match=f"no shared-memory region '{protocol}-in'"):
        client.infer("digits", [tensor])
    assert "system_shared_memory" in http.get_server_metadata()["extensions"]


def test_a_reference_past_its_region_is_a_400_and_the_server_serves_on(served: Served,
                                                                       regions: dict[str, Any]) -> None:
    http, _ = _clients(served)
    inputs = _region(regions, "small", IMAGES[:1].nbytes)
    shm.set_shared_memory_region(inputs, [IMAGES[:1]])
    http.register_system_shared_memory("small", _key(inputs), IMAGES[:1].nbytes)
    try:
        tensor = th.InferInput("image", [2, 1, 8, 8], "FP32")
        tensor.set_shared_memory("small", IMAGES[:2].nbytes)
        answer = httpx.post(f"{served.url}/v2/models/digits/infer", json={"inputs": [{
            "name": "image", "datatype": "FP32", "shape": [2, 1, 8, 8],
            "parameters": {"shared_memory_region": "small", "shared_memory_byte_size": IMAGES[:2].nbytes}}]})
        assert answer.status_code == 400
        assert "run past the end of shared-memory region 'small'" in answer.json()["error"]
        with pytest.raises(InferenceServerException, match="needs 512 bytes of binary data, got 256"):
            tensor.set_shared_memory("small", IMAGES[:1].nbytes)
            http.infer("digits", [tensor])  # the region holds one image; the shape says two
        tensor = th.InferInput("image", [1, 1, 8, 8], "FP32")
        tensor.set_shared_memory("small", IMAGES[:1].nbytes)
        small_out = th.InferRequestedOutput("probabilities")
        small_out.set_shared_memory("small", 8)  # an output larger than its window
        with pytest.raises(InferenceServerException, match="output 'probabilities' is 40 bytes"):
            http.infer("digits", [tensor], outputs=[small_out])
        np.testing.assert_allclose(http.infer("digits", [tensor]).as_numpy("probabilities"),
                                   _expected(served, IMAGES[:1]), rtol=1e-6)
    finally:
        http.unregister_system_shared_memory()
    assert http.get_system_shared_memory_status() == []


def _path(handle: Any) -> str:
    return os.path.join("/dev/shm", _key(handle).lstrip("/"))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_object_made_smaller_after_registering_is_refused_and_the_server_serves_on(
        served: Served, regions: dict[str, Any], protocol: str) -> None:
    """The server mapped each region once: a client that shrank its object and then named it
    ended the server (SIGBUS). Reads and writes now go through the object's file."""
    http, grpc = _clients(served)
    client, module = (http, th) if protocol == "http" else (grpc, tg)
    images = IMAGES[:1]
    inputs = _region(regions, f"{protocol}-shrunk-in", images.nbytes)
    outputs = _region(regions, f"{protocol}-shrunk-out", 40)
    shm.set_shared_memory_region(inputs, [images])
    client.register_system_shared_memory(f"{protocol}-shrunk-in", _key(inputs), images.nbytes)
    client.register_system_shared_memory(f"{protocol}-shrunk-out", _key(outputs), 40)
    try:
        os.truncate(_path(inputs), 0)  # the client's own mapping is not touched from here on
        os.truncate(_path(outputs), 0)
        from_shm = module.InferInput("image", list(images.shape), "FP32")
        from_shm.set_shared_memory(f"{protocol}-shrunk-in", images.nbytes)
        with pytest.raises(InferenceServerException, match="made smaller after it was registered"):
            client.infer("digits", [from_shm])
        plain = module.InferInput("image", list(images.shape), "FP32")
        plain.set_data_from_numpy(images)
        to_shm = module.InferRequestedOutput("probabilities")
        to_shm.set_shared_memory(f"{protocol}-shrunk-out", 40)
        with pytest.raises(InferenceServerException, match="made smaller after it was registered"):
            client.infer("digits", [plain], outputs=[to_shm])
        assert os.stat(_path(outputs)).st_size == 0, "the refused output is not written"
        np.testing.assert_allclose(client.infer("digits", [plain]).as_numpy("probabilities"),
                                   _expected(served, images), rtol=1e-6)
    finally:
        client.unregister_system_shared_memory(f"{protocol}-shrunk-in")
        client.unregister_system_shared_memory(f"{protocol}-shrunk-out")


def test_a_region_unregistered_while_a_queued_request_uses_it_still_serves_that_request(
        served: Served, regions: dict[str, Any]) -> None:
    http, _ = _clients(served)
    value = np.array([[5.0]], np.float32)
    inputs = _region(regions, "held-in", 4)
    outputs = _region(regions, "held-out", 4)
    shm.set_shared_memory_region(inputs, [value])
    http.register_system_shared_memory("held-in", _key(inputs), 4)
    http.register_system_shared_memory("held-out", _key(outputs), 4)
    slow = Call(served.url, "spin", SLOW)  # holds spin's one instance
    wait_until(lambda: gauge(served.url, "batchline_batches_in_flight", "spin") >= 1, "the slow request runs")
    answers: list[Any] = []

    def queued() -> None:
        tensor = th.InferInput("x", [1, 1], "FP32")
        tensor.set_shared_memory("held-in", 4)
        wanted = th.InferRequestedOutput("y")
        wanted.set_shared_memory("held-out", 4)
        try:
            answers.append(th.InferenceServerClient(served.url.removeprefix("http://"), network_timeout=WAIT_S)
                           .infer("spin", [tensor], outputs=[wanted]))
        except InferenceServerException as exc:
            answers.append(exc)

    thread = threading.Thread(target=queued)
    thread.start()
    wait_until(lambda: gauge(served.url, "batchline_queue_depth", "spin") == 1, "the shared-memory request waits")
    http.unregister_system_shared_memory()  # while the request is queued
    assert http.get_system_shared_memory_status() == []
    assert slow.echoed() == SLOW
    thread.join(WAIT_S)
    assert not isinstance(answers[0], Exception), answers[0]
    assert shm.get_contents_as_numpy(outputs, np.float32, [1, 1]).tolist() == [[5.0]]


def test_a_server_without_the_flag_takes_no_region(server_url: str, regions: dict[str, Any]) -> None:
    client = th.InferenceServerClient(server_url.removeprefix("http://"))
    handle = _region(regions, "refused", 64)
    with pytest.raises(InferenceServerException, match="--allow-client-shm"):
        client.register_system_shared_memory("refused", _key(handle), 64)
    answer = httpx.post(f"{server_url}/v2/models/digits/infer", json={"inputs": [{
        "name": "image", "datatype": "FP32", "shape": [1, 1, 8, 8],
        "parameters": {"shared_memory_region": "refused", "shared_memory_byte_size": 256}}]})
    assert answer.status_code == 400 and "--allow-client-shm" in answer.json()["error"]
    assert "system_shared_memory" not in client.get_server_metadata()["extensions"]
    cuda = httpx.get(f"{server_url}/v2/cudasharedmemory/status")
    assert cuda.status_code == 400 and "CUDA shared memory is not supported" in cuda.json()["error"]
