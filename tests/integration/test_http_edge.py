"""The HTTP edge of the real server on loopback: body limits, Content-Encoding as real clients
send it, and the binary header length, through uvicorn's own parsing and connection handling."""

from __future__ import annotations

import gzip
import socket
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as triton

from tests.integration.conftest import running_server
from tests.unit.http.tiny_models import write_spin_model

LIMIT = 64 << 10


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("edge-log") / "server.log"


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory, log: Path) -> Iterator[str]:
    root = tmp_path_factory.mktemp("edge") / "models"
    write_spin_model(root, "spin")
    write_spin_model(root, "wide", max_batch_size=8_192)  # admits a request of thousands of values
    with pytest.MonkeyPatch.context() as env:
        env.setenv("BATCHLINE_MAX_BODY_BYTES", str(LIMIT))  # no flag for it: the setting's variable
        with running_server(root, log_path=log) as base:
            yield base


def body(*values: float) -> bytes:
    return orjson.dumps({"inputs": [{"name": "x", "shape": [len(values), 1], "datatype": "FP32", "data": list(values)}]})


def assert_error(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert list(response.json()) == ["error"]


def test_a_declared_length_over_the_limit_is_answered_before_the_body_is_sent(url: str) -> None:
    """The client sends only the headers: an answer proves the server never waited for the body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(b"POST /v2/models/spin/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {100 * LIMIT}\r\n\r\n".encode())
        try:
            answer = _read_response(raw)
        except TimeoutError:
            pytest.fail("no answer within 10 s: the server waited for a body it was going to refuse")
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert list(orjson.loads(answer.split(b"\r\n\r\n", 1)[1])) == ["error"]


def _read_response(raw: socket.socket) -> bytes:
    """One whole HTTP/1.1 response with a Content-Length, however the server split its writes."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += raw.recv(65536) or pytest.fail(f"the server closed the connection: {data!r}")
    head, rest = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    while len(rest) < length:
        rest += raw.recv(65536) or pytest.fail(f"the server closed the connection: {data + rest!r}")
    return head + b"\r\n\r\n" + rest


def test_a_chunked_body_over_the_limit_is_413(url: str) -> None:
    def stream() -> Iterator[bytes]:
        yield body(1.0)
        for _ in range(8):
            yield b" " * (LIMIT // 4)

    response = httpx.post(f"{url}/v2/models/spin/infer", content=stream(), timeout=30)
    assert_error(response, 413)


def test_a_chunked_body_within_the_limit_is_served(url: str) -> None:
    whole = body(2.0, 3.0)
    response = httpx.post(f"{url}/v2/models/spin/infer", content=iter([whole[:9], whole[9:]]), timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [2.0, 3.0]


def test_a_connection_is_still_usable_after_a_413(url: str) -> None:
    """The refused body was never read; the next request on the same connection must not be
    parsed out of its leftovers."""
    with httpx.Client(base_url=url, timeout=30) as client:
        refused = client.post("/v2/models/spin/infer", content=body(1.0) + b" " * (2 * LIMIT))
        assert_error(refused, 413)
        served = client.post("/v2/models/spin/infer", content=body(4.0))
        assert served.status_code == 200 and served.json()["outputs"][0]["data"] == [4.0]


def test_a_compressed_body_that_inflates_past_the_limit_is_413(url: str) -> None:
    bomb = gzip.compress(body(1.0) + b" " * (64 * LIMIT))
    assert len(bomb) < LIMIT
    response = httpx.post(f"{url}/v2/models/spin/infer", content=bomb, headers={"Content-Encoding": "gzip"})
    assert_error(response, 413)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_tritonclient_compressed_requests_are_served(url: str, algorithm: str) -> None:
    client = triton.InferenceServerClient(url.removeprefix("http://"))
    x = triton.InferInput("x", [3, 1], "FP32")
    x.set_data_from_numpy(np.array([[1.0], [2.0], [3.0]], dtype=np.float32))
    result = client.infer("spin", [x], request_compression_algorithm=algorithm)
    assert result.as_numpy("y").ravel().tolist() == [1.0, 2.0, 3.0]


def test_bare_deflate_is_served(url: str) -> None:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    raw = packer.compress(body(5.0)) + packer.flush()
    response = httpx.post(f"{url}/v2/models/spin/infer", content=raw, headers={"Content-Encoding": "deflate"})
    assert response.status_code == 200 and response.json()["outputs"][0]["data"] == [5.0]


@pytest.mark.parametrize("encoding, content", [
    ("gzip", b"\x1f\x8b\x08\x00not really gzip"),
    ("deflate", b"not deflate"),
    ("br", body(1.0)),
])
def test_corrupt_or_unsupported_encodings_are_400(url: str, encoding: str, content: bytes) -> None:
    response = httpx.post(f"{url}/v2/models/spin/infer", content=content, headers={"Content-Encoding": encoding})
    assert_error(response, 400)


@pytest.mark.parametrize("length", ["abc", "-4", "100000"])
def test_a_bad_inference_header_content_length_is_400(url: str, length: str) -> None:
    response = httpx.post(f"{url}/v2/models/spin/infer", content=body(1.0),
                          headers={"Inference-Header-Content-Length": length})
    assert_error(response, 400)
    assert "Inference-Header-Content-Length" in response.json()["error"]


@pytest.mark.parametrize("values", [1_000, 4_500])  # a body under 16 KiB is read on the event loop, over on a thread
def test_a_long_string_among_numbers_is_400(url: str, values: int) -> None:
    """numpy would read the numbers as text, each as long as the string: refused before it does,
    in the protocol's shape, on either path (the allocation it avoids is measured in the codec's
    unit tests: here it would be a few megabytes, refused with the same 400)."""
    data = orjson.dumps({"inputs": [{"name": "x", "shape": [values + 1, 1], "datatype": "FP32",
                                     "data": [0.0] * values + ["a" * 2_000]}]})
    response = httpx.post(f"{url}/v2/models/wide/infer", content=data)
    assert_error(response, 400)
    assert "FP32 data must be numbers" in response.json()["error"]
    assert httpx.post(f"{url}/v2/models/wide/infer", content=body(1.0)).status_code == 200


def test_uploads_that_stall_after_their_head_do_not_lock_others_out(tmp_path: Path) -> None:
    """Clients that declare big bodies and send a byte: counted whole from their heads on, four
    of them held the whole byte bound, and every other call was refused until they went."""
    root = tmp_path / "models"
    write_spin_model(root, "spin")
    bound = 4 << 20
    with running_server(root, "--max-body-bytes", str(bound), "--max-in-flight-bytes", str(bound)) as base:
        host, port = base.removeprefix("http://").split(":")
        stalled = [socket.create_connection((host, int(port)), timeout=10) for _ in range(4)]
        try:
            for raw in stalled:
                raw.sendall(b"POST /v2/models/spin/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            + f"Content-Length: {bound}\r\n\r\n{{".encode())
            with httpx.Client(base_url=base, timeout=30) as client:
                client.get("/v2/health/ready")  # a request after theirs on the same loop: their heads are read
                served = client.post("/v2/models/spin/infer", content=body(5.0))
            assert served.status_code == 200, served.text
            assert served.json()["outputs"][0]["data"] == [5.0]
        finally:
            for raw in stalled:
                raw.close()


def test_no_edge_case_surfaced_as_an_unexpected_error(url: str, log: Path) -> None:
    """Runs last in this module: every answer above was a mapped one, none an application error."""
    text = log.read_text(errors="replace")
    for sign in ("Exception in ASGI application", "unexpected error", "Traceback"):
        assert sign not in text, text[-4000:]
