"""KServe v2 (Open Inference Protocol) inference bodies: decode requests, encode responses.

Pure functions over bytes and numpy arrays, shared by every front end. JSON tensors may be
flat or nested; Triton's binary tensor extension is read and written here too.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import orjson

from server.errors import InvalidInput, Unsupported
from server.protocol.binary import BinaryCursor, reshaped, split_body, tensor_from_bytes, tensor_to_bytes
from server.protocol.datatypes import MAX_DIMS, VALUES_A_CALL, numpy_dtype
from server.protocol.shared_memory import (
    BYTE_SIZE,
    REGION,
    InputReader,
    RegionRef,
    decoding_cost,
    read_all,
    region_ref,
)


@dataclass
class RequestedOutput:
    name: str
    binary: bool | None  # None: follow the request's binary_data_output
    region: RegionRef | None = None  # written into the client's shared memory, not the answer


@dataclass
class DecodedRequest:
    id: str | None
    parameters: dict[str, Any]
    inputs: dict[str, tuple[str, np.ndarray]]  # name -> (datatype, array shaped as sent)
    outputs: list[RequestedOutput] | None  # None: every output
    binary_output: bool = False


@dataclass(slots=True)
class DeclaredInput:
    """One input as the header declares it, before any per-element work: `data` is the JSON
    data as parsed, or None when the tensor's bytes are `binary` (a view of the body) or lie in
    the client's shared memory (`region`)."""

    name: str
    datatype: str
    shape: list[int]
    data: object
    binary: memoryview | None
    region: RegionRef | None = None


@dataclass(slots=True)
class ParsedRequest:
    """A request whose header is read and whose tensors are not yet built: what a server can
    check against the model's config (names, datatypes, shapes, batch size) at no per-element cost."""

    id: str | None
    parameters: dict[str, Any]
    inputs: list[DeclaredInput]
    outputs: list[RequestedOutput] | None
    binary_output: bool
    decode_bytes: int  # what building the tensors walks (the JSON header, any BYTES data) and a share of what it copies


def decode_request(body: bytes, header_length: int | None = None) -> DecodedRequest:
    """Parse an infer request body; `header_length` is Inference-Header-Content-Length."""
    return build_tensors(parse_request(body, header_length))


_NO_BINARY = BinaryCursor(b"")  # stateless while it holds nothing: take(0) moves it by nothing, any more raises


def parse_request(body: bytes | bytearray, header_length: int | None = None) -> ParsedRequest:
    """Read the JSON header and cut the binary section; no tensor is built yet. Its cost grows
    with the header's size only (orjson's parse)."""
    header: bytes | bytearray
    binary: bytes | memoryview
    if header_length is None:
        header, binary = body, b""
    else:
        header, binary = split_body(body, header_length)
    document = json_object(header)
    request_id = document.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidInput("'id' must be a string")
    parameters = document.get("parameters")
    parameters = {} if parameters is None else _parameters(parameters, "request")
    raw_inputs = document.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidInput("'inputs' must be a non-empty list of tensors")
    cursor = BinaryCursor(binary) if len(binary) else _NO_BINARY
    inputs: list[DeclaredInput] = []
    names: set[str] = set()
    decode_bytes = len(header)
    for raw in raw_inputs:
        declared = _declared_input(raw, cursor)
        if declared.name in names:
            raise InvalidInput(f"input '{declared.name}' is given more than once")
        names.add(declared.name)
        if declared.region is not None:
            decode_bytes += decoding_cost(declared.region, declared.datatype)
        elif declared.datatype == "BYTES" and declared.binary is not None:  # read element by element;
            decode_bytes += len(declared.binary)  # numbers in the body are zero-copy
        inputs.append(declared)
    if cursor is not _NO_BINARY:
        cursor.finish()
    outputs = document.get("outputs")
    return ParsedRequest(
        id=request_id,
        parameters=parameters,
        inputs=inputs,
        outputs=None if outputs is None else _requested_outputs(outputs),
        binary_output=bool(parameters) and (_flag(parameters, "binary_data_output", "the request") or False),
        decode_bytes=decode_bytes,
    )


def build_tensors(parsed: ParsedRequest, read_inputs: InputReader | None = None) -> DecodedRequest:
    """The numpy arrays of a parsed request: the per-element work, proportional to its data.
    `read_inputs` copies the bytes of inputs in shared memory (None: the server takes none)."""
    inputs: dict[str, tuple[str, np.ndarray]] = {}
    copies: Iterator[memoryview] | None = None  # read at the first input in shared memory, all at once
    for declared in parsed.inputs:
        if declared.region is not None:
            if copies is None:
                copies = read_all([(d.region, f"input '{d.name}'") for d in parsed.inputs if d.region is not None],
                                  read_inputs)
            array = tensor_from_bytes(next(copies), declared.datatype, declared.shape, declared.name)
        elif declared.binary is not None:
            array = tensor_from_bytes(declared.binary, declared.datatype, declared.shape, declared.name)
        else:
            array = json_tensor(declared.data, declared.datatype, declared.shape, declared.name)
        inputs[declared.name] = (declared.datatype, array)
    return DecodedRequest(
        id=parsed.id,
        parameters=parsed.parameters,
        inputs=inputs,
        outputs=parsed.outputs,
        binary_output=parsed.binary_output,
    )


def json_object(raw: bytes | bytearray) -> dict[str, Any]:
    """A request body that must be one JSON object."""
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if b"NaN" not in raw and b"Infinity" not in raw:
            raise InvalidInput(f"the request body is not valid JSON: {exc}") from exc
        document = _with_non_finite_numbers(raw)
    if not isinstance(document, dict):
        raise InvalidInput("the request body must be a JSON object")
    return document


# A JSON escape of a lone UTF-16 surrogate (a high one not followed by a low one, or a low one
# not after a high one): Python's json reads it into a string that no UTF-8 encoder takes (a
# 500 later); orjson refuses it, and so does the path that reads what orjson cannot.
# An escape is a backslash after an even number of them (JSON's `\\ud800` is a backslash and "ud800").
_LONE_SURROGATE = re.compile(
    rb"(?<!\\)(?:\\\\)*(?:\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F])")


def _with_non_finite_numbers(raw: bytes | bytearray) -> Any:
    """A body with NaN, Infinity or -Infinity among its numbers, as Triton reads it (its parser
    takes them, and tritonclient's JSON tensors write them, as Python's json does); orjson
    refuses them, so such a body, and only one orjson refused, is read by Python's json,
    which took 0.9-2.3 times orjson's time on 8 MB bodies (docs/benchmarks.md). Whatever
    else orjson refuses stays refused: text that is not UTF-8, lone surrogate escapes,
    nesting past the interpreter's depth, integers past its 4,300 digits."""
    try:
        text = raw.decode()  # strict: Python's json would pass encoded surrogates through
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"the request body is not valid JSON: it is not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    if _LONE_SURROGATE.search(raw):
        raise InvalidInput("the request body is not valid JSON: a \\u escape of a UTF-16 surrogate lacks its pair")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"the request body is not valid JSON: {exc.msg}: line {exc.lineno} column {exc.colno} "
                           f"(char {exc.pos})") from exc
    except ValueError as exc:  # an integer past the interpreter's 4300 digits
        raise InvalidInput(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise InvalidInput("the request body is not valid JSON: it nests too deep") from exc


def _parameters(value: object, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f"'parameters' of the {where} must be an object")
    return value


def _declared_input(raw: object, cursor: BinaryCursor) -> DeclaredInput:
    if not isinstance(raw, dict):
        raise InvalidInput("each input must be an object with name, datatype, shape and data")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidInput("an input has no 'name'")
    datatype = raw.get("datatype")
    if not isinstance(datatype, str):
        raise InvalidInput(f"input '{name}' has no 'datatype'")
    shape = raw.get("shape")
    if not isinstance(shape, list):
        raise InvalidInput(f"input '{name}': 'shape' must be a list of non-negative integers")
    for dim in shape:  # a loop, not all() over a generator: this runs for every input of every call
        if type(dim) is not int or dim < 0:
            raise InvalidInput(f"input '{name}': 'shape' must be a list of non-negative integers")
    if len(shape) > MAX_DIMS:
        raise InvalidInput(f"input '{name}': 'shape' has {len(shape)} dimensions; at most {MAX_DIMS} are allowed")
    if "parameters" not in raw:  # the common case: JSON data and nothing else to read
        if "data" not in raw:
            raise InvalidInput(f"input '{name}' has neither 'data' nor 'binary_data_size'")
        data = raw["data"]
        _check_flat_count(data, shape, name)
        return DeclaredInput(name, datatype, shape, data, None)
    parameters = _parameters(raw.get("parameters"), f"input '{name}'")
    size = parameters.get("binary_data_size")
    region = region_ref(parameters, f"input '{name}'")
    if region is not None:
        if "data" in raw or size is not None:
            raise InvalidInput(f"input '{name}' is in shared memory: give it no 'data' and no 'binary_data_size'")
        return DeclaredInput(name, datatype, shape, None, None, region)
    if size is not None:
        if "data" in raw:
            raise InvalidInput(f"input '{name}' has both 'data' and 'binary_data_size'")
        return DeclaredInput(name, datatype, shape, None, cursor.take(size, name))
    if "data" not in raw:
        raise InvalidInput(f"input '{name}' has neither 'data' nor 'binary_data_size'")
    data = raw["data"]
    _check_flat_count(data, shape, name)
    return DeclaredInput(name, datatype, shape, data, None)


def _check_flat_count(data: object, shape: list[int], name: str) -> None:
    """Flat data's length against the shape, at no cost: a tensor of a million values declared
    as three is refused before any value is read. Nested data is counted as it is built."""
    if isinstance(data, list) and data and not isinstance(data[0], list):
        expected = math.prod(shape)
        if len(data) != expected:
            raise InvalidInput(f"input '{name}': shape {shape} needs {expected} elements, data has {len(data)}")


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
    elif len(data) <= VALUES_A_CALL and not (data and isinstance(data[0], list)):  # small and flat: the common case
        try:  # _numbers_only's check, less a call on every request's path
            sum(data)
        except (TypeError, OverflowError):
            _numbers_only(data, datatype, name)
        try:  # _regular's work, likewise
            array = np.asarray(data)
        except ValueError as exc:
            raise _irregular(name, exc) from exc
        array = _cast(array, dtype, datatype, name, data)
    else:
        array = _numbers(data, dtype, datatype, name)
    if array.size != expected:
        raise InvalidInput(
            f"input '{name}': shape {shape} needs {expected} elements, data has {array.size}"
        )
    return reshaped(array, shape, name)


def _flatten(data: list[Any]) -> list[Any]:
    """The elements of nested lists in row-major order. A loop, not recursion: JSON may nest
    deeper (orjson allows 1024 levels) than Python's recursion limit."""
    if not any(isinstance(x, list) for x in data):
        return data
    flat: list[Any] = []
    pending = [iter(data)]
    while pending:
        for x in pending[-1]:
            if isinstance(x, list):
                pending.append(iter(x))
                break
            flat.append(x)
        else:
            pending.pop()
    return flat


def _numbers(data: list[Any], dtype: np.dtype, datatype: str, name: str) -> np.ndarray:
    """The flat array of numeric JSON data, checked against its datatype. Big data is converted
    a piece at a time (_pieces), and the pieces are joined as numpy joins mixed values (bools and
    numbers, ints and floats), so the tensor and its checks are the whole conversion's."""
    pieces = _pieces(data, name)
    if len(pieces) == 1:
        _numbers_only(data, datatype, name)
        return _cast(_regular(data, name).reshape(-1), dtype, datatype, name, data)
    parts: list[np.ndarray] = []
    row_shape: tuple[int, ...] | None = None
    for piece in pieces:
        _numbers_only(piece, datatype, name)
        array = _regular(piece, name)
        if row_shape is None:
            row_shape = array.shape[1:]
        elif array.shape[1:] != row_shape:
            raise _irregular(name, f"rows of shapes {list(row_shape)} and {list(array.shape[1:])}")
        parts.append(array.reshape(-1))
    return _cast(np.concatenate(parts), dtype, datatype, name, data)


def _numbers_only(rows: list[Any], datatype: str, name: str) -> None:
    """Refuses data that holds anything but numbers (true and false among them) before numpy
    reads it: numpy reads one string among numbers as text, an array of as many strings as long
    as the longest (a string of a million characters beside 16,000 numbers: 61 GiB). `sum`, a C
    loop at a few nanoseconds a value, checks a list of values, or of rows of values (the common
    nesting); a list that fails is walked, a level at a time."""
    pending = [rows]
    while pending:
        values = pending.pop()
        nested = bool(values) and isinstance(values[0], list)
        try:
            sum(map(sum, values)) if nested else sum(values)
            continue
        except (TypeError, OverflowError):  # OverflowError: an int past a float's range, beside floats
            pass
        if nested:  # rows of rows, or a row that does not hold numbers alone: each row on its own
            for row in values:
                if not isinstance(row, list):
                    raise _irregular(name, "a list beside a value")
                pending.append(row)
        else:
            for value in values:
                if isinstance(value, list):
                    raise _irregular(name, "a list beside a value")
                if not isinstance(value, (int, float)):  # bool is an int
                    raise _wrong_kind(datatype, name)


def _pieces(data: list[Any], name: str) -> list[list[Any]]:
    """The lists of at most about VALUES_A_CALL values that data is converted in, in order: a
    slice of its rows; where a row holds more, a slice of the rows of its rows (a batch of one,
    an image's channels), and so on down; a row of values over a slice, cut. Each level split
    up is checked to be regular, as numpy's whole conversion would check it."""
    rows = data
    while rows and isinstance(rows[0], list) and _values_in(rows[0]) > VALUES_A_CALL:
        length = len(rows[0])
        for row in rows:
            if not isinstance(row, list) or len(row) != length:
                beside = f"of {len(row)}" if isinstance(row, list) else "that is a value, not a list"
                raise _irregular(name, f"a row of {length} elements beside one {beside}")
        if not isinstance(rows[0][0], list):  # rows of values: each cut, never flattened into one list
            return [row[start:start + VALUES_A_CALL] for row in rows for start in range(0, length, VALUES_A_CALL)]
        rows = [inner for row in rows for inner in row]
    step = max(1, VALUES_A_CALL // _values_in(rows[0])) if rows else 1
    return [rows[start:start + step] for start in range(0, len(rows), step)] if step < len(rows) else [rows]


def _values_in(row: object) -> int:
    """The values of one row of nested data, counted along its first elements alone."""
    count = 1
    while isinstance(row, list) and row:
        count *= len(row)
        row = row[0]
    return count


def _regular(data: list[Any], name: str) -> np.ndarray:
    try:
        return np.asarray(data)
    except ValueError as exc:
        raise _irregular(name, exc) from exc


def _irregular(name: str, why: object) -> InvalidInput:
    """The refusal of ragged nesting (numpy's ValueError, or what the pieces found)."""
    return InvalidInput(f"input '{name}': data is not a regular array: {why}")


def _cast(array: np.ndarray, dtype: np.dtype, datatype: str, name: str, data: list[Any]) -> np.ndarray:
    kind = array.dtype.kind
    if array.size == 0:
        return array.astype(dtype)
    if datatype == "BOOL":
        if kind != "b":
            raise _wrong_kind(datatype, name)
        return array
    if dtype.kind in "iu":
        if kind not in "iu":  # floats, or ints past int64 that numpy widened to float/object
            return _exact_integers(_flatten(data), dtype, datatype, name)
        info = np.iinfo(dtype)
        if array.min() < info.min or array.max() > info.max:
            raise InvalidInput(f"input '{name}': a value is out of range for {datatype}")
    elif kind not in "iuf":
        raise _wrong_kind(datatype, name)
    return array.astype(dtype)


def _wrong_kind(datatype: str, name: str) -> InvalidInput:
    """The refusal of values of another kind than the datatype's."""
    if datatype == "BOOL":
        return InvalidInput(f"input '{name}': BOOL data must be true or false")
    if numpy_dtype(datatype).kind in "iu":
        return InvalidInput(f"input '{name}': {datatype} data must be integers")
    return InvalidInput(f"input '{name}': {datatype} data must be numbers")


def _exact_integers(flat: list[Any], dtype: np.dtype, datatype: str, name: str) -> np.ndarray:
    """The slow, exact path: every value a Python int within the type's range."""
    if not all(type(x) is int for x in flat):
        raise _wrong_kind(datatype, name)
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
    names: set[str] = set()  # a set: a list's check is quadratic, and a client may ask for 100,000
    for raw in value:
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise InvalidInput("each requested output must be an object with a 'name'")
        parameters = _parameters(raw.get("parameters"), f"output '{raw['name']}'")
        if parameters.get("classification"):
            raise Unsupported("the classification extension is not supported by this server")
        if raw["name"] in names:
            raise InvalidInput(f"output '{raw['name']}' is asked for more than once")
        names.add(raw["name"])
        binary = _flag(parameters, "binary_data", f"output '{raw['name']}'")
        region = region_ref(parameters, f"output '{raw['name']}'")
        requested.append(RequestedOutput(raw["name"], binary, region))
    return requested


def _flag(parameters: dict[str, Any], name: str, where: str) -> bool | None:
    """A true-or-false parameter (None: not given); anything else is refused, as the string
    "false" would otherwise read as true."""
    value = parameters.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidInput(f"{where}: '{name}' must be true or false")
    return value


def encode_response(
    model_name: str,
    model_version: int,
    request_id: str | None,
    outputs: list[tuple[str, str, np.ndarray, bool]],
    in_shared_memory: Mapping[str, tuple[str, int]] | None = None,
) -> tuple[bytes, int | None]:
    """The response body and, when any output is binary, the JSON header's length.

    `outputs` holds (name, datatype, array, as_binary) in response order; those named in
    `in_shared_memory` (name -> region, bytes written) were written there and carry no data.
    """
    tensors: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, datatype, array, as_binary in outputs:
        tensor: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        placed = in_shared_memory.get(name) if in_shared_memory else None
        if placed is not None:
            tensor["parameters"] = {REGION: placed[0], BYTE_SIZE: placed[1]}
        elif as_binary:
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
    if b"null" in header and _non_finite_written(tensors):  # orjson writes null for NaN and infinities
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


NON_FINITE = {"nan": b"NaN", "inf": b"Infinity", "-inf": b"-Infinity"}


def _non_finite_written(tensors: list[dict[str, Any]]) -> bool:
    """Give each JSON output that holds NaN or an infinity its values as Triton writes them;
    whether any did. Asked only once a response holds `null`: a check of every output's values
    would cost every response a microsecond."""
    found = False
    for tensor in tensors:
        data = tensor.get("data")
        if isinstance(data, np.ndarray) and data.dtype.kind == "f" and not np.isfinite(data).all():
            tensor["data"] = _with_non_finite(data)
            found = True
    return found


def _with_non_finite(flat: np.ndarray) -> orjson.Fragment:
    """The values as JSON with NaN, Infinity and -Infinity written as Triton writes them (and
    Python's json, tritonclient and rapidjson read them): orjson writes null, and a client
    read an infinity back as NaN. orjson writes null only where a value is not finite, so the
    nulls are those values in order."""
    text = orjson.dumps(np.ascontiguousarray(flat), option=orjson.OPT_SERIALIZE_NUMPY)
    pieces = text.split(b"null")
    tokens = [NON_FINITE[str(value)] for value in flat[~np.isfinite(flat)].astype(np.float64)]
    joined = [pieces[0]]
    for token, piece in zip(tokens, pieces[1:]):
        joined += (token, piece)
    return orjson.Fragment(b"".join(joined))


def encode_error(message: str) -> bytes:
    return orjson.dumps({"error": message})
