"""The v2 datatype table: names, numpy dtypes, sizes, and agreement with tritonclient."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from tritonclient.utils import np_to_triton_dtype, triton_to_np_dtype

from server.errors import InvalidInput
from server.protocol.datatypes import DATATYPES, element_size, numpy_dtype, v2_datatype

EXPECTED = {
    "BOOL": (np.dtype(np.bool_), 1),
    "UINT8": (np.dtype(np.uint8), 1),
    "UINT16": (np.dtype("<u2"), 2),
    "UINT32": (np.dtype("<u4"), 4),
    "UINT64": (np.dtype("<u8"), 8),
    "INT8": (np.dtype(np.int8), 1),
    "INT16": (np.dtype("<i2"), 2),
    "INT32": (np.dtype("<i4"), 4),
    "INT64": (np.dtype("<i8"), 8),
    "FP16": (np.dtype("<f2"), 2),
    "FP32": (np.dtype("<f4"), 4),
    "FP64": (np.dtype("<f8"), 8),
    "BF16": (np.dtype(ml_dtypes.bfloat16), 2),
    "BYTES": (np.dtype(np.object_), None),
}
FIXED_SIZE = [name for name in EXPECTED if name != "BYTES"]


def test_datatypes_lists_exactly_the_v2_datatypes() -> None:
    assert sorted(DATATYPES) == sorted(EXPECTED)
    assert len(set(DATATYPES)) == len(DATATYPES)


@pytest.mark.parametrize("datatype", list(EXPECTED))
def test_numpy_dtype(datatype: str) -> None:
    assert numpy_dtype(datatype) == EXPECTED[datatype][0]


@pytest.mark.parametrize("datatype", FIXED_SIZE)
def test_numpy_dtype_is_little_endian(datatype: str) -> None:
    assert numpy_dtype(datatype).byteorder in ("<", "|", "=")
    assert numpy_dtype(datatype).newbyteorder("<") == numpy_dtype(datatype)


@pytest.mark.parametrize("datatype", list(EXPECTED))
def test_numpy_dtype_agrees_with_tritonclient(datatype: str) -> None:
    assert numpy_dtype(datatype) == np.dtype(triton_to_np_dtype(datatype))


@pytest.mark.parametrize("datatype", ["FP8", "fp32", "", "STRING", "INT128", " INT32", None, 3])
def test_numpy_dtype_rejects_unknown_names(datatype: object) -> None:
    with pytest.raises(InvalidInput) as caught:
        numpy_dtype(datatype)  # type: ignore[arg-type]
    assert repr(datatype) in caught.value.message
    for valid in EXPECTED:
        assert valid in caught.value.message


@pytest.mark.parametrize("datatype", list(EXPECTED))
def test_v2_datatype_inverts_numpy_dtype(datatype: str) -> None:
    assert v2_datatype(numpy_dtype(datatype)) == datatype


@pytest.mark.parametrize("datatype", list(EXPECTED))
def test_v2_datatype_agrees_with_tritonclient(datatype: str) -> None:
    dtype = np.dtype(triton_to_np_dtype(datatype))
    assert v2_datatype(dtype) == np_to_triton_dtype(dtype) == datatype


@pytest.mark.parametrize(
    ("dtype", "datatype"),
    [
        (np.dtype("S5"), "BYTES"),
        (np.dtype("U3"), "BYTES"),
        (np.bytes_, "BYTES"),
        (np.str_, "BYTES"),
        (np.object_, "BYTES"),
        (np.dtype(">i4"), "INT32"),
        (np.dtype(">f2"), "FP16"),
        (np.dtype(">u8"), "UINT64"),
        (np.float32, "FP32"),
        (bool, "BOOL"),
        (ml_dtypes.bfloat16, "BF16"),
    ],
)
def test_v2_datatype_of_other_spellings(dtype: object, datatype: str) -> None:
    assert v2_datatype(dtype) == datatype  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "dtype",
    [
        np.complex64,
        np.dtype("V2"),
        np.dtype("datetime64[s]"),
        ml_dtypes.float8_e4m3fn,
        "not a dtype",
    ],
)
def test_v2_datatype_rejects_dtypes_without_a_datatype(dtype: object) -> None:
    with pytest.raises(InvalidInput):
        v2_datatype(dtype)  # type: ignore[arg-type]


@pytest.mark.parametrize("datatype", list(EXPECTED))
def test_element_size(datatype: str) -> None:
    assert element_size(datatype) == EXPECTED[datatype][1]


@pytest.mark.parametrize("datatype", ["FP8", "bytes", ""])
def test_element_size_rejects_unknown_names(datatype: str) -> None:
    with pytest.raises(InvalidInput):
        element_size(datatype)
