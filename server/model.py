"""One served model version: its instances, its batcher, its statistics and its lifecycle.

Loading builds one engine per placement, warms every instance up, and only then reports
ready; a failure leaves the version unavailable with the reason, and other models unaffected.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from pathlib import Path
from typing import Any

import numpy as np

from server.config import ModelConfig, TensorConfig
from server.devices import placements
from server.engines import create_engine
from server.errors import BatchlineError, EngineError, Unavailable
from server.protocol.datatypes import numpy_dtype
from server.scheduler.admission import validate_inputs
from server.scheduler.batcher import Batcher
from server.scheduler.request import InferenceRequest
from server.stats import ModelStatistics
from server.workers.instance import ModelInstance
from server.workers.pipeline import ModelPipeline

logger = logging.getLogger(__name__)


class ModelState(enum.StrEnum):
    LOADING = "LOADING"
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"
    UNLOADING = "UNLOADING"


class ModelVersion:
    def __init__(self, config: ModelConfig, version: int, path: Path) -> None:
        self.config = config
        self.version = version
        self.path = path
        self.state = ModelState.LOADING
        self.reason = ""
        self.stats = ModelStatistics()
        self.instances: list[ModelInstance] = []
        self._batcher: Batcher | None = None

    @property
    def ready(self) -> bool:
        return self.state is ModelState.READY

    @property
    def label(self) -> str:
        return f"{self.config.name}/{self.version}"

    async def load(self) -> None:
        """Build and warm up every instance off the event loop; never raises."""
        try:
            self.instances = await asyncio.to_thread(self._build_instances)
        except BatchlineError as exc:
            self._fail(exc.message)
            return
        except Exception as exc:  # a bug or an engine's own error type: keep the server up
            logger.exception("loading %s failed", self.label)
            self._fail(f"{type(exc).__name__}: {exc}")
            return
        self._batcher = Batcher(self.config, self.instances, self.stats)
        self.state = ModelState.READY
        for instance in self.instances:
            d = instance.pipeline.engine.describe()
            logger.info(
                "model %s ready: instance %s engine=%s device=%s providers=%s precision=%s",
                self.label, instance.label, d.engine, d.device, ",".join(d.providers), d.precision,
            )

    def _fail(self, reason: str) -> None:
        self.state = ModelState.UNAVAILABLE
        self.reason = reason
        self._close_instances()
        logger.error("model %s is not ready: %s", self.label, reason)

    def _build_instances(self) -> list[ModelInstance]:
        instances = []
        try:
            for index, device in enumerate(placements(self.config.instance_group)):
                engine = create_engine(self.config, self.path, device)
                pipeline = ModelPipeline(self.config, engine, self.path)
                instance = ModelInstance(pipeline, device, f"{self.config.name}-{self.version}-{index}")
                instances.append(instance)
                self._warm_up(instance)
        except BaseException:
            for instance in instances:
                instance.close()
            raise
        return instances

    def _warm_up(self, instance: ModelInstance) -> None:
        if not self.config.warmup.enabled:
            return
        for batch_size in self.config.warmup.batch_sizes:
            inputs = {t.name: self._sample(t, batch_size) for t in self.config.inputs}
            try:
                instance.run_sync([inputs], self.config.batched)
            except BatchlineError as exc:
                raise EngineError(f"warm-up at batch size {batch_size} failed: {exc.message}") from exc

    def _sample(self, tensor: TensorConfig, batch_size: int) -> np.ndarray:
        shape = [batch_size] if self.config.batched else []
        shape += [1 if d == -1 else d for d in tensor.dims]
        if tensor.datatype == "BYTES":
            return np.full(shape, self.config.warmup.text, dtype=object)
        return np.zeros(shape, dtype=numpy_dtype(tensor.datatype))

    async def infer(self, inputs: dict[str, tuple[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """Validate, queue and await one request's outputs (API names)."""
        if self._batcher is None or not self.ready:
            raise Unavailable(f"model '{self.config.name}' version {self.version} is not ready")
        arrays, batch_size = validate_inputs(self.config, inputs)
        request = InferenceRequest(arrays, batch_size, asyncio.get_running_loop().create_future())
        self._batcher.submit(request)
        return await request.future

    @property
    def queue_depth(self) -> int:
        return self._batcher.queue_depth if self._batcher else 0

    async def unload(self) -> None:
        """Stop taking requests, let queued ones finish, then free the engines."""
        self.state = ModelState.UNLOADING
        if self._batcher is not None:
            await self._batcher.drain()
        await asyncio.to_thread(self._close_instances)
        self.state = ModelState.UNAVAILABLE
        self.reason = "unloaded"

    def _close_instances(self) -> None:
        for instance in self.instances:
            instance.close()
        self.instances = []

    def metadata(self) -> dict[str, Any]:
        return {
            "inputs": [self._tensor_metadata(t) for t in self.config.inputs],
            "outputs": [self._tensor_metadata(t) for t in self.config.outputs],
        }

    def _tensor_metadata(self, tensor: TensorConfig) -> dict[str, Any]:
        return {"name": tensor.name, "datatype": tensor.datatype, "shape": self.config.api_shape(tensor)}

    def describe_instances(self) -> list[dict[str, Any]]:
        return [
            {"name": i.label, **vars(i.pipeline.engine.describe())} for i in self.instances
        ]
