"""The TensorRT engine's logic that needs no GPU: profile choice, datatypes, guards, signature."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import numpy as np
import pytest

from server.config import BuildSpec, ModelConfig
from server.devices import Device
from server.engines import create_engine
from server.engines.digests import record_digests
from server.engines.profiles import optimization_profiles
from server.engines.registry import ENGINES
from server.engines.signature import check_signature
from server.engines.spec import EngineIO
from server.engines.tensorrt import ProfileRange, choose_profile, numpy_dtype, plan_signature
from server.errors import EngineError
from server.quantize.variant import derive_config


def config(**overrides) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "name": "digits-tensorrt-fp16",
            "engine": "tensorrt",
            "precision": "fp16",
            "max_batch_size": 64,
            "batch_buckets": [1, 8, 64],
            "inputs": [{"name": "image", "datatype": "FP32", "dims": [1, 8, 8]}],
            "outputs": [{"name": "probabilities", "datatype": "FP32", "dims": [10]}],
            "instance_group": [{"kind": "GPU"}],
            **overrides,
        }
    )


def ranges_of(cfg: ModelConfig) -> list[ProfileRange]:
    """The batch ranges the builder gives its profiles, as the engine reads them back."""
    profiles = optimization_profiles(EngineIO.from_config(cfg))
    return [ProfileRange(i, p.shapes["image"][0][0], p.shapes["image"][2][0]) for i, p in enumerate(profiles)]


@pytest.mark.parametrize(("batch", "profile"), [(1, 0), (2, 1), (8, 1), (9, 2), (64, 2)])
def test_each_batch_runs_under_the_profile_of_its_bucket(batch: int, profile: int) -> None:
    assert choose_profile(ranges_of(config()), batch) == profile


def test_a_batch_no_profile_takes_is_refused() -> None:
    with pytest.raises(EngineError, match="no TensorRT profile takes a batch of 65"):
        choose_profile(ranges_of(config()), 65)


def test_overlapping_profiles_prefer_the_narrowest() -> None:
    assert choose_profile([ProfileRange(0, 1, 64), ProfileRange(1, 5, 8)], 6) == 1


def test_tensor_types_map_to_numpy() -> None:
    assert numpy_dtype("HALF") == np.float16 and numpy_dtype("FLOAT") == np.float32
    with pytest.raises(EngineError, match="FP8"):
        numpy_dtype("FP8")


def plan_folder(folder: Path) -> Path:
    """A version folder holding a plan, with its digest recorded: the engine gets past its artifact."""
    (folder / "model.plan").write_bytes(b"PLAN")
    record_digests(folder)
    return folder


def test_the_engine_refuses_a_cpu_instance(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="runs on a GPU"):
        create_engine(config(), plan_folder(tmp_path), Device("CPU"))


def test_the_engine_says_when_tensorrt_is_missing(tmp_path: Path) -> None:
    """Without TensorRT the engine says so at load. With it, the import check passes and what
    fails next (here: no CUDA device, or a plan that is not one) is named instead."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        with pytest.raises(EngineError, match="TensorRT is not installed"):
            create_engine(config(), plan_folder(tmp_path), Device("GPU", 0))
        return
    with pytest.raises(EngineError) as raised:
        create_engine(config(), plan_folder(tmp_path), Device("GPU", 0))
    assert "not installed" not in str(raised.value)


def test_a_tensorrt_variant_is_placed_on_gpus_and_shown_as_a_plan() -> None:
    base = config(engine="onnxruntime", precision="fp32", instance_group=[{"count": 2, "kind": "CPU"}]).model_dump(
        exclude_none=True
    )
    spec = BuildSpec(source="digits", engine="tensorrt", precision="fp16")
    derived = derive_config(base, name="digits-tensorrt-fp16", engine="tensorrt", precision="fp16",
                            model_filename="model.plan", spec=spec)
    assert [(g["count"], g["kind"]) for g in derived["instance_group"]] == [(2, "GPU")]
    assert ENGINES[ModelConfig.model_validate(derived).engine].triton_platform == "tensorrt_plan"


class Mode(Enum):  # stands in for tensorrt.TensorIOMode
    INPUT = 1
    OUTPUT = 2


class DataType(Enum):  # stands in for tensorrt.DataType
    FLOAT = 0
    HALF = 1
    INT64 = 2
    FP8 = 3
    INT4 = 4


class FakePlan:
    """What plan_signature reads of a deserialized ICudaEngine: names, modes, types, shapes."""

    def __init__(self, tensors: list[tuple[str, Mode, DataType, tuple[int, ...]]]) -> None:
        self._tensors = {name: (mode, dtype, shape) for name, mode, dtype, shape in tensors}
        self.num_io_tensors = len(tensors)

    def get_tensor_name(self, index: int) -> str:
        return list(self._tensors)[index]

    def get_tensor_mode(self, name: str) -> Mode:
        return self._tensors[name][0]

    def get_tensor_dtype(self, name: str) -> DataType:
        return self._tensors[name][1]

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return self._tensors[name][2]


def digits_plan(output: DataType = DataType.FLOAT, output_shape: tuple[int, ...] = (-1, 10)) -> FakePlan:
    return FakePlan([
        ("image", Mode.INPUT, DataType.FLOAT, (-1, 1, 8, 8)),
        ("probabilities", Mode.OUTPUT, output, output_shape),
    ])


def test_a_plans_signature_is_read_from_its_tensors() -> None:
    signature = plan_signature(digits_plan())
    assert [(t.name, t.datatype, t.shape) for t in signature.inputs] == [("image", "FP32", (None, 1, 8, 8))]
    assert [(t.name, t.datatype, t.shape) for t in signature.outputs] == [("probabilities", "FP32", (None, 10))]
    check_signature(EngineIO.from_config(config()), signature)


def test_an_fp16_plan_with_half_outputs_serves_an_fp32_config() -> None:
    check_signature(EngineIO.from_config(config()), plan_signature(digits_plan(output=DataType.HALF)))


def test_a_config_that_misdescribes_the_plan_is_refused() -> None:
    with pytest.raises(EngineError, match=r"output 'probabilities': the config says FP32 \[-1, 10\], the model has FP32 \[-1, 3\]"):
        check_signature(EngineIO.from_config(config()), plan_signature(digits_plan(output_shape=(-1, 3))))
    with pytest.raises(EngineError, match=r"the model has INT4 \[-1, 10\]"):  # no v2 name: TensorRT's own
        check_signature(EngineIO.from_config(config()), plan_signature(digits_plan(output=DataType.INT4)))
    tokens = FakePlan([("input_ids", Mode.INPUT, DataType.INT64, (-1, -1)),
                       ("probabilities", Mode.OUTPUT, DataType.FLOAT, (-1, 10))])
    with pytest.raises(EngineError, match="input 'image': the model has no input 'image'"):
        check_signature(EngineIO.from_config(config()), plan_signature(tokens))
