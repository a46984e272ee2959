"""A model instance: one pipeline (engine + batch assembly) and the one thread that runs it.

Batches are merged, run and split on that thread, so the event loop only hands requests over
and resolves futures; engines release the GIL while computing, so instances run in parallel.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from server.devices import Device
from server.scheduler.batcher import BatchResult
from server.workers.pipeline import ModelPipeline


class ModelInstance:
    def __init__(self, pipeline: ModelPipeline, device: Device, label: str) -> None:
        self.pipeline = pipeline
        self.device = device
        self.label = label
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=label)

    async def run(self, feeds: list[dict[str, np.ndarray]]) -> BatchResult:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self.pipeline.run_batch, feeds)

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self.pipeline.engine.close()
