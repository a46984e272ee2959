"""KServe v2 (Open Inference Protocol) inference bodies: decode requests, encode responses.

Pure functions over bytes and numpy arrays, shared by every front end. JSON tensors may be
flat or nested; Triton's binary tensor extension is read and written here too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import orjson

from server.errors import InvalidInput, Unsupported
from server.protocol.binary import BinaryCursor, split_body, tensor_from_bytes, tensor_to_bytes
from server.protocol.datatypes import numpy_dtype


@dataclass
class RequestedOutput:
    name: str
    binary: bool | None  # None: follow the request's binary_data_output


@dataclass
class DecodedRequest:
    id: str | None
    parameters: dict[str, Any]
    inputs: dict[str, tuple[str, np.ndarray]]  # name -> (datatype, array shaped as sent)
    outputs: list[RequestedOutput] | None  # None: every output
    binary_output: bool = False


def decode_request(body: bytes, header_length: int | None = None) -> DecodedRequest:
    """Parse an infer request body; `header_length` is Inference-Header-Content-Length."""
    if header_length is None:
        header, binary = body, memoryview(b"")
    else:
        header, binary = split_body(body, header_length)
    document = json_object(header)
    request_id = document.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidInput("'id' must be a string")
    parameters = _parameters(document.get("parameters"), "request")
    raw_inputs = document.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidInput("'inputs' must be a non-empty list of tensors")
    cursor = BinaryCursor(binary)
    inputs: dict[str, tuple[str, np.ndarray]] = {}
    for raw in raw_inputs:
        name, datatype, array = _decode_input(raw, cursor)
        if name in inputs:
            raise InvalidInput(f"input '{name}' is given more than once")
        inputs[name] = (datatype, array)
    cursor.finish()
    return DecodedRequest(
        id=request_id,
        parameters=parameters,
        inputs=inputs,
        outputs=_requested_outputs(document.get("outputs")),
        binary_output=bool(parameters.get("binary_data_output", False)),
    )


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be one JSON object."""
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise InvalidInput("the request body must be a JSON object")
    return document


def _parameters(value: object, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f"'parameters' of the {where} must be an object")
    if "shared_memory_region" in value:
        raise Unsupported("shared-memory tensors are not supported by this server")
    return value


def _decode_input(raw: object, cursor: BinaryCursor) -> tuple[str, str, np.ndarray]:
    if not isinstance(raw, dict):
        raise InvalidInput("each input must be an object with name, datatype, shape and data")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidInput("an input has no 'name'")
    datatype = raw.get("datatype")
    if not isinstance(datatype, str):
        raise InvalidInput(f"input '{name}' has no 'datatype'")
    shape = raw.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise InvalidInput(f"input '{name}': 'shape' must be a list of non-negative integers")
    parameters = _parameters(raw.get("parameters"), f"input '{name}'")
    size = parameters.get("binary_data_size")
    if size is not None:
        if "data" in raw:
            raise InvalidInput(f"input '{name}' has both 'data' and 'binary_data_size'")
        return name, datatype, tensor_from_bytes(cursor.take(size, name), datatype, shape, name)
    if "data" not in raw:
        raise InvalidInput(f"input '{name}' has neither 'data' nor 'binary_data_size'")
    return name, datatype, json_tensor(raw["data"], datatype, shape, name)


def json_tensor(data: object, datatype: str, shape: list[int], name: str) -> np.ndarray:
    """A numpy array from JSON `data` (flat or nested), checked against datatype and shape."""
    dtype = numpy_dtype(datatype)
    expected = math.prod(shape)
    if not isinstance(data, list):
        data = [data]
    if datatype == "BYTES":
        flat = _flatten(data)
        if not all(isinstance(x, str) for x in flat):
            raise InvalidInput(f"input '{name}': BYTES data must be strings")
        array = np.empty(len(flat), dtype=object)
        array[:] = [x.encode() for x in flat]
    else:
        try:
            array = np.asarray(data)
        except ValueError as exc:  # ragged nesting
            raise InvalidInput(f"input '{name}': data is not a regular array: {exc}") from exc
        array = _cast(array.reshape(-1), dtype, datatype, name, data)
    if array.size != expected:
        raise InvalidInput(
            f"input '{name}': shape {shape} needs {expected} elements, data has {array.size}"
        )
    try:
        return array.reshape(shape)
    except ValueError as exc:  # e.g. [0, 2**63]: zero elements, but no such array
        raise InvalidInput(f"input '{name}': shape {shape} is not a valid array shape") from exc


def _flatten(data: list[Any]) -> list[Any]:
    if not any(isinstance(x, list) for x in data):
        return data
    flat: list[Any] = []
    for x in data:
        flat.extend(_flatten(x) if isinstance(x, list) else [x])
    return flat


def _cast(array: np.ndarray, dtype: np.dtype, datatype: str, name: str, data: list[Any]) -> np.ndarray:
    kind = array.dtype.kind
    if array.size == 0:
        return array.astype(dtype)
    if datatype == "BOOL":
        if kind != "b":
            raise InvalidInput(f"input '{name}': BOOL data must be true or false")
        return array
    if dtype.kind in "iu":
        if kind not in "iu":  # floats, or ints past int64 that numpy widened to float/object
            return _exact_integers(_flatten(data), dtype, datatype, name)
        info = np.iinfo(dtype)
        if array.min() < info.min or array.max() > info.max:
            raise InvalidInput(f"input '{name}': a value is out of range for {datatype}")
    elif kind not in "iuf":
        raise InvalidInput(f"input '{name}': {datatype} data must be numbers")
    return array.astype(dtype)


def _exact_integers(flat: list[Any], dtype: np.dtype, datatype: str, name: str) -> np.ndarray:
    """The slow, exact path: every value a Python int within the type's range."""
    if not all(type(x) is int for x in flat):
        raise InvalidInput(f"input '{name}': {datatype} data must be integers")
    info = np.iinfo(dtype)
    if min(flat) < info.min or max(flat) > info.max:
        raise InvalidInput(f"input '{name}': a value is out of range for {datatype}")
    return np.array(flat, dtype=dtype)


def _requested_outputs(value: object) -> list[RequestedOutput] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidInput("'outputs' must be a list")
    requested = []
    for raw in value:
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise InvalidInput("each requested output must be an object with a 'name'")
        parameters = _parameters(raw.get("parameters"), f"output '{raw['name']}'")
        if parameters.get("classification"):
            raise Unsupported("the classification extension is not supported by this server")
        binary = parameters.get("binary_data")
        requested.append(RequestedOutput(raw["name"], None if binary is None else bool(binary)))
    return requested


def encode_response(
    model_name: str,
    model_version: int,
    request_id: str | None,
    outputs: list[tuple[str, str, np.ndarray, bool]],
) -> tuple[bytes, int | None]:
    """The response body and, when any output is binary, the JSON header's length.

    `outputs` holds (name, datatype, array, as_binary) in response order.
    """
    tensors: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, datatype, array, as_binary in outputs:
        tensor: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if as_binary:
            blob = tensor_to_bytes(array, datatype)
            tensor["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            tensor["data"] = _json_data(array, datatype, name)
        tensors.append(tensor)
    document: dict[str, Any] = {"model_name": model_name, "model_version": str(model_version)}
    if request_id is not None:
        document["id"] = request_id
    document["outputs"] = tensors
    header = orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)


def _json_data(array: np.ndarray, datatype: str, name: str) -> object:
    flat = array.reshape(-1)
    if datatype == "BYTES":
        try:
            return [x.decode() if isinstance(x, bytes) else str(x) for x in flat]
        except UnicodeDecodeError as exc:
            raise InvalidInput(
                f"output '{name}' holds bytes that are not UTF-8; ask for it with binary_data"
            ) from exc
    if flat.dtype == ml_dtypes.bfloat16 or flat.dtype == np.float16:
        flat = flat.astype(np.float32)
    return np.ascontiguousarray(flat)


def encode_error(message: str) -> bytes:
    return orjson.dumps({"error": message})
