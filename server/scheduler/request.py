"""One admitted inference request, as the scheduler sees it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False)
class InferenceRequest:
    """Validated inputs (API names, batch dim first when the model batches) and the future
    through which exactly one result or error comes back."""

    inputs: dict[str, np.ndarray]
    batch_size: int
    future: asyncio.Future[dict[str, np.ndarray]]
    arrival_ns: int = field(default_factory=time.perf_counter_ns)

    def shape_key(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Requests batch together only when every non-batch dim agrees."""
        return tuple((name, array.shape[1:]) for name, array in self.inputs.items())

    def resolve(self, outputs: dict[str, np.ndarray]) -> None:
        if not self.future.done():
            self.future.set_result(outputs)

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)
