"""Telling an engine that ran out of memory from one that failed otherwise.

Engines wrap their runtime's errors in EngineError (`raise ... from exc`), so the whole chain
of causes is searched: MemoryError, torch's CUDA OutOfMemoryError, and the messages ONNX
Runtime, CUDA and TensorRT use when an allocation fails.
"""

from __future__ import annotations

import re
import sys

_MESSAGES = re.compile(
    r"out of memory"  # CUDA ("CUDA out of memory", "CUDA failure 2: out of memory"), torch
    r"|outofmemory"  # TensorRT ("Error Code 2: OutOfMemory")
    r"|failed to allocate memory"  # ONNX Runtime's BFCArena ("Failed to allocate memory for requested buffer")
    r"|bad_alloc|bad allocation"  # C++ std::bad_alloc through a runtime
    r"|alloc_failed"  # CUBLAS_STATUS_ALLOC_FAILED, CUDNN_STATUS_ALLOC_FAILED
    r"|cudaerrormemoryallocation",
    re.IGNORECASE,
)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error`, or any error it was raised from, says memory ran out."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, MemoryError) or _is_torch_oom(current) or _MESSAGES.search(str(current)):
            return True
        current = current.__cause__ or current.__context__
    return False


def _is_torch_oom(error: BaseException) -> bool:
    # An error torch raised means torch is imported; never import it here (seconds, and maybe absent).
    torch = sys.modules.get("torch")
    oom = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    return isinstance(oom, type) and isinstance(error, oom)
