"""ModelInferRequest ↔ numpy: typed contents and raw contents give the same arrays, what a
request declares is read without its data, and a malformed request is InvalidInput."""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.grpc import service_pb2

from server.errors import InvalidInput, Unsupported
from server.grpc import codec
from server.grpc.protos import grpc_service_pb2 as pb
from server.protocol.shared_memory import COPIED_PER_WALKED, RegionRef


def _request(*inputs: triton.InferInput, raw: bool, outputs: list[str] | None = None, **parameters: object) -> pb.ModelInferRequest:
    """The request tritonclient sends (raw: its set_data_from_numpy; typed: the contents fields)."""
    request = service_pb2.ModelInferRequest(model_name="m", id="r1")
    for tensor in inputs:
        request.inputs.extend([tensor._get_tensor()])
        if raw:
            request.raw_input_contents.append(tensor._get_content())
    for name in outputs or []:
        request.outputs.add(name=name)
    for key, value in parameters.items():
        if isinstance(value, bool):
            request.parameters[key].bool_param = value
        elif isinstance(value, int):
            request.parameters[key].int64_param = value
        else:
            request.parameters[key].string_param = str(value)
    return request


def _typed(name: str, array: np.ndarray, datatype: str) -> triton.InferInput:
    tensor = triton.InferInput(name, list(array.shape), datatype)
    field = codec.CONTENTS_FIELD[datatype]
    getattr(tensor._get_tensor().contents, field).extend(array.reshape(-1).tolist())
    return tensor


def _raw(name: str, array: np.ndarray, datatype: str) -> triton.InferInput:
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


ARRAYS = {
    "FP32": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
    "FP64": np.arange(6, dtype=np.float64).reshape(3, 2) / 3,
    "INT8": np.array([[-128, 0, 127]], dtype=np.int8),
    "INT32": np.array([[-5, 2**31 - 1]], dtype=np.int32),
    "INT64": np.array([2**40, -1], dtype=np.int64),
    "UINT8": np.array([0, 255], dtype=np.uint8),
    "UINT64": np.array([2**63], dtype=np.uint64),
    "BOOL": np.array([[True, False]]),
    "BYTES": np.array([[b"hello"], [b""], ["naïve".encode()]], dtype=np.object_),
}


@pytest.mark.parametrize("datatype", list(ARRAYS))
def test_typed_and_raw_contents_give_the_same_array(datatype: str) -> None:
    array = ARRAYS[datatype]
    for request in (_request(_typed("x", array, datatype), raw=False), _request(_raw("x", array, datatype), raw=True)):
        declared = codec.declare(request)
        assert declared.declared == {"x": (datatype, list(array.shape))}
        decoded_type, decoded = codec.decode_inputs(request)["x"]
        assert decoded_type == datatype and decoded.shape == array.shape
        assert decoded.tolist() == array.tolist()


@pytest.mark.parametrize("datatype", list(ARRAYS))
def test_big_typed_contents_are_read_a_piece_at_a_time_with_the_same_result(
    monkeypatch: pytest.MonkeyPatch, datatype: str,
) -> None:
    """Each read of typed contents holds the GIL: off the event loop, big contents are read in
    pieces, between which the loop runs."""
    array = np.resize(ARRAYS[datatype], (5, 3))
    request = _request(_typed("x", array, datatype), raw=False)
    whole = codec.decode_inputs(request)["x"][1]
    reads: list[int] = []
    fromiter = np.fromiter

    def counted(values: object, dtype: object, count: int) -> np.ndarray:
        reads.append(count)
        return fromiter(values, dtype=dtype, count=count)  # type: ignore[call-overload]

    monkeypatch.setattr(codec, "VALUES_A_CALL", 4)
    monkeypatch.setattr(codec.np, "fromiter", counted)
    decoded = codec.decode_inputs(request)["x"][1]
    assert decoded.dtype == whole.dtype and decoded.shape == whole.shape == (5, 3)
    assert decoded.tolist() == whole.tolist() == array.tolist()
    assert reads == [4, 4, 4, 3]


def test_raw_numbers_are_not_copied() -> None:
    request = _request(_raw("x", ARRAYS["FP32"], "FP32"), raw=True)
    _, decoded = codec.decode_inputs(request)["x"]
    assert not decoded.flags.owndata, "a view of the message's bytes"


def test_fp16_travels_raw_only() -> None:
    half = np.array([1.5, -2.0], dtype=np.float16)
    _, decoded = codec.decode_inputs(_request(_raw("x", half, "FP16"), raw=True))["x"]
    assert decoded.tolist() == [1.5, -2.0]
    typed = _request(triton.InferInput("x", [2], "FP16"), raw=False)
    typed.inputs[0].contents.fp32_contents.extend([1.5, -2.0])
    with pytest.raises(InvalidInput, match="raw_input_contents"):
        codec.decode_inputs(typed)


def test_parameters_and_requested_outputs() -> None:
    request = _request(_raw("x", ARRAYS["FP32"], "FP32"), raw=True, outputs=["y"], priority=2, timeout=500,
                       tag="a", flag=True)
    declared = codec.declare(request)
    assert declared.parameters == {"priority": 2, "timeout": 500, "tag": "a", "flag": True}
    assert declared.outputs == ["y"]
    assert codec.declare(_request(_raw("x", ARRAYS["FP32"], "FP32"), raw=True)).outputs is None


def _broken(change: str) -> pb.ModelInferRequest:
    request = _request(_raw("x", ARRAYS["FP32"], "FP32"), raw=True)
    if change == "no inputs":
        del request.inputs[:]
        del request.raw_input_contents[:]
    elif change == "raw count":
        request.raw_input_contents.append(b"")
    elif change == "twice":
        request.inputs.add(name="x", datatype="FP32", shape=[1])
        request.raw_input_contents.append(b"\0\0\0\0")
    elif change == "negative dim":
        request.inputs[0].shape[0] = -2
    elif change == "both":
        request.inputs[0].contents.fp32_contents.append(1.0)
    elif change == "no name":
        request.inputs[0].name = ""
    return request


@pytest.mark.parametrize("change", ["no inputs", "raw count", "twice", "negative dim", "both", "no name"])
def test_a_request_whose_parts_do_not_fit_is_invalid_before_any_data_is_read(change: str) -> None:
    with pytest.raises(InvalidInput):
        codec.declare(_broken(change))


@pytest.mark.parametrize(("datatype", "values", "shape", "reason"), [
    ("FP32", [1.0, 2.0], [3], "3 elements"),
    ("INT8", [300], [1], "out of range"),
    ("UINT16", [70000], [1], "out of range"),
    ("NOPE", [1], [1], "datatype"),
    ("FP32", [], [0, 2**62], "too large"),  # zero elements, but no such array
    ("BYTES", [], [0, 2**62], "too large"),
])
def test_typed_contents_that_do_not_match_are_invalid(datatype: str, values: list, shape: list[int], reason: str) -> None:
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="x", datatype=datatype, shape=shape)
    field = codec.CONTENTS_FIELD.get(datatype, "int_contents")
    getattr(tensor.contents, field).extend(values)
    codec.declare(request)
    with pytest.raises(InvalidInput, match=reason):
        codec.decode_inputs(request)


def test_values_in_the_wrong_contents_field_are_invalid() -> None:
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1])
    tensor.contents.fp32_contents.append(1.0)
    tensor.contents.int_contents.append(1)
    with pytest.raises(InvalidInput, match="int_contents"):
        codec.decode_inputs(request)


def test_raw_bytes_tensors_need_their_length_prefixes() -> None:
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="BYTES", shape=[2])
    request.raw_input_contents.append(struct.pack("<I", 3) + b"abc" + struct.pack("<I", 9) + b"short")
    with pytest.raises(InvalidInput, match="element 1"):
        codec.decode_inputs(request)


def test_classification_is_refused_as_unsupported() -> None:
    request = _request(_raw("x", ARRAYS["FP32"], "FP32"), raw=True)
    request.outputs.add(name="y").parameters["classification"].int64_param = 3
    with pytest.raises(Unsupported):
        codec.declare(request)


def test_shared_memory_inputs_take_no_raw_contents_and_outputs_keep_their_index() -> None:
    """tritonclient sends raw contents only for the inputs outside shared memory, and reads an
    output's contents at the output's own index."""
    region = bytearray(32)
    region[8:24] = ARRAYS["FP32"].tobytes()
    in_shm = triton.InferInput("x", list(ARRAYS["FP32"].shape), "FP32")
    in_shm.set_shared_memory("r0", ARRAYS["FP32"].nbytes, offset=8)
    raw = triton.InferInput("n", [2], "INT32")
    raw.set_data_from_numpy(np.array([3, 4], np.int32))
    wanted = triton.InferRequestedOutput("y")
    wanted.set_shared_memory("r1", 64)
    request = service_pb2.ModelInferRequest()
    request.model_name = "m"
    for tensor in (in_shm, raw):
        request.inputs.extend([tensor._get_tensor()])
        if tensor._get_content() is not None:
            request.raw_input_contents.append(tensor._get_content())
    request.outputs.extend([wanted._get_tensor()])
    ours = pb.ModelInferRequest.FromString(request.SerializeToString())
    declared = codec.declare(ours)
    assert declared.in_shared_memory == {"x": RegionRef("r0", ARRAYS["FP32"].nbytes, 8)}
    assert declared.to_shared_memory == {"y": RegionRef("r1", 64)}
    inputs = codec.decode_inputs(ours, declared.in_shared_memory,
                                 lambda refs: [memoryview(region)[r.offset:r.offset + r.byte_size] for r, _ in refs])
    assert inputs["x"][1].tolist() == ARRAYS["FP32"].tolist() and inputs["n"][1].tolist() == [3, 4]
    with pytest.raises(Unsupported):
        codec.decode_inputs(ours, declared.in_shared_memory)  # no reader: the server takes none

    outputs = [("y", "FP32", np.ones(2, np.float32)), ("z", "INT32", np.array([7], np.int32))]
    response = codec.encode_response("m", 1, "", outputs, {"y": ("r1", 8)})
    result = triton.InferResult(service_pb2.ModelInferResponse.FromString(response.SerializeToString()))
    assert result.as_numpy("z").tolist() == [7]  # found at its own index past the output in shared memory
    shared = result.get_output("y").parameters
    assert (shared["shared_memory_region"].string_param, shared["shared_memory_byte_size"].int64_param) == ("r1", 8)


def test_shared_memory_inputs_cost_their_decoding_a_share_of_their_bytes_or_all_of_them_as_text() -> None:
    """Numbers are copied out of a region (cheap a byte), text is walked: what decides whether
    a request is decoded on the event loop or on a thread."""
    request = pb.ModelInferRequest(model_name="m")
    for name, datatype, size in (("x", "FP32", 1 << 20), ("t", "BYTES", 1000)):
        tensor = request.inputs.add(name=name, datatype=datatype, shape=[size // 4])
        tensor.parameters["shared_memory_region"].string_param = "r"
        tensor.parameters["shared_memory_byte_size"].int64_param = size
    assert codec.declare(request).decode_cost == (1 << 20) // COPIED_PER_WALKED + 1000


def test_the_response_is_what_tritonclient_reads() -> None:
    outputs = [("y", "FP32", ARRAYS["FP32"]), ("t", "BYTES", ARRAYS["BYTES"]), ("h", "FP16", np.ones(2, np.float16))]
    response = codec.encode_response("m", 3, "r1", outputs)
    result = triton.InferResult(service_pb2.ModelInferResponse.FromString(response.SerializeToString()))
    assert (response.model_name, response.model_version, response.id) == ("m", "3", "r1")
    for name, _, array in outputs:
        assert result.as_numpy(name).tolist() == array.tolist()
        assert result.as_numpy(name).shape == array.shape


def test_a_message_is_parsed_or_refused_as_invalid_input() -> None:
    """The servicer parses infer messages itself: one that is not a ModelInferRequest is a
    clear INVALID_ARGUMENT, not grpc's INTERNAL for a deserializer that failed."""
    request = pb.ModelInferRequest(model_name="m", id="r1")
    request.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"hi")
    parsed = codec.parse_request(request.SerializeToString())
    assert (parsed.model_name, parsed.id, parsed.inputs[0].contents.bytes_contents[0]) == ("m", "r1", b"hi")
    with pytest.raises(InvalidInput, match="not a ModelInferRequest"):
        codec.parse_request(b"\xff\xff\xff")


def test_a_messages_names_are_read_without_its_tensors() -> None:
    """What a call refused before parsing still names (its answer, its access log line)."""
    request = pb.ModelInferRequest(model_name="m", model_version="2", id="r1")
    request.inputs.add(name="text", datatype="BYTES", shape=[100_000, 1]).contents.bytes_contents.extend(
        [b"ab"] * 100_000)
    names = codec.call_names(request.SerializeToString())
    assert (names.model_name, names.model_version, names.id) == ("m", "2", "r1")
    assert codec.call_names(b"\xff\xff\xff").model_name == ""


def test_a_parsed_message_holds_its_size_twice_and_typed_numbers_widened() -> None:
    """grpc keeps the message as received, the parse copies it, and small integers of one wire
    byte become 8; a datatype with no typed field carries nothing there, whatever its shape
    declares (a product of 80,000 dims of 2**62 took the event loop for 18 s)."""
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="n", datatype="INT64", shape=[1000]).contents.int64_contents.extend([1] * 1000)
    request.inputs.add(name="t", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"x" * 5000)
    request.inputs.add(name="h", datatype="FP16", shape=[2**62] * 1000).contents.SetInParent()
    assert codec.held_when_parsed(request, 7000) == 2 * 7000 + 8 * 1000


def test_an_output_asked_for_twice_is_refused() -> None:
    request = _request(_raw("x", ARRAYS["FP32"], "FP32"), raw=True)
    request.outputs.add(name="y")
    request.outputs.add(name="y")
    with pytest.raises(InvalidInput, match="output 'y' is asked for more than once"):
        codec.declare(request)


def test_many_requested_outputs_are_checked_in_one_pass() -> None:
    """As a list's, the duplicate check took 10 s for 40,000 names here, on the event loop."""
    request = _request(_raw("x", ARRAYS["FP32"], "FP32"), raw=True)
    for i in range(100_000):
        request.outputs.add(name=f"o{i}")
    request.outputs.add(name="o99999")
    started = time.monotonic()
    with pytest.raises(InvalidInput, match="output 'o99999' is asked for more than once"):
        codec.declare(request)
    assert time.monotonic() - started < 30, "a check over 100,000 names held the loop (a fraction of a second in one pass)"
