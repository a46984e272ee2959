"""Wire formats of the KServe v2 / Open Inference Protocol: datatypes and binary tensor data."""
