"""Triton's .proto files and the Python modules generated from them (see generate.py)."""
