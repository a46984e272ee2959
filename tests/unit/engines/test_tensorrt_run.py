"""The TensorRT engine end to end on the CPU: a fake `tensorrt` whose plan reads its input from
the addresses the engine hands it and writes its output there, in the plan's own type, with
torch CPU tensors standing in for the CUDA buffers (`CudaPlace` replaced). What this checks that
the pure tests cannot: the buffers the engine wires are the ones TensorRT reads and writes, a
batch of the wrong type is refused before TensorRT sees its bytes, BF16 and FP8 outputs come back
as float32 with their values, the runtime lives as long as the engine, and close() releases
context, engine and runtime in that order.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import weakref
from enum import Enum
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from server.devices import Device
from server.engines import create_engine, tensorrt
from server.engines.digests import record_digests
from server.engines.spec import EngineSpec
from server.engines.tensorrt import TensorRTEngine
from server.errors import EngineError, InvalidInput
from tests.unit.engines.test_tensorrt_engine import FakePlan, Mode, config

PLAN = b"a serialized plan"


class DataType(Enum):  # stands in for tensorrt.DataType
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BF16 = 7
    FP8 = 6
    INT4 = 9


# what the fake plan writes for each type, as numpy (and ml_dtypes) hold it
STORED = {"FLOAT": np.float32, "HALF": np.float16, "BF16": ml_dtypes.bfloat16, "FP8": ml_dtypes.float8_e4m3fn}


def expected_probabilities(image: np.ndarray) -> np.ndarray:
    """What the fake plan computes: each row's sum, plus a quarter per class."""
    return image.reshape(len(image), -1).sum(axis=1, dtype=np.float64)[:, None] + np.arange(10) * 0.25


def read(address: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    count = int(np.prod(shape))
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(address)
    return np.frombuffer(bytes(raw), dtype=dtype).reshape(shape)


class FakeContext:
    """An IExecutionContext: keeps the shapes and addresses it is given, and runs the digits plan
    on whatever memory those addresses point to."""

    def __init__(self, output: DataType, succeeds: bool) -> None:
        self.output = output  # not the plan itself: a cycle would keep both alive past close()
        self.succeeds = succeeds
        self.profile: int | None = None
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.runs = 0

    def set_optimization_profile_async(self, profile: int, stream: int) -> bool:
        self.profile = profile
        return True

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name: str, address: int) -> bool:
        self.addresses[name] = address
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return (self.shapes["image"][0], 10)

    def execute_async_v3(self, stream: int) -> bool:
        self.runs += 1
        image = read(self.addresses["image"], np.dtype(np.float32), self.shapes["image"])
        stored = expected_probabilities(image).astype(STORED[self.output.name])
        ctypes.memmove(self.addresses["probabilities"], stored.tobytes(), stored.nbytes)
        return self.succeeds


class RunnablePlan(FakePlan):
    """An ICudaEngine with the digits model's tensors, three profiles (batch buckets 1, 8, 64)
    and an execution context that computes."""

    num_optimization_profiles = 3
    RANGES = ((1, 1), (2, 8), (9, 64))

    def __init__(self, output: DataType = DataType.FLOAT, image: DataType = DataType.FLOAT) -> None:
        super().__init__([
            ("image", Mode.INPUT, image, (-1, 1, 8, 8)),
            ("probabilities", Mode.OUTPUT, output, (-1, 10)),
        ])
        self.output = output
        self.succeeds = True
        self.released: list[str] | None = None  # where contexts note their release

    def get_tensor_profile_shape(self, name: str, profile: int) -> tuple[tuple[int, ...], ...]:
        low, high = self.RANGES[profile]
        return (low, 1, 8, 8), (high, 1, 8, 8), (high, 1, 8, 8)

    def create_execution_context(self) -> FakeContext:
        context = FakeContext(self.output, self.succeeds)
        if self.released is not None:
            weakref.finalize(context, self.released.append, "context")
        return context


class FakeTensorRT:
    """The part of the `tensorrt` module the engine uses; records what it made and, through
    finalizers, the order in which the engine lets go of it."""

    class Logger:
        WARNING = 2

        def __init__(self, level: int) -> None: ...

    def __init__(self, plan: RunnablePlan, version: str = "10.9.0.34") -> None:
        self.__version__ = version
        self.plan = plan
        self.released: list[str] = []
        self.runtimes: list[Any] = []
        fake = self

        class Runtime:
            def __init__(self, logger: Any) -> None:
                fake.runtimes.append(weakref.ref(self))
                weakref.finalize(self, fake.released.append, "runtime")

            def deserialize_cuda_engine(self, data: bytes) -> RunnablePlan | None:
                if data != PLAN:
                    return None
                plan, fake.plan = fake.plan, None  # the engine holds the only reference
                weakref.finalize(plan, fake.released.append, "engine")
                plan.released = fake.released
                return plan

        self.Runtime = Runtime


class CpuPlace:
    """Stands in for CudaPlace: the same interface, CPU memory, no stream."""

    def __init__(self, torch_module: Any, device: Device) -> None:
        self.device = torch.device("cpu")
        self.entered = 0
        self.synchronized = 0

    @contextlib.contextmanager
    def active(self) -> Any:
        self.entered += 1
        yield

    stream_handle = 0

    def synchronize(self) -> None:
        self.synchronized += 1


@pytest.fixture
def gpu_here(monkeypatch: pytest.MonkeyPatch) -> list[CpuPlace]:
    """torch says there is a GPU; the engine's place on it is a CPU stand-in (listed here)."""
    places: list[CpuPlace] = []

    def place(torch_module: Any, device: Device) -> CpuPlace:
        places.append(CpuPlace(torch_module, device))
        return places[-1]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tensorrt, "CudaPlace", place)
    return places


def install(monkeypatch: pytest.MonkeyPatch, plan: RunnablePlan, version: str = "10.9.0.34") -> FakeTensorRT:
    fake = FakeTensorRT(plan, version)
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    return fake


def version_dir(tmp_path: Path, plan: bytes = PLAN) -> Path:
    (tmp_path / "model.plan").write_bytes(plan)
    record_digests(tmp_path)
    return tmp_path


def images(batch: int, dtype: Any = np.float32) -> np.ndarray:
    return (np.arange(batch * 64, dtype=np.float64).reshape(batch, 1, 8, 8) / 64).astype(dtype)


@pytest.mark.parametrize(("batch", "profile"), [(1, 0), (5, 1), (64, 2)])
def test_a_batch_runs_on_the_buffers_it_was_given(monkeypatch: pytest.MonkeyPatch, gpu_here: list[CpuPlace],
                                                  tmp_path: Path, batch: int, profile: int) -> None:
    install(monkeypatch, RunnablePlan())
    engine = create_engine(config(), version_dir(tmp_path), Device("GPU", 0))
    feed = images(batch)
    feed.flags.writeable = False  # as request buffers come
    result = engine.run({"image": feed})
    assert result["probabilities"].dtype == np.float32
    np.testing.assert_array_equal(result["probabilities"], expected_probabilities(feed).astype(np.float32))
    context = engine._context
    assert context.profile == profile and context.shapes["image"] == (batch, 1, 8, 8)
    assert gpu_here[0].synchronized == 1 and gpu_here[0].entered == 2  # load, run
    assert engine.describe().providers == ["TensorRT 10.9.0.34", "3 profiles"]


@pytest.mark.parametrize("output", [DataType.HALF, DataType.BF16, DataType.FP8])
def test_narrow_float_outputs_come_back_as_numpy_holds_them(monkeypatch: pytest.MonkeyPatch, gpu_here: list[CpuPlace],
                                                            tmp_path: Path, output: DataType) -> None:
    """FP16 stays float16; BF16 and FP8, which numpy lacks, come back as float32, holding the
    values the plan wrote (rounded to the plan's type), and serve the FP32 config."""
    install(monkeypatch, RunnablePlan(output=output))
    engine = create_engine(config(), version_dir(tmp_path), Device("GPU", 0))
    feed = images(3)
    probabilities = engine.run({"image": feed})["probabilities"]
    stored = expected_probabilities(feed).astype(STORED[output.name])
    assert probabilities.dtype == (np.float16 if output is DataType.HALF else np.float32)
    np.testing.assert_array_equal(probabilities, stored.astype(probabilities.dtype))
    np.testing.assert_allclose(probabilities, expected_probabilities(feed), rtol=1 / 8)  # not garbage
    assert [t.datatype for t in engine.signature().outputs] == ["FP16" if output is DataType.HALF else "FP32"]


def test_a_batch_of_another_type_is_refused_before_tensorrt_reads_it(
    monkeypatch: pytest.MonkeyPatch, gpu_here: list[CpuPlace], tmp_path: Path
) -> None:
    """float64 (or big-endian float32) bytes read as float32 would be garbage: refused, typed."""
    install(monkeypatch, RunnablePlan())
    engine = create_engine(config(), version_dir(tmp_path), Device("GPU", 0))
    for wrong in (images(2, np.float64), images(2, np.dtype(">f4")), images(2, np.float16)):
        with pytest.raises(InvalidInput, match=rf"input 'image': the TensorRT plan takes float32, the batch is {wrong.dtype}"):
            engine.run({"image": wrong})
    with pytest.raises(InvalidInput, match="takes input 'image', which the batch lacks"):
        engine.run({"pixels": images(2)})
    assert engine._context.runs == 0
    assert engine.run({"image": images(2)})["probabilities"].shape == (2, 10)


def test_inputs_and_outputs_it_cannot_carry_are_refused_at_load(
    monkeypatch: pytest.MonkeyPatch, gpu_here: list[CpuPlace], tmp_path: Path
) -> None:
    install(monkeypatch, RunnablePlan(image=DataType.BF16))
    with pytest.raises(EngineError, match="the plan's input 'image' is BF16, which this engine cannot feed"):
        create_engine(config(), version_dir(tmp_path), Device("GPU", 0))
    install(monkeypatch, RunnablePlan(output=DataType.INT4))
    with pytest.raises(EngineError, match="the plan's output 'probabilities' is INT4, which this engine cannot return"):
        create_engine(config(), version_dir(tmp_path), Device("GPU", 0))


def test_the_runtime_lives_as_long_as_the_engine_and_close_releases_in_order(
    monkeypatch: pytest.MonkeyPatch, gpu_here: list[CpuPlace], tmp_path: Path
) -> None:
    fake = install(monkeypatch, RunnablePlan())
    engine = create_engine(config(), version_dir(tmp_path), Device("GPU", 0))
    assert fake.runtimes[0]() is not None and fake.released == []  # kept, not dropped after loading
    engine.run({"image": images(1)})
    engine.close()
    assert fake.released == ["context", "engine", "runtime"]
    assert gpu_here[0].synchronized == 2  # the run's, and close waits for the stream
    engine.close()  # twice: nothing more
    assert fake.released == ["context", "engine", "runtime"]
    with pytest.raises(EngineError, match="closed"):
        engine.run({"image": images(1)})


def test_a_failed_load_releases_what_it_made_in_order(monkeypatch: pytest.MonkeyPatch, gpu_here: list[CpuPlace],
                                                       tmp_path: Path) -> None:
    fake = install(monkeypatch, RunnablePlan(output=DataType.INT4))
    with pytest.raises(EngineError, match="INT4"):
        TensorRTEngine(EngineSpec.from_config(config(), version_dir(tmp_path)), Device("GPU", 0))
    assert fake.released == ["context", "engine", "runtime"]


def test_a_plan_tensorrt_cannot_deserialize_names_the_reason(
    monkeypatch: pytest.MonkeyPatch, gpu_here: list[CpuPlace], tmp_path: Path
) -> None:
    install(monkeypatch, RunnablePlan())
    with pytest.raises(EngineError, match="valid only for the GPU model and TensorRT version they were built with"):
        create_engine(config(), version_dir(tmp_path, b"a plan from another GPU"), Device("GPU", 0))


def test_a_plan_that_does_not_match_its_digest_is_never_deserialized(
    monkeypatch: pytest.MonkeyPatch, gpu_here: list[CpuPlace], tmp_path: Path
) -> None:
    fake = install(monkeypatch, RunnablePlan())
    folder = version_dir(tmp_path)
    (folder / "model.plan").write_bytes(PLAN + b" and then some")  # replaced after its digest was recorded
    with pytest.raises(EngineError, match="model.plan"):
        create_engine(config(), folder, Device("GPU", 0))
    assert fake.runtimes == [] and fake.plan is not None  # TensorRT never saw it


def test_a_tensorrt_other_than_10_is_refused_at_load(monkeypatch: pytest.MonkeyPatch, gpu_here: list[CpuPlace],
                                                     tmp_path: Path) -> None:
    fake = install(monkeypatch, RunnablePlan(), version="11.0.0.1")
    with pytest.raises(EngineError, match=r"TensorRT 11\.0\.0\.1 is installed.*TensorRT 10.*pip install 'tensorrt>=10,<11'"):
        create_engine(config(), version_dir(tmp_path), Device("GPU", 0))
    assert fake.runtimes == []


def test_the_stand_in_keeps_the_interface_of_the_cuda_place() -> None:
    """What the engine calls on CudaPlace (which needs CUDA, so is not run here), CpuPlace has."""
    used = {"device", "active", "stream_handle", "synchronize"}
    assert {n for n in vars(tensorrt.CudaPlace) if not n.startswith("_")} | {"device"} == used
    assert used <= set(dir(CpuPlace(torch, Device("GPU", 0))))
