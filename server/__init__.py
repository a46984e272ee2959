"""Batchline: a KServe v2 inference server with dynamic batching."""

__version__ = "0.1.0"
