"""`bench frontends`: the gRPC frame it sends (read back through the protobuf classes, as
tritonclient.grpc would build it, and as the server decodes it), h2load's command line, log and
summary, the OpenAI body, the table; and a short run against the real server on loopback, every
front end of digits (and minilm's gRPC and OpenAI ones). It checks the tool, not the server's speed."""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton

from loadtest import frontends, payloads
from server.grpc import codec
from server.grpc.protos import grpc_service_pb2 as pb
from tests.integration.conftest import linked_repository, require_tool, running_server
from tests.loadtest.conftest import assert_figure, bench

# ---- the gRPC request ---------------------------------------------------------------------------


def _read_back(request: pb.ModelInferRequest) -> pb.ModelInferRequest:
    frame = frontends.grpc_frame(request.SerializeToString())
    assert frame[0] == 0 and struct.unpack(">I", frame[1:5])[0] == len(frame) - 5
    return pb.ModelInferRequest.FromString(frontends.read_frame(frame))


def _tritonclient(name: str, datatype: str, array: np.ndarray) -> tuple[object, bytes]:
    """The input tensor and raw bytes tritonclient.grpc puts in a ModelInferRequest for `array`."""
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor._get_tensor(), tensor._get_content()


def test_a_float32_request_round_trips_as_tritonclient_builds_it() -> None:
    decoded = _read_back(frontends.grpc_request("digits", items=2, offset=3))
    images = payloads.items_for("digits", 2, 3)
    assert decoded.model_name == "digits" and len(decoded.inputs) == len(decoded.raw_input_contents) == 1
    tensor = decoded.inputs[0]
    assert (tensor.name, tensor.datatype, list(tensor.shape)) == ("image", "FP32", [2, 1, 8, 8])
    sent = np.frombuffer(decoded.raw_input_contents[0], "<f4").reshape(2, 1, 8, 8)
    np.testing.assert_array_equal(sent, images)
    expected_tensor, expected_raw = _tritonclient("image", "FP32", images)
    assert tensor.SerializeToString() == expected_tensor.SerializeToString()
    assert decoded.raw_input_contents[0] == expected_raw


def test_a_bytes_request_round_trips_length_prefixed() -> None:
    decoded = _read_back(frontends.grpc_request("minilm", items=3, offset=12))  # CJK, digits, an emoji
    texts = [payloads.SENTENCES[i] for i in (12, 13, 14)]
    tensor, raw = decoded.inputs[0], decoded.raw_input_contents[0]
    assert (tensor.name, tensor.datatype, list(tensor.shape)) == ("text", "BYTES", [3, 1])
    read, position = [], 0
    while position < len(raw):
        (length,) = struct.unpack("<I", raw[position:position + 4])
        read.append(raw[position + 4:position + 4 + length].decode("utf-8"))
        position += 4 + length
    assert read == texts
    array = np.array(texts, dtype=np.object_).reshape(3, 1)
    expected_tensor, expected_raw = _tritonclient("text", "BYTES", array)
    assert tensor.SerializeToString() == expected_tensor.SerializeToString() and raw == expected_raw


def test_the_server_decodes_what_the_bench_sends() -> None:
    for model, items in (("digits", 4), ("minilm", 2)):
        decoded = codec.decode_inputs(_read_back(frontends.grpc_request(model, items=items)))
        name, datatype = payloads.SPECS[model][:2]
        sent = payloads.items_for(model, items, 0)
        assert decoded[name][0] == datatype
        got = decoded[name][1]
        if datatype == "BYTES":
            got = np.array([b.decode() if isinstance(b, bytes) else b for b in got.reshape(-1)], dtype=object)
            sent = sent.reshape(-1)
        np.testing.assert_array_equal(got, sent)


def test_read_frame_refuses_what_is_not_one_frame() -> None:
    frame = frontends.grpc_frame(b"abc")
    assert frame == b"\x00\x00\x00\x00\x03abc" and frontends.read_frame(frame) == b"abc"
    for bad in (b"\x01\x00\x00\x00\x03abc", frame[:-1], b"\x00\x00"):
        with pytest.raises(ValueError):
            frontends.read_frame(bad)


def test_the_grpc_answer_is_checked() -> None:
    response = pb.ModelInferResponse(model_name="digits")
    response.outputs.add(name="probabilities", datatype="FP32", shape=[1, 10])
    response.raw_output_contents.append(bytes(40))
    assert frontends.check_grpc_response("digits", 1, response) is None
    assert "shape" in frontends.check_grpc_response("digits", 2, response)
    response.raw_output_contents[0] = bytes(36)
    assert "36 bytes" in frontends.check_grpc_response("digits", 1, response)
    assert "no output" in frontends.check_grpc_response("minilm", 1, response)


# ---- h2load -------------------------------------------------------------------------------------

def test_the_h2load_command_line() -> None:
    command = frontends.h2load_command("127.0.0.1:8001", Path("/tmp/b.grpc"), 64, 2.5, Path("/tmp/h.log"),
                                       cpu=1)
    assert command == [
        "taskset", "-c", "1", "h2load", "-c", "64", "-m", "1", "-t", "1", "-D", "3", "-d", "/tmp/b.grpc",
        "-H", "content-type: application/grpc", "-H", "te: trailers", "--log-file=/tmp/h.log",
        "http://127.0.0.1:8001/inference.GRPCInferenceService/ModelInfer",
    ]
    warmup = frontends.h2load_command("h:9", Path("b"), 1, 0.2)
    assert warmup[:6] == ["h2load", "-c", "1", "-m", "1", "-t"] and warmup[warmup.index("-D") + 1] == "1"
    assert not any(part.startswith(("--log-file", "--warm-up")) for part in warmup)


SUMMARY = """finished in 2.02s, 682.00 req/s, 103.88KB/s
requests: 1364 total, 1428 started, 1364 done, 1364 succeeded, 0 failed, 0 errored, 0 timeout
status codes: 1364 2xx, 0 3xx, 0 4xx, 0 5xx
"""


def _log(*rows: tuple[int, int]) -> str:
    return "".join(f"{1796157341178183 + i * 10}\t{status}\t{us}\n" for i, (status, us) in enumerate(rows))


def test_the_h2load_log_gives_rate_and_percentiles() -> None:
    text = _log(*[(200, 2000)] * 89, *[(200, 40_000)] * 10, (503, 2000), (-1, 0))
    log = frontends.H2loadLog.parse(text)
    assert (log.answered, log.ok, log.not_ok) == (100, 99, 2)
    latency = log.latency_ms()
    assert (latency["p50"], latency["p99"], latency["min"], latency["max"]) == (2.0, 40.0, 2.0, 40.0)
    summary = frontends.parse_summary(SUMMARY)
    assert summary == {"total": 1364, "started": 1428, "done": 1364, "succeeded": 1364, "failed": 0,
                       "errored": 0, "timeout": 0}
    level = frontends.h2load_level(log, summary, {"success": 10, "fail": 0}, {"success": 109, "fail": 0},
                                   clients=4, duration_s=2, items=3, command=["h2load"])
    assert level["requests"] == 100 and level["req_s"] == 50.0 and level["items_s"] == 150.0
    assert level["errors"] == {"http": 2, "grpc_status": 0} and level["error_count"] == 2
    assert level["h2load"]["unanswered_at_stop"] == 64 and level["server"] == {"successes": 99, "failures": 0}
    with pytest.raises(RuntimeError, match="requests:"):
        frontends.parse_summary("connect failed")


def test_grpc_errors_are_completed_calls_the_server_did_not_count() -> None:
    log = frontends.H2loadLog.parse(_log(*[(200, 1000)] * 10))
    summary = frontends.parse_summary(SUMMARY)
    counts = {"success": 100, "fail": 0}

    def errors(success: int, fail: int = 0) -> dict[str, int]:
        return frontends.grpc_errors(log, summary, counts, {"success": success, "fail": fail})

    assert errors(110) == {"http": 0, "grpc_status": 0}
    assert errors(111) == {"http": 0, "grpc_status": 0}  # one abandoned at the stop, answered after
    assert errors(107) == {"http": 0, "grpc_status": 3}
    assert errors(111, fail=2) == {"http": 0, "grpc_status": 2}  # shows what an abandoned call hid
    assert frontends.grpc_errors(log, summary, None, None)["grpc_status"] == 10  # no statistics: no proof


# ---- OpenAI, the table --------------------------------------------------------------------------

def test_the_openai_body_carries_the_v2_sentences() -> None:
    one = frontends.openai_request("minilm", offset=3)
    assert (one.path, one.headers) == ("/v1/embeddings", {"Content-Type": "application/json"})
    assert json.loads(one.body) == {"model": "minilm", "input": payloads.SENTENCES[3]}
    two = frontends.openai_request("minilm", items=2, offset=10)
    assert json.loads(two.body)["input"] == list(payloads.SENTENCES[10:12])
    assert "Dónde" in two.body.decode()  # UTF-8 as is, as the v2 JSON bodies
    assert json.loads(frontends.http_request("openai", "minilm", 1).body)["input"] == payloads.SENTENCES[0]
    v2 = json.loads(frontends.http_request("v2-json", "minilm", 1).body)
    assert v2["inputs"][0]["data"] == [payloads.SENTENCES[0]]  # every front end: the same one text
    with pytest.raises(ValueError, match="no OpenAI"):
        frontends.openai_request("digits")
    good = json.dumps({"data": [{"embedding": [0.0] * 384}]}).encode()
    assert frontends.check_openai_response("minilm", 1, 200, good) is None
    assert "lengths" in frontends.check_openai_response("minilm", 2, 200, good)
    assert "HTTP 404" in frontends.check_openai_response("minilm", 1, 404, b"{}")


def test_front_end_and_address_arguments() -> None:
    assert frontends.front_ends("auto") is None
    assert frontends.front_ends("grpc, v2-json") == ["grpc", "v2-json"]
    with pytest.raises(Exception, match="subset"):
        frontends.front_ends("grpc,rest")
    assert frontends.grpc_target("grpc://10.0.0.1:9001") == "10.0.0.1:9001"
    assert frontends.grpc_target("127.0.0.1:8001") == "127.0.0.1:8001"


def _level(front_end: str, clients: int, req_s: float) -> dict:
    return {"front_end": front_end, "concurrency": clients, "req_s": req_s, "items_s": req_s * 2,
            "latency_ms": {"p50": 1.5, "p99": 4.0}, "error_count": 0}


def test_the_table_compares_each_front_end_with_v2_json() -> None:
    levels = [_level("v2-json", 1, 400.0), _level("v2-json", 64, 2000.0), _level("grpc", 1, 300.0),
              _level("grpc", 64, 500.0)]
    rows = frontends.table_rows(levels)
    assert rows[0] == ["v2-json", 1, 400.0, 800.0, 1.5, 4.0, 0, 1.0]
    assert rows[3] == ["grpc", 64, 500.0, 1000.0, 1.5, 4.0, 0, 0.25]
    assert len(frontends.HEADERS) == len(rows[0])
    assert frontends.summary_lines(levels) == ["1 client(s), req/s: v2-json 400, grpc 300",
                                               "64 client(s), req/s: v2-json 2,000, grpc 500"]
    assert frontends.table_rows([_level("grpc", 1, 300.0)])[0][-1] is None  # no v2-json to compare with


# ---- against the real server --------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """digits and minilm served on loopback: (HTTP base URL, gRPC HOST:PORT)."""
    folder = tmp_path_factory.mktemp("frontends")
    repository = linked_repository(folder / "models")
    port_file = folder / "grpc.port"
    with running_server(repository, "--grpc-port-file", str(port_file)) as url:
        deadline = time.monotonic() + 30
        while not port_file.is_file():
            assert time.monotonic() < deadline, "the server wrote no --grpc-port-file"
            time.sleep(0.05)
        yield url, f"127.0.0.1:{int(port_file.read_text())}"


@pytest.mark.integration
def test_bench_frontends_serves_every_front_end_without_errors(served: tuple[str, str],
                                                               tmp_path: Path) -> None:
    require_tool("wrk", "wrk")
    require_tool("h2load", "nghttp2-client")
    url, grpc_url = served
    short = ("--concurrency", "1", "--duration", "1", "--warmup", "0")
    server = ("--url", url, "--grpc-url", grpc_url)
    bench("frontends", *server, "--model", "digits", *short, "--out", str(tmp_path / "d"))
    bench("frontends", *server, "--model", "minilm", "--front-ends", "grpc,openai", *short,
          "--out", str(tmp_path / "m"))
    digits = json.loads((tmp_path / "d" / "frontends.json").read_text())
    minilm = json.loads((tmp_path / "m" / "frontends.json").read_text())
    assert digits["mode"] == "frontends" and digits["machine"]["cpu_model"] is not None
    assert digits["parameters"]["front_ends"] == ["v2-json", "v2-binary", "grpc"]  # no /v1/embeddings
    assert minilm["parameters"]["front_ends"] == ["grpc", "openai"]
    assert digits["generators"]["h2load"].startswith("h2load")
    levels = digits["results"] + minilm["results"]
    assert [(level["front_end"], level["concurrency"]) for level in levels] == [
        ("v2-json", 1), ("v2-binary", 1), ("grpc", 1), ("grpc", 1), ("openai", 1)]
    for level in levels:
        where = f"{level['front_end']}: {level}"
        assert level["requests"] > 0 and level["req_s"] > 0 and level["error_count"] == 0, where
        assert 0 < level["latency_ms"]["p50"] <= level["latency_ms"]["p99"], where
        assert level["server"]["successes"] >= level["requests"] and level["server"]["failures"] == 0, where
    markdown = assert_figure(tmp_path / "d", "frontends")
    assert "| v2-binary | 1 |" in markdown and "| grpc | 1 |" in markdown and "req/s vs v2-json" in markdown
    assert "the same one request" in markdown
