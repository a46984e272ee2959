"""Properties of the KServe v2 codecs, searched with hypothesis.

1. Whatever a client sends (any JSON document, any bytes, any binary header length, tensors that
   are almost right), decoding either succeeds or raises one of the typed errors of
   server/errors.py, which become 4xx. Anything else (KeyError, TypeError, ValueError,
   RecursionError, OverflowError, MemoryError...) would be a 500 with a traceback in the log.
2. Every datatype round-trips: what the server encodes, decoded as a request, is the same array
   (JSON for finite values, since JSON has no NaN; binary bit for bit, NaN payloads included).

The examples marked "found" are what the search found; each failed before its fix.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, TypeVar

import ml_dtypes
import numpy as np
import orjson
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from server.errors import BatchlineError
from server.protocol.binary import split_binary_section, split_body, tensor_from_bytes, tensor_to_bytes
from server.protocol.datatypes import DATATYPES, MAX_DIMS, numpy_dtype
from server.protocol.v2 import decode_request, encode_response, json_tensor
from tests.unit.hypothesis_profile import bounded

T = TypeVar("T")


def typed_errors_only(call: Callable[[], T]) -> T | None:
    """The call's result, or None when it raised a typed (client-facing) error; any other
    exception escapes and fails the property."""
    try:
        return call()
    except BatchlineError as error:
        assert isinstance(error.message, str) and error.message
        return None


# --- strategies ------------------------------------------------------------------------------------

HUGE = [2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, *HUGE, *(-h for h in HUGE)]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
dims = st.one_of(st.integers(0, 3), st.integers(-2, -1), st.sampled_from(HUGE), st.booleans(), st.floats(0, 3))
shapes = st.one_of(
    st.lists(st.integers(0, 3), max_size=4),
    st.lists(dims, max_size=5),
    st.lists(st.sampled_from([0, 1, 2**63 - 1]), min_size=MAX_DIMS - 2, max_size=MAX_DIMS + 40),
    json_values,
)
datatypes = st.one_of(
    st.sampled_from(DATATYPES),
    st.sampled_from(["fp32", "STRING", "FP8", "", "BYTES ", "TYPE_FP32", "object"]),
    json_values,
)
nested_data = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4), max_leaves=16)
binary_sizes = st.one_of(st.integers(-4, 64), st.sampled_from(HUGE), json_values)
PARAMETER_NAMES = ["binary_data_size", "binary_data", "binary_data_output", "shared_memory_region",
                   "classification", "priority", "timeout", "other"]
parameters = st.one_of(
    st.dictionaries(st.sampled_from(PARAMETER_NAMES), json_values, max_size=3),
    st.fixed_dictionaries({}, optional={"binary_data_size": binary_sizes}),
    json_values,
)


@st.composite
def tensors(draw: st.DrawFn) -> Any:
    """An input tensor that is often right and often wrong in one field or several."""
    if draw(st.integers(0, 9)) == 0:
        return draw(json_values)
    fields = {
        "name": st.one_of(st.sampled_from(["x", "y", ""]), json_values),
        "datatype": datatypes,
        "shape": shapes,
        "data": nested_data,
        "parameters": parameters,
    }
    chosen = draw(st.sets(st.sampled_from(sorted(fields)), min_size=3))
    return {key: draw(fields[key]) for key in sorted(chosen)}


@st.composite
def documents(draw: st.DrawFn) -> Any:
    """An infer request document: often well formed, any field possibly odd."""
    if draw(st.integers(0, 9)) == 0:
        return draw(json_values)
    document: dict[str, Any] = {"inputs": draw(st.one_of(st.lists(tensors(), max_size=3), json_values))}
    document |= draw(st.fixed_dictionaries({}, optional={
        "id": st.one_of(st.text(max_size=6), json_values),
        "parameters": parameters,
        "outputs": st.one_of(
            st.lists(st.fixed_dictionaries({"name": st.one_of(st.text(max_size=4), json_values)},
                                           optional={"parameters": parameters}), max_size=3),
            json_values,
        ),
    }))
    return document


def fixed_size(datatype: str) -> bool:
    return datatype != "BYTES"


def finite_arrays(datatype: str, shape: st.SearchStrategy[tuple[int, ...]]) -> st.SearchStrategy[np.ndarray]:
    """Arrays a JSON body can carry exactly (JSON has no NaN or infinity)."""
    if datatype == "BYTES":
        text = st.text(max_size=5).map(str.encode)
        return hnp.arrays(np.object_, shape, elements=text)
    if datatype == "BF16":  # hypothesis knows no bfloat16: every bfloat16 is a float32, rounded
        bound = float(np.float32(1e38))  # past bfloat16's largest finite value, rounding gives infinity
        floats = st.floats(-bound, bound, width=32)
        return hnp.arrays(np.float32, shape, elements=floats).map(lambda a: a.astype(ml_dtypes.bfloat16))
    dtype = numpy_dtype(datatype)
    if dtype.kind == "f":
        return hnp.arrays(dtype, shape, elements=st.floats(allow_nan=False, allow_infinity=False,
                                                           width=dtype.itemsize * 8))
    return hnp.arrays(dtype, shape)


def any_arrays(datatype: str, shape: st.SearchStrategy[tuple[int, ...]]) -> st.SearchStrategy[np.ndarray]:
    """Any array of the datatype: NaN, infinities and arbitrary bit patterns; any bytes."""
    if datatype == "BYTES":
        return hnp.arrays(np.object_, shape, elements=st.binary(max_size=5))
    dtype = numpy_dtype(datatype)
    return shape.flatmap(
        lambda s: st.binary(min_size=math.prod(s) * dtype.itemsize, max_size=math.prod(s) * dtype.itemsize).map(
            lambda raw: np.frombuffer(raw, dtype=np.uint8).view(dtype).reshape(s)
            if dtype.kind != "b" else (np.frombuffer(raw, dtype=np.uint8) % 2).astype(np.bool_).reshape(s)
        )
    )


array_shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3)


def same_array(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape:
        return False
    if a.dtype == np.object_ or b.dtype == np.object_:
        return a.tolist() == b.tolist()
    return a.dtype == b.dtype and a.tobytes() == b.tobytes()


# --- 1. only typed errors escape -------------------------------------------------------------------


# Found: BYTES data nested 1000 deep (orjson reads 1024 levels; the flattening recursed), and a
# shape of thousands of huge dims (its product grew past what int formats in a message).
DEEP_BYTES = b'{"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": ' + b"[" * 1000 + b'"a"' + b"]" * 1000 + b"}]}"
MANY_DIMS = {"name": "x", "datatype": "FP32", "shape": [2**63 - 1] * 5000}


@bounded(150)
@given(body=documents().map(lambda document: json.dumps(document).encode()))
@example(body=DEEP_BYTES)
@example(body=orjson.dumps({"inputs": [{**MANY_DIMS, "data": [1.0]}]}))
def test_decoding_any_json_document_raises_only_typed_errors(body: bytes) -> None:
    decoded = typed_errors_only(lambda: decode_request(body))
    if decoded is not None:
        assert decoded.inputs and all(isinstance(array, np.ndarray) for _, array in decoded.inputs.values())


@bounded(150)
@given(body=st.binary(max_size=64), header_length=st.one_of(st.none(), st.integers(-2, 70), st.sampled_from(HUGE)))
def test_decoding_any_bytes_raises_only_typed_errors(body: bytes, header_length: int | None) -> None:
    typed_errors_only(lambda: decode_request(body, header_length))


@st.composite
def binary_requests(draw: st.DrawFn) -> tuple[bytes, int | None]:
    """A binary-extension body whose tensors, sizes, binary section and header length are each
    exact or a little off."""
    header_inputs = []
    blobs = []
    for index in range(draw(st.integers(1, 3))):
        datatype = draw(st.sampled_from(DATATYPES))
        shape = list(draw(array_shapes))
        array = draw(any_arrays(datatype, st.just(tuple(shape))))
        blob = tensor_to_bytes(array, datatype)
        blob = draw(st.sampled_from([blob, blob[:-1], blob + b"\x00", b"", blob[::-1]]))
        size = draw(st.one_of(st.just(len(blob)), binary_sizes))
        tensor: dict[str, Any] = {"name": f"t{index}", "datatype": datatype,
                                  "shape": draw(st.one_of(st.just(shape), shapes)),
                                  "parameters": {"binary_data_size": size}}
        header_inputs.append(tensor)
        blobs.append(blob)
    header = json.dumps({"inputs": header_inputs}).encode()
    tail = draw(st.sampled_from([b"", b"\x00", b"\xff" * 7]))
    header_length = draw(st.one_of(st.just(len(header)), st.none(), st.integers(-1, len(header) + 8)))
    return header + b"".join(blobs) + tail, header_length


@bounded(100)
@given(request=binary_requests())
def test_decoding_binary_bodies_with_any_sizes_raises_only_typed_errors(request: tuple[bytes, int | None]) -> None:
    body, header_length = request
    typed_errors_only(lambda: decode_request(body, header_length))


@bounded(100)
@given(data=json_values, datatype=datatypes, shape=shapes)
def test_json_tensor_raises_only_typed_errors(data: Any, datatype: Any, shape: Any) -> None:
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)) or len(shape) > MAX_DIMS:
        return  # decode_request checks the shape before; json_tensor trusts it
    typed_errors_only(lambda: json_tensor(data, datatype, shape, "x"))


@bounded(100)
@given(raw=st.binary(max_size=40), datatype=datatypes, shape=shapes)
def test_tensor_from_bytes_raises_only_typed_errors(raw: bytes, datatype: Any, shape: Any) -> None:
    typed_errors_only(lambda: tensor_from_bytes(raw, datatype, shape, "x"))


@bounded(100)
@given(binary=st.binary(max_size=16), sizes=st.lists(binary_sizes, max_size=4),
       header_length=st.one_of(st.integers(-3, 20), json_values))
def test_binary_sections_and_header_lengths_raise_only_typed_errors(
    binary: bytes, sizes: list[Any], header_length: Any
) -> None:
    typed_errors_only(lambda: split_binary_section(binary, [(f"t{i}", s) for i, s in enumerate(sizes)]))
    typed_errors_only(lambda: split_body(binary, header_length))


@bounded(100)
@given(datatype=st.sampled_from(DATATYPES), data=st.data())
def test_encoding_any_array_as_json_raises_only_typed_errors(datatype: str, data: st.DataObject) -> None:
    """NaN and infinity become null, as orjson writes them (JSON has neither); BYTES that are not
    UTF-8 are refused with a typed error that tells the client to ask for binary."""
    array = data.draw(any_arrays(datatype, array_shapes))
    encoded = typed_errors_only(lambda: encode_response("m", 1, None, [("y", datatype, array, False)]))
    if encoded is not None:
        body, header_length = encoded
        assert header_length is None
        assert orjson.loads(body)["outputs"][0]["shape"] == list(array.shape)


def test_explicit_regressions_are_typed() -> None:
    """What the search found, checked directly with their messages."""
    assert decode_request(DEEP_BYTES).inputs["x"][1].tolist() == [b"a"]
    with pytest.raises(BatchlineError, match="5000 dimensions"):
        decode_request(orjson.dumps({"inputs": [{**MANY_DIMS, "data": [1.0]}]}))
    header = orjson.dumps({"inputs": [{**MANY_DIMS, "parameters": {"binary_data_size": 4}}]})
    with pytest.raises(BatchlineError, match="5000 dimensions"):
        decode_request(header + b"\x00" * 4, len(header))
    with pytest.raises(BatchlineError, match="5000 dimensions"):
        tensor_from_bytes(b"\x00" * 4, "FP32", [1] * 5000, "x")


# --- 2. every datatype round-trips ----------------------------------------------------------------


def _as_request(header: dict[str, Any]) -> dict[str, Any]:
    """The response's output tensors sent back as the inputs of a request."""
    return {"inputs": [{k: v for k, v in t.items() if k in ("name", "datatype", "shape", "data", "parameters")}
                       for t in header["outputs"]]}


@pytest.mark.parametrize("datatype", DATATYPES)
@bounded(25)
@given(data=st.data())
def test_json_encoding_round_trips(datatype: str, data: st.DataObject) -> None:
    array = data.draw(finite_arrays(datatype, array_shapes))
    body, header_length = encode_response("m", 1, "id", [("y", datatype, array, False)])
    assert header_length is None
    decoded = decode_request(orjson.dumps(_as_request(orjson.loads(body))))
    sent_datatype, received = decoded.inputs["y"]
    assert sent_datatype == datatype
    assert same_array(received, array), (array, received)


@pytest.mark.parametrize("datatype", DATATYPES)
@bounded(25)
@given(data=st.data())
def test_binary_encoding_round_trips_bit_for_bit(datatype: str, data: st.DataObject) -> None:
    arrays = data.draw(st.lists(any_arrays(datatype, array_shapes), min_size=1, max_size=3))
    outputs = [(f"y{i}", datatype, a, True) for i, a in enumerate(arrays)]
    body, header_length = encode_response("m", 1, None, outputs)
    assert header_length is not None
    header = orjson.dumps(_as_request(orjson.loads(body[:header_length])))
    decoded = decode_request(header + body[header_length:], len(header))
    for name, _, array, _ in outputs:
        assert same_array(decoded.inputs[name][1], array), (array, decoded.inputs[name][1])
