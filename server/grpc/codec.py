"""KServe v2 gRPC messages ↔ numpy arrays: what `ModelInferRequest` declares, its tensors, and
the `ModelInferResponse` of named arrays.

Two ways a client sends a tensor: typed contents (`fp32_contents`, `bytes_contents`, ...) or
`raw_input_contents`, one blob per input in the order of `inputs`, in the layout of Triton's
binary tensors (row-major, little-endian; BYTES as 4-byte little-endian length prefixes).
Raw numbers become arrays without a copy (np.frombuffer). Answers always go back as
`raw_output_contents`, as Triton's do: tritonclient reads them, and encoding them is one copy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from server.errors import InvalidInput, Unsupported
from server.grpc.protos import grpc_service_pb2 as pb
from server.protocol.binary import reshaped, tensor_from_bytes, tensor_to_bytes
from server.protocol.datatypes import BYTES, MAX_DIMS, VALUES_A_CALL, numpy_dtype
from server.protocol.shared_memory import (
    BYTE_SIZE,
    REGION,
    InputReader,
    RegionRef,
    decoding_cost,
    read_all,
    region_ref,
)

Output = tuple[str, str, np.ndarray]  # name, datatype, array

# The typed contents field that carries each datatype (FP16 and BF16 have none: raw only).
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    BYTES: "bytes_contents",
}
_NARROW = {"INT8", "INT16", "UINT8", "UINT16"}  # carried in 32-bit fields: range-checked


@dataclass(slots=True)
class DeclaredRequest:
    """What a request declares, read without touching tensor data: enough for every cheap check."""

    declared: dict[str, tuple[str, list[int]]]  # name -> (datatype, shape)
    parameters: dict[str, Any]
    outputs: list[str] | None  # None: every output
    decode_cost: int  # elements of typed contents, bytes of raw BYTES, a share of bytes copied: what decoding costs
    in_shared_memory: dict[str, RegionRef] = field(default_factory=dict)  # inputs read from shared memory
    to_shared_memory: dict[str, RegionRef] = field(default_factory=dict)  # outputs written there


def _call_names_type() -> Any:
    """A message of ModelInferRequest's first three fields alone (model_name, model_version,
    id): protobuf skips the others whole, so reading it costs next to nothing at any size."""
    file = descriptor_pb2.FileDescriptorProto(name="batchline/call_names.proto", package="batchline",
                                              syntax="proto3")
    names = file.message_type.add(name="CallNames")
    for number, name in ((1, "model_name"), (2, "model_version"), (3, "id")):
        names.field.add(name=name, number=number, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
                        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("batchline.CallNames"))


_CALL_NAMES = _call_names_type()


def call_names(message: bytes) -> Any:
    """An infer message's model_name, model_version and id, read without parsing its tensors:
    what the answer and the access log of a call refused before parsing still name (a stream's
    client matches answers to requests by id). Empty for bytes that are not such a message."""
    try:
        return _CALL_NAMES.FromString(message)
    except DecodeError:
        return _CALL_NAMES()


def held_when_parsed(request: pb.ModelInferRequest, message_bytes: int) -> int:
    """About what a call holds once its message is parsed: the message as received (grpc keeps
    it for the call), the parsed copy of about its size, and 8 bytes an element of typed numbers,
    which protobuf widens from the wire's varints (1 byte for a small integer). Counted from the
    fields' lengths, never from the shapes they declare."""
    widened = 0
    for tensor in request.inputs:
        contents = CONTENTS_FIELD.get(tensor.datatype)
        if contents and tensor.datatype != BYTES and tensor.HasField("contents"):
            widened += 8 * len(getattr(tensor.contents, contents))
    return 2 * message_bytes + widened


def parse_request(message: bytes) -> pb.ModelInferRequest:
    """An infer call's message as the client sent it, parsed; InvalidInput (INVALID_ARGUMENT)
    when it is not a ModelInferRequest, where grpc's own parsing answers INTERNAL."""
    try:
        return pb.ModelInferRequest.FromString(message)
    except DecodeError as exc:
        raise InvalidInput(f"the message is not a ModelInferRequest: {exc}") from exc


def declare(request: pb.ModelInferRequest) -> DeclaredRequest:
    """Names, datatypes and shapes of the inputs, the parameters and the outputs asked for;
    InvalidInput for a request whose parts do not fit together."""
    if not request.inputs:
        raise InvalidInput("'inputs' must hold at least one tensor")
    regions = {tensor.name: ref for tensor in request.inputs if tensor.parameters
               and (ref := region_ref(plain_parameters(tensor.parameters), f"input '{tensor.name}'")) is not None}
    raw = request.raw_input_contents
    carried = len(request.inputs) - len(regions)  # the inputs whose values travel in the request
    if raw and len(raw) != carried:
        raise InvalidInput(f"the request has {carried} inputs outside shared memory but {len(raw)} "
                           "raw_input_contents; give one per such input, in the order of the inputs")
    declared: dict[str, tuple[str, list[int]]] = {}
    cost = 0
    raw_index = 0
    for tensor in request.inputs:
        name = tensor.name
        if not name:
            raise InvalidInput("an input has no name")
        if name in declared:
            raise InvalidInput(f"input '{name}' is given more than once")
        if len(tensor.shape) > MAX_DIMS:
            raise InvalidInput(f"input '{name}': shape has {len(tensor.shape)} dimensions; at most {MAX_DIMS} are allowed")
        shape = list(tensor.shape)
        if any(d < 0 for d in shape):
            raise InvalidInput(f"input '{name}': shape must hold non-negative integers, got {shape}")
        has_contents = tensor.HasField("contents")
        if name in regions:
            if has_contents:
                raise InvalidInput(f"input '{name}' is in shared memory: give it no contents")
            cost += decoding_cost(regions[name], tensor.datatype)
        elif raw and has_contents:
            raise InvalidInput(f"input '{name}' has both contents and raw_input_contents")
        elif raw:
            cost += len(raw[raw_index]) if tensor.datatype == BYTES else 0
            raw_index += 1
        else:
            cost += math.prod(shape) if has_contents else 0
        declared[name] = (tensor.datatype, shape)
    outputs = None
    targets: dict[str, RegionRef] = {}
    if request.outputs:
        outputs = []
        names: set[str] = set()  # a set: a list's check is quadratic, and a client may ask for 100,000
        for output in request.outputs:
            if "classification" in output.parameters:
                raise Unsupported("the classification extension is not supported by this server")
            if output.name in names:
                raise InvalidInput(f"output '{output.name}' is asked for more than once")
            names.add(output.name)
            ref = region_ref(plain_parameters(output.parameters), f"output '{output.name}'") if output.parameters else None
            if ref is not None:
                targets[output.name] = ref
            outputs.append(output.name)
    return DeclaredRequest(declared, plain_parameters(request.parameters), outputs, cost, regions, targets)


def decode_inputs(
    request: pb.ModelInferRequest, in_shared_memory: Mapping[str, RegionRef] | None = None,
    read_inputs: InputReader | None = None,
) -> dict[str, tuple[str, np.ndarray]]:
    """The input arrays, shaped as declared (call `declare` first: it checked how the parts fit);
    those `in_shared_memory` copied by `read_inputs`."""
    raw = request.raw_input_contents
    raw_index = 0
    inputs: dict[str, tuple[str, np.ndarray]] = {}
    shared = in_shared_memory or {}
    copies = read_all([(ref, f"input '{name}'") for name, ref in shared.items()], read_inputs) if shared else iter(())
    for tensor in request.inputs:
        shape = list(tensor.shape)
        if tensor.name in shared:
            array = tensor_from_bytes(next(copies), tensor.datatype, shape, tensor.name)
        elif raw:
            array = tensor_from_bytes(raw[raw_index], tensor.datatype, shape, tensor.name)
            raw_index += 1
        else:
            array = _from_contents(tensor, shape)
        inputs[tensor.name] = (tensor.datatype, array)
    return inputs


def _from_contents(tensor: pb.ModelInferRequest.InferInputTensor, shape: list[int]) -> np.ndarray:
    name, datatype = tensor.name, tensor.datatype
    field = CONTENTS_FIELD.get(datatype)
    if field is None:
        numpy_dtype(datatype)  # an unknown datatype says so
        raise InvalidInput(f"input '{name}' ({datatype}) has no typed contents field; send it in raw_input_contents")
    values = getattr(tensor.contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise InvalidInput(f"input '{name}' has shape {shape} ({count} elements) but {len(values)} values "
                           f"in {field}")
    for other in CONTENTS_FIELD.values():
        if other != field and len(getattr(tensor.contents, other)):
            raise InvalidInput(f"input '{name}' ({datatype}) has values in {other}; its values go in {field}")
    dtype = numpy_dtype(datatype)
    if datatype == BYTES:
        return reshaped(_read(values, np.dtype(np.object_), count), shape, name)
    if datatype in _NARROW:
        wide = _read(values, np.dtype(np.int64), count)
        info = np.iinfo(dtype)
        if count and (wide.min() < info.min or wide.max() > info.max):
            raise InvalidInput(f"input '{name}': a value is out of range for {datatype}")
        return reshaped(wide.astype(dtype), shape, name)
    return reshaped(_read(values, dtype, count), shape, name)


def _read(values: Any, dtype: np.dtype, count: int) -> np.ndarray:
    """Typed contents as an array, VALUES_A_CALL at a time (2 million FP32 values: 48 ms in one
    call), through one iterator: at no cost in all."""
    if count <= VALUES_A_CALL:
        return np.fromiter(values, dtype=dtype, count=count)
    array = np.empty(count, dtype=dtype)
    remaining = iter(values)
    for start in range(0, count, VALUES_A_CALL):
        stop = min(start + VALUES_A_CALL, count)
        array[start:stop] = np.fromiter(remaining, dtype=dtype, count=stop - start)
    return array


def plain_parameters(parameters: Any) -> dict[str, Any]:
    """A map of InferParameter or ModelRepositoryParameter as plain values (priority and
    timeout arrive as int64_param, a load's config as string_param)."""
    plain: dict[str, Any] = {}
    for key, parameter in parameters.items():
        choice = parameter.WhichOneof("parameter_choice")
        if choice is not None:
            plain[key] = getattr(parameter, choice)
    return plain


def encode_response(
    model_name: str, model_version: int, request_id: str, outputs: list[Output],
    in_shared_memory: Mapping[str, tuple[str, int]] | None = None,
) -> pb.ModelInferResponse:
    """The answer, every tensor in raw_output_contents (BYTES length-prefixed) but those named in
    `in_shared_memory` (name -> region, bytes written): written there already, they carry their
    region and size, and an empty entry in raw_output_contents, so that clients, which find an
    output's contents at its own index, read every other output where it is."""
    response = pb.ModelInferResponse(model_name=model_name, model_version=str(model_version), id=request_id)
    for name, datatype, array in outputs:
        tensor = response.outputs.add(name=name, datatype=datatype, shape=array.shape)
        placed = in_shared_memory.get(name) if in_shared_memory else None
        if placed is None:
            response.raw_output_contents.append(tensor_to_bytes(array, datatype))
        else:
            tensor.parameters[REGION].string_param = placed[0]
            tensor.parameters[BYTE_SIZE].int64_param = placed[1]
            response.raw_output_contents.append(b"")
    return response

