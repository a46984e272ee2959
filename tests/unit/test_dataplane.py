"""The data plane: outputs checked before compute, big bodies off the loop, metadata as Triton's."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import get_args

import numpy as np
import orjson
import pytest

from server.config import EngineName, ModelConfig
from server.dataplane import Call, DataPlane
from server.errors import InvalidInput, ModelNotFound, Unavailable
from server.http import v2_infer
from server.repository import ModelRepository

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
    ready = True
    every_output = tuple((t.name, t.datatype) for t in CONFIG.outputs)

    def __init__(self) -> None:
        self.calls = 0

    def start_request(self, inputs, parameters, record=None, received_ns=None, checked_batch_size=None,
                      items_a_part=None):
        self.calls += 1
        answered = asyncio.get_running_loop().create_future()
        answered.set_result({"y": inputs["x"][1] * 2})
        return answered


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
    model = plane.admit("double", None)
    with pytest.raises(InvalidInput, match=r"model 'double' has no output 'z' \(outputs: y\)"):
        plane.start_call(model, {"x": ("FP32", np.ones((1, 1), np.float32))}, {}, ["y", "z"])  # type: ignore[arg-type]
    assert repository.model.calls == 0


async def test_outputs_come_back_named_in_the_order_asked() -> None:
    plane = DataPlane(StubRepository())  # type: ignore[arg-type]
    model = plane.admit("double", None)
    x = ("FP32", np.array([[1.0, 2.0]], np.float32))
    ((name, datatype, array),) = await plane.start_call(model, {"x": x}, {}).answer()  # type: ignore[arg-type]
    assert (name, datatype, array.tolist()) == ("y", "FP32", [[2.0, 4.0]])
    assert [o[0] for o in await plane.start_call(model, {"x": x}, {}, ["y"]).answer()] == ["y"]  # type: ignore[arg-type]


async def test_outputs_past_the_limit_are_refused_before_any_is_encoded() -> None:
    """A model whose outputs grow with its inputs: encoding a gigabyte held every other client
    for seconds. The limit counts the outputs asked for, together."""
    plane = DataPlane(StubRepository(), max_output_bytes=16)  # type: ignore[arg-type]
    model = plane.admit("double", None)
    within = ("FP32", np.ones((1, 4), np.float32))  # 16 bytes out
    ((_, _, array),) = await plane.start_call(model, {"x": within}, {}).answer()  # type: ignore[arg-type]
    assert array.nbytes == 16
    past = ("FP32", np.ones((1, 5), np.float32))
    with pytest.raises(InvalidInput, match=r"hold 20 bytes, over the server's limit of 16 \(--max-output-bytes\)"):
        await plane.start_call(model, {"x": past}, {}).answer()  # type: ignore[arg-type]


def test_a_bytes_output_counts_its_strings_toward_the_limit() -> None:
    """Counted by its pointers (8 bytes an item), one string of a gigabyte passed a limit of
    64 MiB. Each item counts its length and the 4 bytes of the binary form's prefix."""
    call = Call(None, [("s", "BYTES")], None, max_bytes=100)  # type: ignore[arg-type]
    (_, _, within), = call.outputs({"s": np.array([b"x" * 5] * 10, dtype=object)})  # 10 x (4 + 5) bytes
    assert len(within) == 10
    for long in (b"x" * 97, "x" * 97):  # a bytes item, and a str one (as ONNX Runtime returns them)
        with pytest.raises(InvalidInput, match=r"hold 101 bytes, over the server's limit of 100"):
            call.outputs({"s": np.array([long], dtype=object)})
    # a str item counts its UTF-8 bytes, as it is sent, not its characters: 25 of 4 bytes each
    (_, _, text), = call.outputs({"s": np.array(["\N{GRINNING FACE}" * 24], dtype=object)})  # 4 + 96
    assert len(text) == 1
    with pytest.raises(InvalidInput, match=r"hold 104 bytes, over the server's limit of 100"):
        call.outputs({"s": np.array(["\N{GRINNING FACE}" * 25], dtype=object)})


async def test_a_stopping_server_admits_nothing() -> None:
    plane = DataPlane(StubRepository())  # type: ignore[arg-type]
    plane.begin_stop()
    with pytest.raises(Unavailable, match="shutting down"):
        plane.admit("double", None)


async def test_large_bodies_and_outputs_are_coded_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []

    def on_thread(real):
        def spy(*args):
            threads.append(threading.current_thread().name)
            return real(*args)

        return spy

    for name in ("parse_request", "build_tensors", "encode_response"):
        monkeypatch.setattr(v2_infer, name, on_thread(getattr(v2_infer, name)))
    plane = DataPlane(StubRepository())  # type: ignore[arg-type]
    small, _ = await v2_infer.infer_v2(plane, "double", None, body([1.0, 2.0]), None)
    monkeypatch.setattr(v2_infer, "INLINE_DECODE_BYTES", 4)
    monkeypatch.setattr(v2_infer, "INLINE_ENCODE_JSON_BYTES", 4)
    large, _ = await v2_infer.infer_v2(plane, "double", None, body([1.0, 2.0]), None)
    main = threading.main_thread().name
    assert threads[:3] == [main, main, main]
    assert main not in threads[3:] and len(threads) == 6
    assert orjson.loads(small) == orjson.loads(large)
    assert np.allclose(orjson.loads(large)["outputs"][0]["data"], [2.0, 4.0])


def test_a_long_string_output_is_encoded_off_the_event_loop() -> None:
    """Told by its pointers (8 bytes), an output of one string of 100 KB was encoded on the loop."""
    long = np.array([b"x" * 100_000], dtype=object)
    assert not v2_infer._encodes_inline([("s", "BYTES", long, False)], {})
    assert not v2_infer._encodes_inline([("s", "BYTES", np.array([b"x" * (2 << 20)], dtype=object), True)], {})
    assert v2_infer._encodes_inline([("s", "BYTES", np.array([b"short"], dtype=object), False)], {})


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
    """Builds something on every load and unload (`changes`), then fails the load if asked."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.changes = 0

    async def load_all(self, names: list[str] | None) -> None:
        pass

    async def load(self, name: str, config_override: str | None = None) -> None:
        self.changes += 1
        if self.fail:
            raise Unavailable("the engine failed to load")

    async def unload(self, name: str) -> None:
        self.changes += 1


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
    with pytest.raises(Unavailable):
        await failing.load("double", {})
    assert heap.settled == 4, "a failed load leaves remains to free too"


async def test_a_load_or_unload_refused_before_anything_was_built_does_not_settle_the_heap(tmp_path: Path) -> None:
    """A full collection holds the event loop for hundreds of milliseconds: a client asking again
    and again for a model that is not there, or with a config that does not parse, stalled every
    other client."""
    heap = CountingHeap()
    (tmp_path / "double").mkdir()
    (tmp_path / "double" / "config.yaml").write_text("name: double\nengine: onnxruntime\n")
    plane = DataPlane(ModelRepository(tmp_path), heap)
    with pytest.raises(ModelNotFound):
        await plane.load("absent", {})
    with pytest.raises(ModelNotFound):
        await plane.unload("absent")
    with pytest.raises(InvalidInput):
        await plane.load("double", {"config": "{not json"})
    await plane.unload("double")  # known, never loaded: nothing to drop
    assert heap.settled == 0
