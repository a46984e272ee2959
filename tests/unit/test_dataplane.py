"""The data plane: outputs checked before compute, big bodies off the loop, metadata as Triton's."""

from __future__ import annotations

import threading
from typing import get_args

import numpy as np
import orjson
import pytest

from server import dataplane
from server.config import EngineName, ModelConfig
from server.dataplane import DataPlane
from server.errors import InvalidInput

CONFIG = ModelConfig.model_validate(
    {
        "name": "double",
        "engine": "onnxruntime",
        "max_batch_size": 4,
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [-1]}],
    }
)


class StubModel:
    config = CONFIG
    version = 1

    def __init__(self) -> None:
        self.calls = 0

    async def infer(self, inputs, parameters, record=None):
        self.calls += 1
        return {"y": inputs["x"][1] * 2}


class StubRepository:
    def __init__(self) -> None:
        self.model = StubModel()

    def get(self, name: str, version: str | None = None) -> StubModel:
        return self.model


def body(values: list[float], outputs: list[str] | None = None) -> bytes:
    document: dict = {"inputs": [{"name": "x", "shape": [1, len(values)], "datatype": "FP32", "data": values}]}
    if outputs is not None:
        document["outputs"] = [{"name": n} for n in outputs]
    return orjson.dumps(document)


async def test_unknown_output_is_refused_before_any_compute() -> None:
    repository = StubRepository()
    plane = DataPlane(repository)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="no output 'z'"):
        await plane.infer("double", None, body([1.0], ["z"]), None)
    assert repository.model.calls == 0


async def test_large_bodies_and_outputs_are_coded_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []

    def on_thread(real):
        def spy(*args):
            threads.append(threading.current_thread().name)
            return real(*args)

        return spy

    for name in ("parse_request", "build_tensors", "encode_response"):
        monkeypatch.setattr(dataplane, name, on_thread(getattr(dataplane, name)))
    plane = DataPlane(StubRepository())  # type: ignore[arg-type]
    small, _ = await plane.infer("double", None, body([1.0, 2.0]), None)
    monkeypatch.setattr(dataplane, "INLINE_DECODE_BYTES", 4)
    monkeypatch.setattr(dataplane, "INLINE_ENCODE_JSON_BYTES", 4)
    large, _ = await plane.infer("double", None, body([1.0, 2.0]), None)
    main = threading.main_thread().name
    assert threads[:3] == [main, main, main]
    assert main not in threads[3:] and len(threads) == 6
    assert orjson.loads(small) == orjson.loads(large)
    assert np.allclose(orjson.loads(large)["outputs"][0]["data"], [2.0, 4.0])


class ServedModel:
    """A ready model version, as the metadata and config calls read it."""

    version = 1
    ready = True
    placement = "cpu; onnxruntime 1.0 [CPUExecutionProvider]"

    def __init__(self, config: ModelConfig) -> None:
        self.config = config

    def metadata(self) -> dict:
        return {"inputs": [], "outputs": []}


class OneModelRepository:
    def __init__(self, config: ModelConfig) -> None:
        self.model = ServedModel(config)

    def get(self, name: str, version: str | None = None) -> ServedModel:
        return self.model

    def versions(self, name: str) -> list[ServedModel]:
        return [self.model]

    def config(self, name: str) -> ModelConfig:
        return self.model.config


@pytest.mark.parametrize("engine", get_args(EngineName))
def test_metadata_and_config_name_the_same_triton_platform(engine: str) -> None:
    plane = DataPlane(OneModelRepository(CONFIG.model_copy(update={"engine": engine})))  # type: ignore[arg-type]
    platform = plane.model_metadata("double", None)["platform"]
    assert platform == plane.model_config("double", None)["platform"] == plane.model_config("double", "1")["platform"]
    assert platform == {"onnxruntime": "onnxruntime_onnx", "torch": "pytorch_libtorch", "tensorrt": "tensorrt_plan"}[engine]


class CountingHeap:
    def __init__(self) -> None:
        self.settled = 0

    def settle(self) -> None:
        self.settled += 1


class LoadingRepository(StubRepository):
    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail

    async def load_all(self, names: list[str] | None) -> None:
        pass

    async def load(self, name: str) -> None:
        if self.fail:
            raise InvalidInput("bad config")

    async def unload(self, name: str) -> None:
        pass


async def test_the_heap_settles_after_models_load_or_unload_failed_or_not() -> None:
    heap = CountingHeap()
    plane = DataPlane(LoadingRepository(), heap)  # type: ignore[arg-type]
    plane.start(None)
    assert plane._startup is not None
    await plane._startup
    assert heap.settled == 1, "settled once the startup models are loaded, before readiness"
    await plane.load("double", {})
    await plane.unload("double")
    assert heap.settled == 3
    failing = DataPlane(LoadingRepository(fail=True), heap)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        await failing.load("double", {})
    assert heap.settled == 4, "a failed load leaves remains to free too"
