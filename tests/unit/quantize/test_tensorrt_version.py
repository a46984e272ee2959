"""TensorRT 10 only: another major is refused by name, with how to install 10, before the build
reaches an API it lacks (TensorRT 11 has no BuilderFlag.FP16/BF16/INT8)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from server.config import ModelConfig
from server.engines.tensorrt import unsupported_tensorrt
from server.quantize import tensorrt
from server.quantize.errors import BuildError
from tests.unit.quantize.test_quantize_tensorrt import IMAGE, fake_tensorrt


@pytest.mark.parametrize("version", ["10.0.1.6", "10.13.3.9", "10"])
def test_any_tensorrt_10_will_do(version: str) -> None:
    assert unsupported_tensorrt(version) is None


@pytest.mark.parametrize("version", ["11.0.0.1", "9.3.0", "8.6.1", "100.1", "dev", ""])
def test_another_major_is_refused_naming_how_to_install_10(version: str) -> None:
    problem = unsupported_tensorrt(version)
    assert problem is not None
    assert f"TensorRT {version} is installed" in problem and "TensorRT 10" in problem
    assert "pip install 'tensorrt>=10,<11'" in problem


def tensorrt_11(calls: list[tuple]) -> tuple[type, type]:
    """The fake TensorRT of the build tests as TensorRT 11 is: no FP16/BF16/INT8 builder flags."""
    Fake, FakeTorch = fake_tensorrt(calls)

    class Eleven(Fake):  # type: ignore[misc, valid-type]
        __version__ = "11.0.0.1"

        class BuilderFlag:  # strongly typed networks only: the precision flags are gone
            pass

    return Eleven, FakeTorch


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_a_build_with_tensorrt_11_is_refused_before_any_work(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                             precision: str) -> None:
    calls: list[tuple] = []
    Eleven, FakeTorch = tensorrt_11(calls)
    monkeypatch.setitem(sys.modules, "tensorrt", Eleven)
    monkeypatch.setitem(sys.modules, "torch", FakeTorch)
    onnx_path = tmp_path / "m.onnx"
    onnx_path.write_bytes(b"graph")
    with pytest.raises(BuildError, match=r"TensorRT 11\.0\.0\.1 is installed.*pip install 'tensorrt>=10,<11'"):
        tensorrt.build_engine(onnx_path, tmp_path / "m.plan", ModelConfig.model_validate(IMAGE), precision,
                              cache=tmp_path / "cache")
    assert calls == [] and not (tmp_path / "m.plan").exists() and not (tmp_path / "cache").exists()
