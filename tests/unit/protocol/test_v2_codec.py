"""KServe v2 request decoding and response encoding, checked against real tritonclient bodies
and tritonclient's own response parser."""

from __future__ import annotations

import math
import time
import tracemalloc
from typing import Any

import ml_dtypes
import numpy as np
import orjson
import pytest
import tritonclient.http as triton_http
from tritonclient.http._utils import _get_inference_request

from server.errors import InvalidInput, Unsupported
from server.protocol import v2
from server.protocol.datatypes import numpy_dtype
from server.protocol.shared_memory import COPIED_PER_WALKED, RegionRef
from server.protocol.v2 import (
    DecodedRequest,
    RequestedOutput,
    build_tensors,
    decode_request,
    encode_error,
    encode_response,
    json_tensor,
    parse_request,
)
from tests.unit.protocol.kinds import FLOATS, INTEGERS

NUMPY = {
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BF16": ml_dtypes.bfloat16,
    "BOOL": np.bool_,
}


def json_body(inputs: list[dict[str, Any]], **extra: Any) -> bytes:
    return orjson.dumps({"inputs": inputs, **extra})


def one_input(datatype: str, shape: list[int], data: Any, name: str = "x") -> bytes:
    return json_body([{"name": name, "datatype": datatype, "shape": shape, "data": data}])


def client_body(
    inputs: list[triton_http.InferInput],
    outputs: list[triton_http.InferRequestedOutput] | None = None,
    request_id: str = "",
    parameters: dict[str, Any] | None = None,
) -> tuple[bytes, int | None]:
    """The exact body and Inference-Header-Content-Length tritonclient would send."""
    return _get_inference_request(
        inputs=inputs,
        request_id=request_id,
        outputs=outputs,
        sequence_id=0,
        sequence_start=False,
        sequence_end=False,
        priority=0,
        timeout=None,
        custom_parameters=parameters,
    )


def client_input(name: str, array: np.ndarray, datatype: str, binary: bool) -> triton_http.InferInput:
    tensor = triton_http.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def sample(datatype: str, shape: list[int]) -> np.ndarray:
    count = int(np.prod(shape))
    if datatype == "BOOL":
        return (np.arange(count) % 3 == 0).reshape(shape)
    if datatype == "BYTES":
        pool = [b"", b"a", "h\u00e9llo".encode(), b"\x00mid\x00", b"x" * 40]
        array = np.empty(count, dtype=object)
        array[:] = [pool[i % len(pool)] for i in range(count)]
        return array.reshape(shape)
    dtype = np.dtype(NUMPY[datatype])
    if datatype in INTEGERS:
        info = np.iinfo(dtype)
        values = [info.min, info.max, 0, 1, info.max // 3, info.min // 5 if info.min else 7]
        return np.array([values[i % len(values)] for i in range(count)], dtype=dtype).reshape(shape)
    values = [0.0, -1.5, 2.25, 0.125, -0.0, 3.0]
    return np.array([values[i % len(values)] for i in range(count)], dtype=dtype).reshape(shape)


def assert_same(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype
    if expected.dtype == object:
        assert actual.tolist() == expected.tolist()
    else:
        np.testing.assert_array_equal(actual.view(np.uint8), expected.view(np.uint8))


# --- JSON inputs -------------------------------------------------------------------------


@pytest.mark.parametrize("datatype", INTEGERS)
def test_json_integers_flat_and_nested(datatype: str) -> None:
    expected = sample(datatype, [2, 3])
    for data in (expected.reshape(-1).tolist(), expected.tolist()):
        decoded = decode_request(one_input(datatype, [2, 3], data))
        dt, array = decoded.inputs["x"]
        assert dt == datatype
        assert_same(array, expected)


@pytest.mark.parametrize("datatype", FLOATS)
def test_json_floats_flat_and_nested(datatype: str) -> None:
    expected = sample(datatype, [3, 2])
    values = expected.astype(np.float64)
    for data in (values.reshape(-1).tolist(), values.tolist()):
        _, array = decode_request(one_input(datatype, [3, 2], data)).inputs["x"]
        assert_same(array, expected)


@pytest.mark.parametrize("datatype", FLOATS)
def test_json_floats_from_integers(datatype: str) -> None:
    _, array = decode_request(one_input(datatype, [3], [1, -2, 3])).inputs["x"]
    assert array.dtype == np.dtype(NUMPY[datatype])
    assert array.astype(np.float64).tolist() == [1.0, -2.0, 3.0]


def test_json_bf16_rounds_to_nearest() -> None:
    _, array = decode_request(one_input("BF16", [2], [1.00390625, 3.14159])).inputs["x"]
    assert array.dtype == ml_dtypes.bfloat16
    assert array.tolist() == np.array([1.00390625, 3.14159], dtype=ml_dtypes.bfloat16).tolist()


def test_json_fp16_values() -> None:
    _, array = decode_request(one_input("FP16", [2, 2], [[0.5, -65504.0], [0.1, 1e-5]])).inputs["x"]
    assert_same(array, np.array([[0.5, -65504.0], [0.1, 1e-5]], dtype=np.float16))


def test_json_bool_flat_and_nested() -> None:
    expected = np.array([[True, False], [False, True]])
    for data in ([True, False, False, True], [[True, False], [False, True]]):
        _, array = decode_request(one_input("BOOL", [2, 2], data)).inputs["x"]
        assert_same(array, expected)


def test_json_bytes_become_bytes_objects() -> None:
    data = [["h\u00e9llo", ""], ["\u4e16\u754c", "a b"]]
    _, array = decode_request(one_input("BYTES", [2, 2], data)).inputs["x"]
    assert array.dtype == object and array.shape == (2, 2)
    assert array.tolist() == [["h\u00e9llo".encode(), b""], ["\u4e16\u754c".encode(), b"a b"]]
    assert all(type(x) is bytes for x in array.reshape(-1))


def test_json_scalar_data_and_empty_tensor() -> None:
    _, array = decode_request(one_input("INT32", [1], 7)).inputs["x"]
    assert_same(array, np.array([7], dtype=np.int32))
    _, empty = decode_request(one_input("FP32", [0, 3], [])).inputs["x"]
    assert empty.shape == (0, 3) and empty.dtype == np.float32
    _, scalar = decode_request(one_input("FP64", [], [2.5])).inputs["x"]
    assert scalar.shape == () and scalar.dtype == np.float64 and float(scalar) == 2.5


def test_json_tensor_directly() -> None:
    assert_same(json_tensor([[1, 2], [3, 4]], "INT16", [4], "t"), np.array([1, 2, 3, 4], dtype=np.int16))


SLICED_CASES = [
    ("FP32", [12, 2], [[i, i + 0.5] for i in range(12)]),
    ("FP32", [1, 10, 1], [[[float(i)] for i in range(10)]]),  # a batch of one: sliced within its own list
    ("FP32", [2, 10], [[float(i) for i in range(10)], [-float(i) for i in range(10)]]),  # rows over a slice
    ("INT16", [2, 3, 5], [[[c * 5 + i for i in range(5)] for c in range(3)]] * 2),  # an image's channels
    ("FP64", [3, 6], [[1.5] * 6, [True] * 6, [2] * 6]),  # joined as numpy joins mixed values
    ("INT8", [10], list(range(10))),
    ("UINT64", [9], [1] * 8 + [2**64 - 1]),
    ("BOOL", [7, 1, 1], [[[i % 2 == 0]] for i in range(7)]),
    ("FP32", [9], [True] * 8 + [1.5]),  # numpy reads bools beside numbers as numbers, whole or sliced
    ("INT32", [9], [True] * 8 + [5]),
]


@pytest.mark.parametrize(("datatype", "shape", "data"), SLICED_CASES)
def test_big_json_data_is_read_in_slices_with_the_same_result(
    monkeypatch: pytest.MonkeyPatch, datatype: str, shape: list[int], data: list[Any],
) -> None:
    """Off the event loop, big data is converted a slice of rows at a time (each conversion
    holds the GIL): the tensor is the one converting it whole gives."""
    whole = json_tensor(data, datatype, shape, "x")
    conversions: list[int] = []  # the values each conversion read

    def counted(rows: list[Any], name: str) -> np.ndarray:
        array = regular(rows, name)
        conversions.append(array.size)
        return array

    regular = v2._regular
    monkeypatch.setattr(v2, "VALUES_A_CALL", 4)
    monkeypatch.setattr(v2, "_regular", counted)
    assert_same(json_tensor(data, datatype, shape, "x"), whole)
    assert len(conversions) > 1 and max(conversions) <= 4


@pytest.mark.parametrize(("datatype", "data", "refusal"), [
    ("FP32", [[1.0, 2.0]] * 5 + [[3.0]] * 5, "not a regular array"),
    ("FP32", [[1.0]] * 6 + [1.0] * 4, "not a regular array"),
    ("FP32", [[1.0] * 5, [1.0] * 4 + [[1.0]]], "not a regular array"),  # rows over a slice, ragged within
    ("FP32", [[[1.0] * 5], [[1.0] * 4, [1.0]]], "not a regular array"),  # ragged where rows are split up
    ("FP32", [[1.0] * 5, 1.0, 1.0, 1.0, 1.0, 1.0], "not a regular array"),
    ("FP32", [[1.0] * 5, [1.0] * 4 + ["a"]], "FP32 data must be numbers"),
    ("FP32", [1.0] * 8 + ["a", "b"], "FP32 data must be numbers"),
    ("INT8", [1] * 8 + [1000, 1], "out of range"),
    ("INT8", [1000] * 8 + [1.5, 1], "INT8 data must be integers"),
    ("INT32", [1] * 8 + [1.5, 1], "must be integers"),
    ("BOOL", [True] * 8 + [1, 0], "true or false"),
])
def test_a_late_slice_of_bad_data_is_refused_as_the_whole_would_be(
    monkeypatch: pytest.MonkeyPatch, datatype: str, data: list[Any], refusal: str,
) -> None:
    with pytest.raises(InvalidInput, match=refusal):
        json_tensor(data, datatype, [10], "x")
    monkeypatch.setattr(v2, "VALUES_A_CALL", 4)
    with pytest.raises(InvalidInput, match=refusal):
        json_tensor(data, datatype, [10], "x")


@pytest.mark.parametrize("data", [
    [0.0] * 16_383 + ["a" * 1_000_000],  # small and flat
    [[0.0] * 16] * 1_024 + [[0.0] * 15 + ["a" * 1_000_000]],  # nested, converted whole
    [0.0] * 40_000 + ["a" * 1_000_000],  # converted in slices
    [[0.0] * 40_000, [0.0] * 39_999 + ["a" * 1_000_000]],  # rows over a slice
])
def test_a_long_string_among_numbers_is_refused_before_numpy_reads_it(data: list[Any]) -> None:
    """numpy reads one string among numbers as text: an array of as many strings, each as long as
    the longest (here 61 GiB and up, a MemoryError), for a body of about a megabyte."""
    values = len(data) if not isinstance(data[0], list) else sum(len(row) for row in data)
    with pytest.raises(InvalidInput, match="FP32 data must be numbers"):
        json_tensor(data, "FP32", [values], "x")


def test_a_string_among_numbers_costs_no_more_memory_than_the_numbers() -> None:
    data = [0.0] * 1_000 + ["a" * 1_000]  # read as text: 1,001 strings of 1,000 characters, 4 MB
    tracemalloc.start()
    try:
        with pytest.raises(InvalidInput, match="INT32 data must be integers"):
            json_tensor(data, "INT32", [1_001], "x")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


@pytest.mark.parametrize(("datatype", "data", "refusal"), [
    ("FP32", [1.5, 10**400, "a"], "FP32 data must be numbers"),  # past a float's range, then text
    ("FP32", [1.5, 10**400], "FP32 data must be numbers"),  # numpy reads it as an object
    ("INT64", [1, 10**400], "out of range for INT64"),
    ("FP32", [1.0, [2.0]], "not a regular array"),
    ("FP32", [[1.0], [None]], "FP32 data must be numbers"),
    ("BOOL", [True, "true"], "BOOL data must be true or false"),
    ("UINT8", [[1, 2], [3, {}]], "UINT8 data must be integers"),
])
def test_what_is_not_a_number_is_refused_by_kind(datatype: str, data: list[Any], refusal: str) -> None:
    shape = [len(data)] if not isinstance(data[0], list) else [len(data), len(data[0])]
    with pytest.raises(InvalidInput, match=refusal):
        json_tensor(data, datatype, shape, "x")


def test_json_integer_extremes() -> None:
    _, array = decode_request(one_input("INT64", [2], [-(2**63), 2**63 - 1])).inputs["x"]
    assert array.tolist() == [-(2**63), 2**63 - 1]
    _, array = decode_request(one_input("UINT64", [2], [2**63, 2**64 - 1])).inputs["x"]
    assert array.dtype == np.uint64 and array.tolist() == [2**63, 2**64 - 1]
    with pytest.raises(InvalidInput):
        decode_request(one_input("INT64", [1], [2**63]))


def test_json_uint64_large_mixed_with_small() -> None:
    _, array = decode_request(one_input("UINT64", [3], [0, 2**64 - 1, 2**63 + 1])).inputs["x"]
    assert array.dtype == np.uint64 and array.tolist() == [0, 2**64 - 1, 2**63 + 1]


# --- binary inputs from tritonclient -----------------------------------------------------


@pytest.mark.parametrize("datatype", [*INTEGERS, *FLOATS, "BOOL", "BYTES"])
def test_binary_client_body_decodes(datatype: str) -> None:
    expected = sample(datatype, [2, 3])
    body, header_length = client_body([client_input("x", expected, datatype, binary=True)])
    assert header_length is not None and header_length < len(body)
    decoded = decode_request(body, header_length)
    dt, array = decoded.inputs["x"]
    assert dt == datatype
    assert_same(array, expected)


@pytest.mark.parametrize("datatype", [*INTEGERS, "FP16", "FP32", "FP64", "BOOL", "BYTES"])
def test_json_client_body_matches_binary(datatype: str) -> None:
    expected = sample(datatype, [3, 2])
    if datatype == "BYTES":  # JSON carries UTF-8 strings only
        expected = np.array([[b"a", b""], ["h\u00e9".encode(), b"xyz"], [b"1", b"2"]], dtype=object)
    json_req, json_len = client_body([client_input("x", expected, datatype, binary=False)])
    binary_req, binary_len = client_body([client_input("x", expected, datatype, binary=True)])
    assert json_len is None and binary_len is not None
    _, from_json = decode_request(json_req, json_len).inputs["x"]
    _, from_binary = decode_request(binary_req, binary_len).inputs["x"]
    assert_same(from_json, expected)
    assert_same(from_binary, expected)


def test_mixed_json_and_binary_client_inputs() -> None:
    a = sample("FP32", [2, 2])
    b = np.array([b"one", b"two"], dtype=object)
    c = sample("INT64", [3])
    d = np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)
    e = sample("BOOL", [4])
    inputs = [
        client_input("a", a, "FP32", binary=True),
        client_input("b", b, "BYTES", binary=False),
        client_input("c", c, "INT64", binary=True),
        client_input("d", d, "BF16", binary=True),
        client_input("e", e, "BOOL", binary=False),
    ]
    body, header_length = client_body(inputs)
    decoded = decode_request(body, header_length)
    assert list(decoded.inputs) == ["a", "b", "c", "d", "e"]
    for name, expected in zip("abcde", (a, b, c, d, e)):
        assert_same(decoded.inputs[name][1], expected)
    assert [decoded.inputs[n][0] for n in "abcde"] == ["FP32", "BYTES", "INT64", "BF16", "BOOL"]


def test_header_length_with_json_only_body() -> None:
    body = one_input("INT8", [2], [1, -1])
    _, array = decode_request(body, len(body)).inputs["x"]
    assert_same(array, np.array([1, -1], dtype=np.int8))


def test_binary_without_header_length_is_rejected() -> None:
    body, _header_length = client_body([client_input("x", sample("FP32", [2]), "FP32", binary=True)])
    with pytest.raises(InvalidInput):
        decode_request(body)


def test_binary_leftover_bytes_rejected() -> None:
    body, header_length = client_body([client_input("x", sample("FP32", [2]), "FP32", binary=True)])
    with pytest.raises(InvalidInput, match="after the last"):
        decode_request(body + b"\x00", header_length)


# --- id, parameters, requested outputs ---------------------------------------------------


def test_id_and_parameters_pass_through() -> None:
    body, header_length = client_body(
        [client_input("x", sample("FP32", [1]), "FP32", binary=False)],
        outputs=[triton_http.InferRequestedOutput("y", binary_data=False)],
        request_id="req-42",
        parameters={"custom": "v", "n": 3},
    )
    decoded = decode_request(body, header_length)
    assert decoded.id == "req-42"
    assert decoded.parameters == {"custom": "v", "n": 3}
    assert decoded.binary_output is False


def test_no_id_no_parameters() -> None:
    decoded = decode_request(one_input("FP32", [1], [1.0]))
    assert decoded.id is None
    assert decoded.parameters == {}
    assert decoded.outputs is None
    assert decoded.binary_output is False


def test_non_string_id_rejected() -> None:
    with pytest.raises(InvalidInput, match="'id' must be a string"):
        decode_request(json_body([{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}], id=5))


def test_client_without_outputs_asks_binary_for_all() -> None:
    body, header_length = client_body([client_input("x", sample("FP32", [1]), "FP32", binary=False)])
    decoded = decode_request(body, header_length)
    assert decoded.outputs is None
    assert decoded.binary_output is True


def test_requested_outputs_binary_flags_from_client() -> None:
    outputs = [
        triton_http.InferRequestedOutput("p", binary_data=True),
        triton_http.InferRequestedOutput("q", binary_data=False),
    ]
    body, header_length = client_body(
        [client_input("x", sample("FP32", [1]), "FP32", binary=True)], outputs=outputs
    )
    decoded = decode_request(body, header_length)
    assert decoded.outputs == [RequestedOutput("p", True), RequestedOutput("q", False)]


def test_requested_outputs_default_and_binary_data_output() -> None:
    inputs = [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]
    body = json_body(
        inputs,
        outputs=[{"name": "p"}, {"name": "q", "parameters": {"binary_data": False}}],
        parameters={"binary_data_output": True},
    )
    decoded = decode_request(body)
    assert decoded.outputs == [RequestedOutput("p", None), RequestedOutput("q", False)]
    assert decoded.binary_output is True


# --- rejected requests -------------------------------------------------------------------


def _input(**fields: Any) -> dict[str, Any]:
    return {"name": "x", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0], **fields}


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"{not json", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"inputs"', "must be a JSON object"),
        (b"{}", "'inputs' must be a non-empty list"),
        (b'{"inputs": []}', "'inputs' must be a non-empty list"),
        (b'{"inputs": {"name": "x"}}', "'inputs' must be a non-empty list"),
        (json_body([_input(), _input()]), "given more than once"),
        (json_body([{"name": "x", "datatype": "FP32", "shape": [2]}]), "neither 'data' nor"),
        (
            json_body([_input(parameters={"binary_data_size": 8})]),
            "both 'data' and 'binary_data_size'",
        ),
        (json_body([_input(shape=[3])]), r"shape \[3\] needs 3 elements, data has 2"),
        (json_body([_input(shape=[2, 2])]), "needs 4 elements"),
        (json_body([_input(data=[[1.0, 2.0], [3.0]])]), "not a regular array"),
        (json_body([_input(datatype="INT32", data=[1.5, 2.0])]), "INT32 data must be integers"),
        (json_body([_input(datatype="UINT8", data=[1, 256])]), "out of range for UINT8"),
        (json_body([_input(datatype="UINT8", data=[-1, 2])]), "out of range for UINT8"),
        (json_body([_input(datatype="INT8", data=[-129, 0])]), "out of range for INT8"),
        (json_body([_input(data=["1.0", "2.0"])]), "FP32 data must be numbers"),
        (json_body([_input(data=[None, 1.0])]), "FP32 data must be numbers"),
        (json_body([_input(datatype="BOOL", data=[0, 1])]), "BOOL data must be true or false"),
        (json_body([_input(datatype="BYTES", data=["a", 1])]), "BYTES data must be strings"),
        (json_body([_input(datatype="BYTES", data=[["a"], [None]])]), "BYTES data must be strings"),
        (json_body([_input(datatype="FLOAT")]), "unknown datatype"),
        (json_body([_input(shape=[-1])]), "'shape' must be a list of non-negative integers"),
        (json_body([_input(shape=[2.0])]), "'shape' must be a list of non-negative integers"),
        (json_body([_input(shape="2")]), "'shape' must be a list of non-negative integers"),
        (json_body([{"datatype": "FP32", "shape": [1], "data": [1]}]), "has no 'name'"),
        (json_body([{"name": "x", "shape": [1], "data": [1]}]), "has no 'datatype'"),
        (json_body(["x"]), "each input must be an object"),
        (json_body([_input(parameters=[1])]), "'parameters' of the input 'x' must be an object"),
        (json_body([_input()], parameters="yes"), "'parameters' of the request must be an object"),
        (json_body([_input()], outputs={"name": "y"}), "'outputs' must be a list"),
        (json_body([_input()], outputs=[{"binary_data": True}]), "must be an object with a 'name'"),
    ],
)
def test_invalid_requests(body: bytes, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        decode_request(body)


def test_binary_data_size_beyond_body() -> None:
    body = json_body([{"name": "x", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}}])
    with pytest.raises(InvalidInput, match="binary_data_size 8"):
        decode_request(body + b"\x00" * 4, len(body))


def test_header_length_beyond_body() -> None:
    body = one_input("FP32", [1], [1.0])
    with pytest.raises(InvalidInput, match="Inference-Header-Content-Length"):
        decode_request(body, len(body) + 1)


def test_unsupported_extensions() -> None:
    document = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}],
        "outputs": [{"name": "y", "parameters": {"classification": 3}}],
    }
    with pytest.raises(Unsupported):
        decode_request(orjson.dumps(document))


def test_client_shared_memory_tensors_are_read_through_the_servers_regions() -> None:
    """tritonclient's shared-memory parameters name the region; the server's regions give the bytes."""
    region = bytearray(64)
    region[16:32] = np.arange(4, dtype=np.float32).tobytes()
    tensor = triton_http.InferInput("x", [4], "FP32")
    tensor.set_shared_memory("region0", 16, offset=16)
    wanted = triton_http.InferRequestedOutput("y")
    wanted.set_shared_memory("region1", 40)
    body, header_length = client_body([tensor], outputs=[wanted])
    parsed = parse_request(body, header_length)
    assert parsed.inputs[0].region == RegionRef("region0", 16, 16)
    assert parsed.outputs is not None and parsed.outputs[0].region == RegionRef("region1", 40)
    seen: list[tuple[RegionRef, str]] = []

    def read_inputs(refs: list[tuple[RegionRef, str]]) -> list[memoryview]:
        seen.extend(refs)
        return [memoryview(region)[ref.offset:ref.offset + ref.byte_size] for ref, _ in refs]

    decoded = build_tensors(parsed, read_inputs)
    assert decoded.inputs["x"][1].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert seen == [(RegionRef("region0", 16, 16), "input 'x'")]
    with pytest.raises(Unsupported, match="shared-memory"):
        build_tensors(parsed)  # no reader: the server takes no shared memory


def test_shared_memory_inputs_cost_their_decoding_a_share_of_their_bytes_or_all_of_them_as_text() -> None:
    """Numbers are copied out of a region (cheap a byte), text is walked: what decides whether
    a request is decoded on the event loop or on a thread."""
    body = orjson.dumps({"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [1 << 18],
         "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 1 << 20}},
        {"name": "t", "datatype": "BYTES", "shape": [1],
         "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 1000}}]})
    assert parse_request(body, None).decode_bytes == len(body) + (1 << 20) // COPIED_PER_WALKED + 1000


@pytest.mark.parametrize(
    "tensor",
    [
        {"data": [1.0]},
        {"parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 4, "binary_data_size": 4}},
        {"parameters": {"shared_memory_region": "r"}},
    ],
    ids=["data-too", "binary-too", "no-size"],
)
def test_a_shared_memory_input_is_that_alone(tensor: dict[str, Any]) -> None:
    raw = {"name": "x", "datatype": "FP32", "shape": [1],
           "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 4}} | tensor
    with pytest.raises(InvalidInput, match="input 'x'"):
        decode_request(orjson.dumps({"inputs": [raw]}))


def test_outputs_in_shared_memory_carry_their_region_and_size_in_place_of_data() -> None:
    outputs = [("y", "FP32", np.ones((1, 2), np.float32), False), ("z", "FP32", np.zeros(1, np.float32), True)]
    body, header_length = encode_response("m", 1, None, outputs, {"y": ("region1", 8)})
    result = triton_http.InferResult.from_response_body(body, header_length=header_length)
    assert result.get_output("y") == {"name": "y", "datatype": "FP32", "shape": [1, 2], "parameters": {
        "shared_memory_region": "region1", "shared_memory_byte_size": 8}}
    assert result.as_numpy("z").tolist() == [0.0]


def test_client_classification_unsupported() -> None:
    body, header_length = client_body(
        [client_input("x", sample("FP32", [1]), "FP32", binary=False)],
        outputs=[triton_http.InferRequestedOutput("y", class_count=3)],
    )
    with pytest.raises(Unsupported, match="classification"):
        decode_request(body, header_length)


@pytest.mark.parametrize("datatype", ["INT32", "FP32"])
def test_json_booleans_rejected_for_numeric_types(datatype: str) -> None:
    with pytest.raises(InvalidInput):
        decode_request(one_input(datatype, [2], [True, False]))


@pytest.mark.parametrize("datatype", ["FP32", "BYTES"])
def test_json_absurd_zero_size_shape_is_invalid_input(datatype: str) -> None:
    with pytest.raises(InvalidInput):
        decode_request(one_input(datatype, [0, 2**63], []))


# --- responses ---------------------------------------------------------------------------


def parse(body: bytes, header_length: int | None) -> triton_http.InferResult:
    return triton_http.InferResult.from_response_body(body, header_length=header_length)


RESPONSE_TYPES = ["FP32", "INT64", "BOOL", "FP16", "BF16", "UINT8", "INT8", "FP64", "UINT64"]


@pytest.mark.parametrize("datatype", RESPONSE_TYPES)
def test_json_output_round_trips_through_tritonclient(datatype: str) -> None:
    array = sample(datatype, [2, 3])
    body, header_length = encode_response("m", 3, None, [("out", datatype, array, False)])
    assert header_length is None
    document = orjson.loads(body)
    assert document["model_name"] == "m" and document["model_version"] == "3"
    assert "id" not in document
    assert document["outputs"][0]["shape"] == [2, 3]
    assert "parameters" not in document["outputs"][0]
    result = parse(body, header_length)
    got = result.as_numpy("out")
    assert got.shape == (2, 3)
    np.testing.assert_array_equal(got.astype(np.float64), array.astype(np.float64))


def test_json_fp16_bf16_are_plain_floats() -> None:
    fp16 = np.array([0.1, 65504.0], dtype=np.float16)
    bf16 = np.array([1.5, -3.0], dtype=ml_dtypes.bfloat16)
    body, _ = encode_response("m", 1, None, [("h", "FP16", fp16, False), ("b", "BF16", bf16, False)])
    outputs = orjson.loads(body)["outputs"]
    assert all(isinstance(v, float) for o in outputs for v in o["data"])
    assert np.float16(outputs[0]["data"][0]) == fp16[0]
    assert outputs[0]["data"][1] == 65504.0
    assert outputs[1]["data"] == [1.5, -3.0]
    result = parse(body, None)
    assert_same(result.as_numpy("h"), fp16)
    assert_same(result.as_numpy("b"), bf16)


@pytest.mark.parametrize("datatype", ["FP16", "BF16", "FP32", "FP64"])
def test_json_nan_and_infinities_come_back_as_triton_writes_them(datatype: str) -> None:
    """orjson wrote null for each: a client read an infinity back as NaN, or got None. Triton
    writes NaN, Infinity and -Infinity (rapidjson's flag), which tritonclient and Python's json
    read back."""
    array = np.array([[0.5, np.nan, np.inf], [-np.inf, -2.0, np.nan]], np.float32).astype(numpy_dtype(datatype))
    body, _ = encode_response("m", 1, None, [("y", datatype, array, False)])
    assert b"[0.5,NaN,Infinity,-Infinity,-2.0,NaN]" in body
    result = parse(body, None).as_numpy("y")
    assert result.shape == (2, 3)
    np.testing.assert_array_equal(result.astype(np.float64), array.astype(np.float64))


def test_nan_among_several_outputs_lands_on_its_own_values() -> None:
    """A name, an id or a BYTES string of "null" makes no float value NaN; each output keeps its own."""
    outputs = [
        ("null", "BYTES", np.array([b"null", b"x"], dtype=object), False),
        ("a", "FP32", np.array([1.0, np.inf], np.float32), False),
        ("n", "INT32", np.array([7, -7], np.int32), False),
        ("b", "FP64", np.array([np.nan, -np.inf, 2.5]), False),
        ("c", "FP32", np.array([3.0], np.float32), False),
    ]
    body, _ = encode_response("m", 1, "null", outputs)
    assert b'"data":["null","x"]' in body and b'"data":[1.0,Infinity]' in body
    assert b'"data":[7,-7]' in body and b'"data":[NaN,-Infinity,2.5]' in body and b'"data":[3.0]' in body
    result = parse(body, None)
    np.testing.assert_array_equal(result.as_numpy("b"), outputs[3][2])


@pytest.mark.parametrize("datatype", ["FP16", "BF16", "FP32", "FP64"])
def test_json_request_with_nan_and_infinities_is_read_as_triton_reads_it(datatype: str) -> None:
    """tritonclient's JSON tensors write them as Python's json does, and Triton's parser takes
    them; orjson does not (it refused the body with 400)."""
    body = (b'{"inputs": [{"name": "x", "datatype": "%s", "shape": [2, 2], "data": [[NaN, Infinity], [-Infinity, 1.5]]}]}'
            % datatype.encode())
    array = build_tensors(parse_request(body, None)).inputs["x"][1]
    assert array.dtype == numpy_dtype(datatype) and array.shape == (2, 2)
    np.testing.assert_array_equal(array.astype(np.float64), [[np.nan, np.inf], [-np.inf, 1.5]])


def test_json_request_with_nan_keeps_its_other_checks() -> None:
    """Only NaN and the infinities are read besides what orjson reads: a NaN among integers, and
    everything orjson refuses in such a body, is still a clear 400."""
    nan_among_ints = b'{"inputs": [{"name": "x", "datatype": "INT32", "shape": [2], "data": [1, NaN]}]}'
    with pytest.raises(InvalidInput, match="INT32 data must be integers"):
        build_tensors(parse_request(nan_among_ints, None))
    with pytest.raises(InvalidInput, match="lacks its pair"):  # Python's json would read it into a str no encoder takes
        v2.json_object(b'{"id": "\\ud800", "inputs": [NaN]}')
    with pytest.raises(InvalidInput, match="lacks its pair"):
        v2.json_object(b'{"id": "\\udc00x", "inputs": [NaN]}')
    with pytest.raises(InvalidInput, match="not UTF-8"):  # Python's json reads bytes with surrogatepass
        v2.json_object(b'{"id": "\xed\xa0\x80", "inputs": [NaN]}')
    with pytest.raises(InvalidInput, match="nests too deep"):
        v2.json_object(b'{"inputs": [NaN, ' + b"[" * 100_000 + b"]" * 100_000 + b"]}")
    with pytest.raises(InvalidInput, match=r"Expecting ',' delimiter: line 1 column 17"):  # where it is, not at the NaN
        v2.json_object(b'{"inputs": [NaN 1]}')
    with pytest.raises(InvalidInput, match="must be a JSON object"):
        v2.json_object(b"[NaN]")
    with pytest.raises(InvalidInput, match="Exceeds the limit"):  # Python's json alone refuses it, with a ValueError
        v2.json_object(b'{"inputs": [NaN], "id": ' + b"1" * 5000 + b"}")
    escaped = v2.json_object(b'{"id": "\\\\ud800", "inputs": [NaN]}')  # an escaped backslash, then text
    assert escaped["id"] == "\\ud800"
    paired = v2.json_object(b'{"id": "\\ud83d\\ude00", "inputs": [Infinity]}')  # a pair is one character
    assert paired == {"id": "\U0001f600", "inputs": [math.inf]}


def test_json_bytes_output_round_trips() -> None:
    array = np.array([[b"a", "h\u00e9".encode()], [b"", b"zz"]], dtype=object)
    body, header_length = encode_response("m", 1, None, [("s", "BYTES", array, False)])
    assert orjson.loads(body)["outputs"][0]["data"] == ["a", "h\u00e9", "", "zz"]
    got = parse(body, header_length).as_numpy("s")
    assert got.shape == (2, 2)
    assert [x.encode() if isinstance(x, str) else x for x in got.reshape(-1)] == array.reshape(-1).tolist()


def test_json_bytes_output_not_utf8_rejected() -> None:
    array = np.array([b"ok", b"\xff\xfe"], dtype=object)
    with pytest.raises(InvalidInput, match="not UTF-8; ask for it with binary_data"):
        encode_response("m", 1, None, [("s", "BYTES", array, False)])


@pytest.mark.parametrize("datatype", [*RESPONSE_TYPES, "BYTES", "INT32", "UINT16"])
def test_binary_output_round_trips_through_tritonclient(datatype: str) -> None:
    array = sample(datatype, [3, 2])
    body, header_length = encode_response("m", 1, "r", [("out", datatype, array, True)])
    assert header_length is not None
    header = orjson.loads(body[:header_length])
    assert header["outputs"][0]["parameters"]["binary_data_size"] == len(body) - header_length
    assert "data" not in header["outputs"][0]
    got = parse(body, header_length).as_numpy("out")
    if datatype == "BYTES":
        assert got.shape == array.shape and got.tolist() == array.tolist()
    else:
        assert_same(got, array)


def test_binary_non_utf8_bytes_output_allowed() -> None:
    array = np.array([b"\xff\xfe", b"ok"], dtype=object)
    body, header_length = encode_response("m", 1, None, [("s", "BYTES", array, True)])
    assert parse(body, header_length).as_numpy("s").tolist() == [b"\xff\xfe", b"ok"]


def test_mixed_binary_and_json_outputs() -> None:
    a = sample("FP32", [2, 2])
    b = sample("INT64", [3])
    c = np.array([b"x", b"yz"], dtype=object)
    d = sample("BOOL", [5])
    e = np.array([1.5, 2.5], dtype=ml_dtypes.bfloat16)
    outputs = [
        ("a", "FP32", a, True),
        ("b", "INT64", b, False),
        ("c", "BYTES", c, True),
        ("d", "BOOL", d, False),
        ("e", "BF16", e, True),
    ]
    body, header_length = encode_response("model", 7, "id-9", outputs)
    assert header_length is not None
    header = orjson.loads(body[:header_length])
    assert header["id"] == "id-9"
    assert header["model_version"] == "7"
    assert [o["name"] for o in header["outputs"]] == ["a", "b", "c", "d", "e"]
    assert [("data" in o) for o in header["outputs"]] == [False, True, False, True, False]
    result = parse(body, header_length)
    assert result.get_response()["id"] == "id-9"
    assert_same(result.as_numpy("a"), a)
    assert_same(result.as_numpy("b"), b)
    assert result.as_numpy("c").tolist() == c.tolist()
    assert_same(result.as_numpy("d"), d)
    assert_same(result.as_numpy("e"), e)


def test_empty_binary_output() -> None:
    array = np.zeros((0, 4), dtype=np.float32)
    body, header_length = encode_response("m", 1, None, [("z", "FP32", array, True)])
    assert header_length == len(body)
    got = parse(body, header_length).as_numpy("z")
    assert got.shape == (0, 4)


def test_id_echoed_in_json_response() -> None:
    body, _ = encode_response("m", 2, "abc", [("y", "FP32", np.ones(1, np.float32), False)])
    assert orjson.loads(body)["id"] == "abc"
    assert parse(body, None).get_response()["id"] == "abc"


def test_binary_output_dtype_mismatch_rejected() -> None:
    with pytest.raises(InvalidInput):
        encode_response("m", 1, None, [("y", "FP32", np.ones(2, np.float64), True)])


def test_encode_error() -> None:
    assert orjson.loads(encode_error('bad "x"')) == {"error": 'bad "x"'}


def test_decoded_request_defaults() -> None:
    request = DecodedRequest(id=None, parameters={}, inputs={}, outputs=None)
    assert request.binary_output is False


def test_an_output_asked_for_twice_is_refused() -> None:
    document = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}],
                "outputs": [{"name": "y"}, {"name": "y", "parameters": {"shared_memory_region": "r",
                                                                        "shared_memory_byte_size": 4}}]}
    with pytest.raises(InvalidInput, match="output 'y' is asked for more than once"):
        decode_request(orjson.dumps(document))


def test_many_requested_outputs_are_checked_in_one_pass() -> None:
    """The duplicate check runs once over what a client asked for: as a list's, it took
    minutes here for 100,000 names (and held the event loop meanwhile)."""
    names = [{"name": f"o{i}"} for i in range(100_000)]
    document = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}],
                "outputs": [*names, {"name": "o99999"}]}
    started = time.monotonic()
    with pytest.raises(InvalidInput, match="output 'o99999' is asked for more than once"):
        decode_request(orjson.dumps(document))
    assert time.monotonic() - started < 30, "a check over 100,000 names held the loop (a fraction of a second in one pass)"


@pytest.mark.parametrize(("outputs", "parameters", "refused"), [
    ([{"name": "y", "parameters": {"binary_data": "false"}}], {}, "output 'y': 'binary_data' must be true or false"),
    ([{"name": "y", "parameters": {"binary_data": 1}}], {}, "output 'y': 'binary_data'"),
    (None, {"binary_data_output": "false"}, "the request: 'binary_data_output' must be true or false"),
])
def test_a_binary_data_flag_that_is_not_true_or_false_is_refused(
    outputs: list[dict[str, Any]] | None, parameters: dict[str, Any], refused: str,
) -> None:
    """The string "false" used to read as true."""
    document: dict[str, Any] = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}],
                                "parameters": parameters}
    if outputs is not None:
        document["outputs"] = outputs
    with pytest.raises(InvalidInput, match=refused):
        decode_request(orjson.dumps(document))
