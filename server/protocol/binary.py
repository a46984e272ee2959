"""Triton's binary tensor data extension to the v2 HTTP protocol.

A request or response body is a JSON header of `Inference-Header-Content-Length` bytes,
followed by the raw data of every tensor that declared `parameters.binary_data_size`, in
the order those tensors appear in the header. Fixed-size tensors are row-major and
little-endian; BOOL is one byte per element; BYTES is a sequence of elements, each a
4-byte little-endian length followed by that many bytes.

This code runs on every request, so numeric tensors are decoded zero-copy with
`np.frombuffer` (the arrays are read-only views of the body) and never loop per element.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from server.errors import InvalidInput
from server.protocol.datatypes import BYTES, MAX_DIMS, numpy_dtype

Buffer = bytes | bytearray | memoryview

_LENGTH_PREFIX = struct.Struct("<I")
_PREFIX_SIZE = _LENGTH_PREFIX.size
_MAX_ELEMENT_SIZE = 2**32 - 1


def split_body(body: bytes | bytearray, header_length: int) -> tuple[bytes, memoryview]:
    """Split a body into its JSON header and a zero-copy view of the binary data after it."""
    if isinstance(header_length, bool) or not isinstance(header_length, int):
        raise InvalidInput(
            f"Inference-Header-Content-Length must be an integer, got {header_length!r}"
        )
    if not 0 <= header_length <= len(body):
        raise InvalidInput(
            f"Inference-Header-Content-Length is {header_length}, "
            f"but the request body has {len(body)} bytes"
        )
    view = memoryview(body)
    return bytes(view[:header_length]), view[header_length:]


def tensor_from_bytes(raw: Buffer, datatype: str, shape: Sequence[int], name: str) -> np.ndarray:
    """Decode one tensor's binary data; the data must match datatype and shape exactly."""
    count = _element_count(shape, name)
    data = _byte_view(raw)
    if datatype == BYTES:
        return reshaped(_bytes_tensor(data, count, name), shape, name)
    dtype = _dtype_of(datatype, name)
    expected = count * dtype.itemsize
    if len(data) != expected:
        raise InvalidInput(
            f"tensor '{name}' ({datatype}, shape {list(shape)}) needs {expected} bytes "
            f"of binary data, got {len(data)}"
        )
    array = np.frombuffer(data, dtype=dtype, count=count)
    if datatype == "BOOL":
        array = _normalized_bools(array)
    return reshaped(array, shape, name)


def tensor_bytes(array: np.ndarray) -> int:
    """The bytes a tensor takes as the binary form sends it: a BYTES tensor its items' lengths (a
    str item's in UTF-8) and 4 bytes each, any other its buffer. (A BYTES array's `nbytes`
    counts its 8-byte pointers: a string of a gigabyte counted 8.)"""
    if not array.dtype.hasobject:
        return array.nbytes
    flat = array.reshape(-1)
    try:
        return 4 * len(flat) + sum(map(_encoded_length, flat))
    except TypeError:  # an item without a length (not bytes or str): its pointer
        return int(array.nbytes)


def _encoded_length(item: bytes | str) -> int:
    """An item's bytes as sent: a str's in UTF-8 (up to 4 a character; an ASCII one's are its
    characters, which CPython knows without looking)."""
    if isinstance(item, str) and not item.isascii():
        return len(item.encode("utf-8", "surrogatepass"))
    return len(item)


def tensor_to_bytes(array: np.ndarray, datatype: str) -> bytes:
    """Encode a tensor as binary data: row-major and little-endian, or length-prefixed BYTES."""
    if datatype == BYTES:
        return _bytes_tensor_to_bytes(array)
    dtype = numpy_dtype(datatype)
    if array.dtype != dtype and array.dtype.newbyteorder("<") != dtype:
        raise InvalidInput(f"an array of dtype {array.dtype} cannot be sent as {datatype}")
    return array.astype(dtype, copy=False).tobytes(order="C")


class BinaryCursor:
    """Hands out the binary section piece by piece, in the order the header lists tensors.

    Call `take` once for each tensor that declares `binary_data_size`, then `finish`, so
    that a body whose sizes do not add up fails with a clear message instead of tensors
    silently reading each other's bytes.
    """

    def __init__(self, binary: Buffer) -> None:
        self._data = _byte_view(binary)
        self._offset = 0

    @property
    def remaining(self) -> int:
        """Bytes not yet handed out."""
        return len(self._data) - self._offset

    def take(self, binary_data_size: object, name: str) -> memoryview:
        """The next `binary_data_size` bytes, which belong to the tensor `name`."""
        size = _checked_size(binary_data_size, name)
        if size > self.remaining:
            raise InvalidInput(
                f"tensor '{name}' declares binary_data_size {size}, but only "
                f"{self.remaining} bytes of binary data remain in the body"
            )
        start = self._offset
        self._offset += size
        return self._data[start : self._offset]

    def finish(self) -> None:
        """Fail if bytes are left over that no tensor declared."""
        if self.remaining:
            raise InvalidInput(
                f"the body has {self.remaining} bytes of binary data after the last "
                f"tensor's binary_data_size; the sizes must add up to {len(self._data)}"
            )


def split_binary_section(binary: Buffer, sizes: Sequence[tuple[str, object]]) -> list[memoryview]:
    """Cut the binary section into one view per (tensor name, binary_data_size), in order."""
    cursor = BinaryCursor(binary)
    pieces = [cursor.take(size, name) for name, size in sizes]
    cursor.finish()
    return pieces


def _byte_view(raw: Buffer) -> memoryview:
    view = memoryview(raw)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _dtype_of(datatype: str, name: str) -> np.dtype[Any]:
    try:
        return numpy_dtype(datatype)
    except InvalidInput as error:
        raise InvalidInput(f"tensor '{name}': {error.message}") from None


def _element_count(shape: Sequence[int], name: str) -> int:
    if not isinstance(shape, (list, tuple)) or not all(_is_dim(dim) for dim in shape):
        raise InvalidInput(
            f"tensor '{name}' has shape {shape!r}; a shape must be a list of non-negative integers"
        )
    if len(shape) > MAX_DIMS:
        raise InvalidInput(f"tensor '{name}' has {len(shape)} dimensions; at most {MAX_DIMS} are allowed")
    return math.prod(int(dim) for dim in shape)


def reshaped(array: np.ndarray, shape: Sequence[int], name: str) -> np.ndarray:
    """Reshape a client's tensor; numpy refuses absurd dimensions (as in [0, 2**63]: zero
    elements, but no such array), which is the client's error."""
    try:
        return array.reshape(shape)
    except ValueError:
        raise InvalidInput(f"tensor '{name}' has shape {list(shape)}, which is too large") from None


def _is_dim(dim: object) -> bool:
    return _as_count(dim) is not None


def _as_count(value: object) -> int | None:
    """The value as a non-negative int, or None; JSON's true and false are not numbers here."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0:
        return int(value)
    return None


def _checked_size(binary_data_size: object, name: str) -> int:
    size = _as_count(binary_data_size)
    if size is None:
        raise InvalidInput(
            f"tensor '{name}' has binary_data_size {binary_data_size!r}; "
            "it must be a non-negative integer"
        )
    return size


def _normalized_bools(array: np.ndarray) -> np.ndarray:
    """Any non-zero byte means true, as in C; numpy needs exactly 0 or 1 in a bool."""
    as_bytes = array.view(np.uint8)
    if as_bytes.size and as_bytes.max() > 1:
        return as_bytes.astype(np.bool_)
    return array


def _bytes_tensor(data: memoryview, count: int, name: str) -> np.ndarray:
    if count * _PREFIX_SIZE > len(data):
        raise InvalidInput(
            f"tensor '{name}' (BYTES) has {count} elements, which need at least "
            f"{count * _PREFIX_SIZE} bytes of length prefixes, but its data is {len(data)} bytes"
        )
    elements = np.empty(count, dtype=np.object_)
    end = len(data)
    offset = 0
    for index in range(count):
        if end - offset < _PREFIX_SIZE:
            raise InvalidInput(_missing_element_message(name, index, count, end - offset))
        (length,) = _LENGTH_PREFIX.unpack_from(data, offset)
        offset += _PREFIX_SIZE
        if length > end - offset:
            raise InvalidInput(
                f"tensor '{name}' (BYTES): element {index} declares {length} bytes, "
                f"but only {end - offset} bytes remain"
            )
        elements[index] = bytes(data[offset : offset + length])
        offset += length
    if offset != end:
        raise InvalidInput(
            f"tensor '{name}' (BYTES) has {end - offset} bytes left over after its {count} elements"
        )
    return elements


def _missing_element_message(name: str, index: int, count: int, left: int) -> str:
    if left == 0:
        return f"tensor '{name}' (BYTES) holds only {index} of its {count} elements"
    return (
        f"tensor '{name}' (BYTES): element {index} has a truncated length prefix "
        f"({left} of {_PREFIX_SIZE} bytes)"
    )


def _bytes_tensor_to_bytes(array: np.ndarray) -> bytes:
    pieces: list[bytes] = []
    for index, element in enumerate(array.ravel(order="C").tolist()):
        encoded = _element_bytes(element, index)
        pieces.append(_LENGTH_PREFIX.pack(len(encoded)))
        pieces.append(encoded)
    return b"".join(pieces)


def _element_bytes(element: object, index: int) -> bytes:
    if isinstance(element, bytes):
        encoded = element
    elif isinstance(element, str):
        try:
            encoded = element.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidInput(f"BYTES element {index} is a str that is not valid UTF-8") from None
    else:
        raise InvalidInput(
            f"BYTES element {index} is a {type(element).__name__}; expected bytes or str"
        )
    if len(encoded) > _MAX_ELEMENT_SIZE:
        raise InvalidInput(f"BYTES element {index} is over the 4 GiB limit of its length prefix")
    return encoded
