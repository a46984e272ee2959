"""Binary tensor data: round trips, byte-for-byte agreement with tritonclient, and rejects."""

from __future__ import annotations

import contextlib
import json
import random
import struct
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tritonclient.http as triton_http
from tritonclient.http._utils import _get_inference_request
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from server.errors import InvalidInput
from server.protocol.binary import (
    BinaryCursor,
    split_binary_section,
    split_body,
    tensor_from_bytes,
    tensor_to_bytes,
)
from server.protocol.datatypes import numpy_dtype
from tests.unit.protocol.kinds import FLOATS, INTEGERS

SHAPES = [[2, 3], [6], [1, 2, 3], [], [0], [3, 0, 2]]


def sample(datatype: str, shape: list[int]) -> np.ndarray:
    """Values that exercise each type's edges: extremes, signs, inf, nan, subnormals."""
    count = int(np.prod(shape))
    dtype = numpy_dtype(datatype)
    if datatype == "BOOL":
        values: Any = [i % 3 == 0 for i in range(count)]
    elif datatype == "BYTES":
        pool = [
            b"",
            b"a",
            "h\u00e9llo \u4e16\u754c".encode(),
            b"\x00mid\x00",
            b"\xff\xfe",
            b"x" * 300,
        ]
        values = [pool[i % len(pool)] for i in range(count)]
    elif datatype in INTEGERS:
        info = np.iinfo(dtype)
        pool = [info.min, info.max, 0, 1, info.max // 3, info.min // 5 if info.min else 7]
        values = [pool[i % len(pool)] for i in range(count)]
    else:
        pool = [0.0, -0.0, 1.5, -2.25, np.inf, -np.inf, 65504.0, 2.0**-14, 2.0**-24]
        values = [pool[i % len(pool)] for i in range(count)]
    return np.array(values, dtype=dtype).reshape(shape)


def triton_wire_bytes(array: np.ndarray, datatype: str) -> bytes:
    """What tritonclient's HTTP client puts on the wire for this tensor."""
    infer_input = triton_http.InferInput("t", list(array.shape), datatype)
    infer_input.set_data_from_numpy(array, binary_data=True)
    raw = infer_input._get_binary_data()
    assert infer_input._get_tensor()["parameters"]["binary_data_size"] == len(raw)
    return raw


def assert_same_tensor(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    if expected.dtype == np.object_:
        assert actual.tolist() == expected.tolist()
    else:
        assert actual.tobytes() == expected.tobytes()  # also compares nan and -0.0 exactly


# ---- round trips and compatibility -------------------------------------------------

ALL = ["BOOL", *INTEGERS, *FLOATS, "BYTES"]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("datatype", ALL)
def test_round_trip(datatype: str, shape: list[int]) -> None:
    array = sample(datatype, shape)
    raw = tensor_to_bytes(array, datatype)
    assert_same_tensor(tensor_from_bytes(raw, datatype, shape, "t"), array)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("datatype", ALL)
def test_encoding_matches_tritonclient_byte_for_byte(datatype: str, shape: list[int]) -> None:
    array = sample(datatype, shape)
    assert tensor_to_bytes(array, datatype) == triton_wire_bytes(array, datatype)


@pytest.mark.parametrize("datatype", ["BOOL", *INTEGERS, *FLOATS])
def test_fixed_size_encoding_is_numpy_tobytes(datatype: str) -> None:
    array = sample(datatype, [4, 5])
    assert tensor_to_bytes(array, datatype) == array.tobytes()


@pytest.mark.parametrize("datatype", ["BOOL", *INTEGERS, *FLOATS])
def test_decodes_what_tritonclient_sends(datatype: str) -> None:
    array = sample(datatype, [3, 4])
    decoded = tensor_from_bytes(triton_wire_bytes(array, datatype), datatype, [3, 4], "t")
    assert_same_tensor(decoded, array)


def test_fp32_is_little_endian_ieee754() -> None:
    raw = tensor_to_bytes(np.array([1.0, -2.5], dtype=np.float32), "FP32")
    assert raw == struct.pack("<2f", 1.0, -2.5)
    assert tensor_from_bytes(struct.pack("<2f", 1.0, -2.5), "FP32", [2], "t").tolist() == [
        1.0,
        -2.5,
    ]


def test_int64_is_little_endian() -> None:
    assert tensor_to_bytes(np.array([1], dtype=np.int64), "INT64") == b"\x01" + b"\x00" * 7


def test_big_endian_arrays_are_sent_little_endian() -> None:
    array = np.array([1, 2, -3], dtype=">i4")
    raw = tensor_to_bytes(array, "INT32")
    assert raw == struct.pack("<3i", 1, 2, -3)
    assert tensor_from_bytes(raw, "INT32", [3], "t").tolist() == [1, 2, -3]


def test_non_contiguous_arrays_are_sent_row_major() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4).T
    assert not array.flags["C_CONTIGUOUS"]
    assert tensor_to_bytes(array, "FP32") == np.ascontiguousarray(array).tobytes()


@pytest.mark.parametrize("value", [1.0, -2.0, 0.5, 3.140625, -0.0, np.inf, 2.0**100, 2.0**-126])
def test_bf16_is_the_top_half_of_fp32(value: float) -> None:
    """Older tritonclients' serialize_bf16_tensor sent the upper 16 bits of each float32."""
    as_fp32 = np.array([value], dtype="<f4").tobytes()
    raw = tensor_to_bytes(np.array([value], dtype=ml_dtypes.bfloat16), "BF16")
    assert raw == as_fp32[2:4]
    assert float(tensor_from_bytes(as_fp32[2:4], "BF16", [1], "t")[0]) == value


def test_bf16_nan_survives() -> None:
    raw = tensor_to_bytes(np.array([np.nan], dtype=ml_dtypes.bfloat16), "BF16")
    assert np.isnan(tensor_from_bytes(raw, "BF16", [1], "t")[0])


def test_fixed_size_decoding_is_zero_copy_and_read_only() -> None:
    body = bytearray(struct.pack("<4f", 1, 2, 3, 4))
    array = tensor_from_bytes(memoryview(body), "FP32", [2, 2], "t")
    body[0:4] = struct.pack("<f", 9.0)
    assert array[0, 0] == 9.0
    assert not tensor_from_bytes(bytes(body), "FP32", [2, 2], "t").flags.writeable


def test_bool_is_one_byte_per_element() -> None:
    assert tensor_to_bytes(np.array([True, False, True]), "BOOL") == b"\x01\x00\x01"
    assert tensor_from_bytes(b"\x01\x00\x01", "BOOL", [3], "t").tolist() == [True, False, True]


def test_bool_treats_any_non_zero_byte_as_true() -> None:
    decoded = tensor_from_bytes(b"\x00\x01\x02\xff", "BOOL", [2, 2], "t")
    assert decoded.dtype == np.bool_
    assert decoded.tolist() == [[False, True], [True, True]]
    assert (decoded == np.array([[False, True], [True, True]])).all()
    assert decoded.view(np.uint8).max() == 1


@pytest.mark.parametrize(
    "elements",
    [
        [b""],
        [b"", b"", b""],
        [],
        ["h\u00e9llo".encode(), "\u4e16\u754c".encode(), "\U0001f600".encode()],
        [b"\x00", b"a\x00b", b"\x00\x00\x00\x00", b"trailing\x00\x00"],
        [b"\x00\x00\x00\x00\x01\x00\x00\x00"],  # looks like a length prefix
        [b"x" * (3 * 1024 * 1024), b"y"],
        [bytes(range(256))],
    ],
    ids=[
        "one-empty",
        "all-empty",
        "zero-elements",
        "non-ascii",
        "nul",
        "prefix-like",
        "large",
        "all-bytes",
    ],
)
def test_bytes_round_trip_and_compatibility(elements: list[bytes]) -> None:
    array = np.array(elements + [None], dtype=np.object_)[:-1]  # keep numpy from making bytes_
    raw = tensor_to_bytes(array, "BYTES")
    assert raw == b"".join(struct.pack("<I", len(e)) + e for e in elements)
    assert raw == triton_wire_bytes(array, "BYTES")
    decoded = tensor_from_bytes(raw, "BYTES", [len(elements)], "t")
    assert decoded.dtype == np.object_
    assert decoded.tolist() == elements
    assert all(type(e) is bytes for e in decoded.tolist())
    if elements:
        assert serialize_byte_tensor(array).item() == raw
        assert deserialize_bytes_tensor(raw).tolist() == elements


def test_bytes_from_str_elements_are_utf8() -> None:
    array = np.array(["caf\u00e9", "", "\u4e16"], dtype=np.object_)
    raw = tensor_to_bytes(array, "BYTES")
    assert raw == triton_wire_bytes(array, "BYTES")
    assert tensor_from_bytes(raw, "BYTES", [3], "t").tolist() == [
        "caf\u00e9".encode(),
        b"",
        "\u4e16".encode(),
    ]


@pytest.mark.parametrize("dtype", ["S", "U"])
def test_bytes_from_numpy_string_arrays(dtype: str) -> None:
    array = np.array([["ab", "c"], ["", "def"]], dtype=dtype)
    raw = tensor_to_bytes(array, "BYTES")
    assert tensor_from_bytes(raw, "BYTES", [2, 2], "t").tolist() == [[b"ab", b"c"], [b"", b"def"]]
    if dtype == "S":
        assert raw == triton_wire_bytes(array, "BYTES")


def test_bytes_keeps_shape() -> None:
    array = np.array([b"a", b"bb", b"", b"dddd", b"e", b"f"], dtype=np.object_).reshape(1, 2, 3)
    decoded = tensor_from_bytes(tensor_to_bytes(array, "BYTES"), "BYTES", [1, 2, 3], "t")
    assert decoded.shape == (1, 2, 3)
    assert decoded.tolist() == array.tolist()


def test_full_tritonclient_request_splits_and_decodes() -> None:
    tensors = {
        "pixels": (sample("FP32", [2, 3]), "FP32"),
        "prompt": (np.array([b"hello", b"", "w\u00f6rld".encode()], dtype=np.object_), "BYTES"),
        "mask": (sample("BOOL", [5]), "BOOL"),
        "nothing": (np.zeros([0, 4], dtype=np.int64), "INT64"),
        "weights": (sample("BF16", [4]), "BF16"),
        "half": (sample("FP16", [1, 1]), "FP16"),
    }
    inputs = []
    for name, (array, datatype) in tensors.items():
        infer_input = triton_http.InferInput(name, list(array.shape), datatype)
        inputs.append(infer_input.set_data_from_numpy(array, binary_data=True))
    body, header_length = _get_inference_request(
        inputs, "req-1", None, 0, False, False, 0, None, None
    )

    header_bytes, binary = split_body(body, header_length)
    header = json.loads(header_bytes)
    sizes = [
        (tensor["name"], tensor["parameters"]["binary_data_size"]) for tensor in header["inputs"]
    ]
    pieces = split_binary_section(binary, sizes)
    for tensor, piece in zip(header["inputs"], pieces, strict=True):
        decoded = tensor_from_bytes(piece, tensor["datatype"], tensor["shape"], tensor["name"])
        assert_same_tensor(decoded, tensors[tensor["name"]][0])


def test_split_body_at_the_edges() -> None:
    assert split_body(b"{}rest", 2)[0] == b"{}"
    assert bytes(split_body(b"{}rest", 2)[1]) == b"rest"
    header, binary = split_body(b"{}", 2)
    assert (header, len(binary)) == (b"{}", 0)
    header, binary = split_body(b"data", 0)
    assert (header, bytes(binary)) == (b"", b"data")


def test_split_body_does_not_copy_the_binary_part() -> None:
    body = b'{"a":1}' + bytes(1000)
    _, binary = split_body(body, 7)
    assert binary.obj is body


def test_cursor_walks_in_order_and_finishes_exactly() -> None:
    cursor = BinaryCursor(b"aaaabbcccccc")
    assert bytes(cursor.take(4, "a")) == b"aaaa"
    assert bytes(cursor.take(0, "empty")) == b""
    assert bytes(cursor.take(2, "b")) == b"bb"
    assert cursor.remaining == 6
    assert bytes(cursor.take(6, "c")) == b"cccccc"
    cursor.finish()


def test_split_binary_section_with_nothing() -> None:
    assert split_binary_section(b"", []) == []


# ---- malformed input ----------------------------------------------------------------


@pytest.mark.parametrize("header_length", [-1, 13, 10**9])
def test_split_body_rejects_header_length_out_of_range(header_length: int) -> None:
    with pytest.raises(InvalidInput) as caught:
        split_body(b'{"inputs":[]}'[:12], header_length)
    assert str(header_length) in caught.value.message


@pytest.mark.parametrize("header_length", [1.0, "2", None, True])
def test_split_body_rejects_non_integer_header_length(header_length: object) -> None:
    with pytest.raises(InvalidInput):
        split_body(b"{}", header_length)  # type: ignore[arg-type]


@pytest.mark.parametrize("datatype", ["BOOL", *INTEGERS, *FLOATS])
@pytest.mark.parametrize("delta", [-1, 1, -4, 8])
def test_fixed_size_rejects_a_size_mismatch(datatype: str, delta: int) -> None:
    raw = tensor_to_bytes(sample(datatype, [2, 3]), datatype)
    wrong = raw[:delta] if delta < 0 else raw + bytes(delta)
    with pytest.raises(InvalidInput) as caught:
        tensor_from_bytes(wrong, datatype, [2, 3], "pixels")
    message = caught.value.message
    assert "'pixels'" in message
    assert str(len(raw)) in message and str(len(wrong)) in message


def test_fixed_size_rejects_data_for_the_wrong_shape() -> None:
    with pytest.raises(InvalidInput):
        tensor_from_bytes(bytes(24), "FP32", [2, 2], "t")


@pytest.mark.parametrize(
    ("raw", "shape", "phrase"),
    [
        pytest.param(b"\x01\x00", [1], "at least 4 bytes", id="shorter-than-a-prefix"),
        pytest.param(
            b"\x03\x00\x00\x00abc\x00\x00\x00",
            [2],
            "element 1 has a truncated length prefix (3 of 4 bytes)",
            id="truncated-prefix",
        ),
        pytest.param(
            b"\x01\x00\x00\x00a\x02\x00\x00",
            [2],
            "truncated length prefix",
            id="truncated-prefix-2",
        ),
        pytest.param(
            b"\x05\x00\x00\x00abc", [1], "element 0 declares 5 bytes", id="length-past-end"
        ),
        pytest.param(
            b"\x00\x00\x00\x00\xff\xff\xff\xff",
            [2],
            "element 1 declares 4294967295 bytes",
            id="huge-length",
        ),
        pytest.param(b"\x01\x00\x00\x00ab", [1], "1 bytes left over", id="trailing-byte"),
        pytest.param(
            b"\x00\x00\x00\x00\x00\x00\x00\x00", [1], "4 bytes left over", id="trailing-element"
        ),
        pytest.param(
            b"\x01\x00\x00\x00a\x00\x00\x00\x00", [1], "left over", id="trailing-empty-element"
        ),
        pytest.param(b"\x03\x00\x00\x00abc", [2], "at least 8 bytes", id="too-few-elements"),
        pytest.param(
            b"\x01\x00\x00\x00a\x01\x00\x00\x00b", [3], "at least 12 bytes", id="too-few-elements-2"
        ),
        pytest.param(
            b"\x00\x00\x00\x00\x04\x00\x00\x00abcd\x00\x00\x00\x00",
            [4],
            "holds only 3 of its 4 elements",
            id="too-few-elements-3",
        ),
        pytest.param(b"\x00\x00\x00\x00" * 3, [2], "4 bytes left over", id="too-many-elements"),
        pytest.param(b"abc", [0], "3 bytes left over", id="zero-elements-with-data"),
        pytest.param(b"", [1], "at least 4 bytes", id="no-data"),
        pytest.param(
            b"\x00\x00\x00\x00", [10**12], "at least 4000000000000 bytes", id="absurd-count"
        ),
    ],
)
def test_bytes_rejects_malformed_data(raw: bytes, shape: list[int], phrase: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        tensor_from_bytes(raw, "BYTES", shape, "prompt")
    assert "'prompt'" in caught.value.message
    assert phrase in caught.value.message


@pytest.mark.parametrize("datatype", ["FP8", "fp32", "STRING", ""])
def test_rejects_unknown_datatype(datatype: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        tensor_from_bytes(b"", datatype, [0], "x")
    assert "'x'" in caught.value.message and "FP32" in caught.value.message
    with pytest.raises(InvalidInput):
        tensor_to_bytes(np.zeros(0, dtype=np.float32), datatype)


@pytest.mark.parametrize("datatype", ["FP32", "BYTES", "BOOL"])
@pytest.mark.parametrize(
    "shape",
    [[-1], [2, -3], [-1, 0], [1.5], ["2"], [None], [True], "12", None, np.array([1, 2]), [[1]]],
    ids=str,
)
def test_rejects_invalid_shapes(datatype: str, shape: Any) -> None:
    with pytest.raises(InvalidInput) as caught:
        tensor_from_bytes(b"", datatype, shape, "bad_shape")
    assert "'bad_shape'" in caught.value.message


@pytest.mark.parametrize("datatype", ["FP32", "BYTES"])
@pytest.mark.parametrize("shape", [[0, 2**62], [0, 2**63], [2**64, 0]], ids=str)
def test_rejects_absurdly_large_shapes(datatype: str, shape: list[int]) -> None:
    with pytest.raises(InvalidInput):
        tensor_from_bytes(b"", datatype, shape, "t")


def test_accepts_numpy_integer_dims() -> None:
    shape = [np.int64(2), np.int32(1)]
    assert tensor_from_bytes(bytes(8), "FP32", shape, "t").shape == (2, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [-1, 1.0, "4", None, True, [4]])
def test_cursor_rejects_invalid_sizes(size: object) -> None:
    with pytest.raises(InvalidInput) as caught:
        BinaryCursor(b"abcd").take(size, "weights")
    assert "'weights'" in caught.value.message


@pytest.mark.parametrize(
    ("binary", "sizes", "phrase"),
    [
        (b"abc", [("a", 4)], "only 3 bytes"),
        (b"abcdef", [("a", 4), ("b", 4)], "only 2 bytes"),
        (b"", [("a", 1)], "only 0 bytes"),
        (b"abcdef", [("a", 4)], "2 bytes of binary data after"),
        (b"x", [], "1 bytes of binary data after"),
        (b"abcdef", [("a", 0), ("b", 5)], "1 bytes of binary data after"),
    ],
    ids=[
        "missing",
        "missing-second",
        "missing-all",
        "trailing",
        "trailing-no-inputs",
        "trailing-after-empty",
    ],
)
def test_split_binary_section_rejects_sizes_that_do_not_add_up(
    binary: bytes, sizes: list[tuple[str, int]], phrase: str
) -> None:
    with pytest.raises(InvalidInput) as caught:
        split_binary_section(binary, sizes)
    assert phrase in caught.value.message


@pytest.mark.parametrize("element", [1, 2.5, None, ["a"], bytearray(b"a")], ids=repr)
def test_bytes_encoding_rejects_non_string_elements(element: object) -> None:
    array = np.array([b"ok", element, None], dtype=np.object_)[:2]
    with pytest.raises(InvalidInput) as caught:
        tensor_to_bytes(array, "BYTES")
    assert "element 1" in caught.value.message


def test_bytes_encoding_rejects_unencodable_str() -> None:
    with pytest.raises(InvalidInput):
        tensor_to_bytes(np.array(["\ud800"], dtype=np.object_), "BYTES")


@pytest.mark.parametrize(
    ("dtype", "datatype"),
    [
        (np.float64, "FP32"),
        (np.float32, "BF16"),
        (np.int32, "INT64"),
        (np.uint8, "BOOL"),
        (np.bool_, "UINT8"),
        (np.object_, "FP32"),
    ],
)
def test_fixed_size_encoding_rejects_a_dtype_mismatch(dtype: type, datatype: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        tensor_to_bytes(np.zeros(3, dtype=dtype), datatype)
    assert datatype in caught.value.message


@pytest.mark.parametrize("seed", range(20))
def test_random_garbage_raises_only_invalid_input(seed: int) -> None:
    """Whatever a client sends, the decoder answers with a tensor or InvalidInput, never a crash."""
    rng = random.Random(seed)
    for _ in range(300):
        raw = bytes(rng.choice([0, 1, 2, 3, 4, 255]) for _ in range(rng.randrange(0, 24)))
        datatype = rng.choice(ALL)
        shape = [rng.randrange(-1, 4) for _ in range(rng.randrange(0, 3))]
        with contextlib.suppress(InvalidInput):
            tensor_from_bytes(raw, datatype, shape, "fuzz")
