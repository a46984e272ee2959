"""What an instance gives back for one batch: the batcher reads it, the instance makes it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from server.errors import BatchlineError


@dataclass
class BatchResult:
    outputs: list[dict[str, np.ndarray]]  # one per request, in request order ({} where failed)
    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0
    # request index -> its error, when only part of the batch failed (out of memory on one item)
    failed: dict[int, BatchlineError] = field(default_factory=dict)
    batch_cap: int | None = None  # the instance's working cap, once running out of memory lowered it
    memory_splits: int = 0  # times this batch was halved after running out of memory
