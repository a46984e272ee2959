"""The v2 protocol's tensor datatypes and the numpy dtypes that hold them.

Fixed-size types map to explicitly little-endian dtypes because that is the byte order on
the wire; on little-endian hosts these are the native dtypes, so no conversion happens.
BYTES tensors are numpy object arrays whose elements are `bytes`.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from server.errors import InvalidInput

BYTES = "BYTES"

_NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    BYTES: np.dtype(np.object_),
}

_DATATYPES_BY_DTYPE: dict[np.dtype[Any], str] = {
    dtype: name for name, dtype in _NUMPY_DTYPES.items() if name != BYTES
}

DATATYPES: tuple[str, ...] = tuple(_NUMPY_DTYPES)
"""Every v2 datatype this server accepts, in the protocol's customary order."""

MAX_DIMS = 64

# Values one conversion of a client's typed values reads (JSON data, gRPC typed contents; ~3 ms
# of numpy on this project's CI machine). Each conversion holds the GIL throughout, so a big
# request's tensors, built off the event loop, are built this many values at a time: between two
# pieces the loop can take the GIL and answer everyone else.
VALUES_A_CALL = 1 << 15
"""The most dimensions a tensor may have: numpy's own limit (NPY_MAXDIMS). Checked before any
arithmetic on a shape, so a shape of thousands of huge dims costs nothing (their product would
grow to megabits, and formatting it past 4300 digits raises ValueError)."""


def numpy_dtype(datatype: str) -> np.dtype[Any]:
    """The numpy dtype that holds tensors of a v2 datatype (object dtype for BYTES)."""
    try:
        return _NUMPY_DTYPES[datatype]
    except (KeyError, TypeError):
        raise InvalidInput(_unknown_datatype_message(datatype)) from None


def v2_datatype(dtype: np.dtype[Any] | type) -> str:
    """The v2 datatype for a numpy dtype, whatever its byte order.

    Numpy string, unicode and object dtypes all become BYTES, since that is how the
    protocol carries them.
    """
    try:
        normalized = np.dtype(dtype)
    except TypeError:
        raise InvalidInput(f"{dtype!r} is not a numpy dtype") from None
    if normalized.kind in "SUO":
        return BYTES
    datatype = _DATATYPES_BY_DTYPE.get(normalized.newbyteorder("<"))
    if datatype is None:
        raise InvalidInput(f"numpy dtype {normalized} has no v2 datatype")
    return datatype


def element_size(datatype: str) -> int | None:
    """Bytes per element on the wire, or None for BYTES, whose elements vary in size."""
    if datatype == BYTES:
        return None
    return numpy_dtype(datatype).itemsize


def _unknown_datatype_message(datatype: object) -> str:
    return f"unknown datatype {datatype!r}; valid datatypes are {', '.join(DATATYPES)}"
