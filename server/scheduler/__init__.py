"""Admission and dynamic batching: which requests run together, and when."""
