"""A model instance: one pipeline (engine + pre-processing) and the one thread that runs it.

Batches are merged, run and split on that thread, so the event loop only hands over requests
and resolves futures; engines release the GIL while computing, so instances run in parallel.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from server.devices import Device
from server.workers.pipeline import ModelPipeline, StageTimes


@dataclass
class BatchResult:
    outputs: list[dict[str, np.ndarray]]  # one per request, in request order
    times: StageTimes


def merge(batch: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Concatenate the requests' inputs along the batch dimension."""
    if len(batch) == 1:
        return batch[0]
    return {name: np.concatenate([inputs[name] for inputs in batch]) for name in batch[0]}


def split(outputs: dict[str, np.ndarray], sizes: list[int]) -> list[dict[str, np.ndarray]]:
    """Cut the batch's outputs back into one dict per request (views, no copies)."""
    if len(sizes) == 1:
        return [outputs]
    bounds = np.cumsum(sizes)[:-1]
    pieces = {name: np.split(array, bounds) for name, array in outputs.items()}
    return [{name: pieces[name][i] for name in outputs} for i in range(len(sizes))]


class ModelInstance:
    def __init__(self, pipeline: ModelPipeline, device: Device, label: str) -> None:
        self.pipeline = pipeline
        self.device = device
        self.label = label
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=label)

    def run_sync(self, batch: list[dict[str, np.ndarray]], batched: bool) -> BatchResult:
        """Merge, run and split on the calling thread (warm-up uses this directly)."""
        if not batched:
            outputs, times = self.pipeline.run(batch[0])
            return BatchResult([outputs], times)
        sizes = [len(next(iter(inputs.values()))) for inputs in batch]
        outputs, times = self.pipeline.run(merge(batch))
        return BatchResult(split(outputs, sizes), times)

    async def run(self, batch: list[dict[str, np.ndarray]], batched: bool) -> BatchResult:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self.run_sync, batch, batched)

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self.pipeline.engine.close()
