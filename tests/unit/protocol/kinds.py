"""The v2 datatypes by kind, written out here rather than read from the server, so that a
datatype the server drops or renames fails the codec tests."""

INTEGERS = ["UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"]
FLOATS = ["FP16", "FP32", "FP64", "BF16"]
