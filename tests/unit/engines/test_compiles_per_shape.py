"""Which engines say they prepare each input shape on its first run (`compiles_per_shape`), so
that warm-up runs every shape a batch can take for them, and only a few batch sizes for others.
ONNX Runtime's answer is read from the session (a fake one on CUDA, the real one on the CPU)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from server.devices import Device
from server.engines.onnxruntime import OnnxRuntimeEngine, preload_cuda_libraries
from server.engines.spec import EngineSpec
from server.engines.tensorrt import TensorRTEngine
from tests.unit.engines.test_onnxruntime_cuda import CPU, CUDA, SCALE_NODES, FakeSession, config, ort, scale
from tests.unit.onnx_models import doubling

TENSORRT = "TensorrtExecutionProvider"


class OptionsSession(FakeSession):
    """A fake session that reports the options of the providers that took, as ORT does: strings."""

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        requested = {p[0]: p[1] for p in self.requested if isinstance(p, tuple)}
        return {name: {k: str(v) for k, v in requested.get(name, {}).items()} for name in self._taken}


@pytest.fixture
def gpu_session(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """ORT sessions replaced by OptionsSession, taking every provider asked for; the version folder."""
    monkeypatch.setattr(ort, "preload_dlls", lambda *a, **k: None, raising=False)
    preload_cuda_libraries.cache_clear()

    def session(path: str, options: object, providers: list[Any]) -> OptionsSession:
        return OptionsSession([], providers, {CUDA, TENSORRT, CPU}, *SCALE_NODES, scale)

    monkeypatch.setattr(ort, "InferenceSession", session)
    (tmp_path / "model.onnx").write_bytes(b"a graph the fake never reads")
    yield tmp_path
    preload_cuda_libraries.cache_clear()


@pytest.mark.parametrize(("search", "compiles"), [("HEURISTIC", False), ("DEFAULT", False), ("EXHAUSTIVE", True)])
def test_onnxruntime_on_cuda_compiles_per_shape_only_with_the_exhaustive_cudnn_search(
    gpu_session: Path, search: str, compiles: bool
) -> None:
    """EXHAUSTIVE times every convolution algorithm at each new input shape."""
    cfg = config(onnxruntime={"execution_providers": [CUDA], "cudnn_conv_algo_search": search})
    engine = OnnxRuntimeEngine(EngineSpec.from_config(cfg, gpu_session), Device("GPU", 0))
    assert engine.compiles_per_shape is compiles


def test_onnxruntime_with_the_tensorrt_provider_compiles_per_shape(gpu_session: Path) -> None:
    cfg = config(onnxruntime={
        "execution_providers": [TENSORRT, CUDA], "tensorrt": {"engine_cache": False, "timing_cache": False},
    })
    assert OnnxRuntimeEngine(EngineSpec.from_config(cfg, gpu_session), Device("GPU", 0)).compiles_per_shape


def test_onnxruntime_on_the_cpu_compiles_nothing_per_shape(tmp_path: Path) -> None:
    """A real session: exhaustive cuDNN search asked for, but the CPU has no cuDNN to search."""
    cfg = config(
        inputs=[{"name": "x", "datatype": "FP32", "dims": [2]}], outputs=[{"name": "y", "datatype": "FP32", "dims": [2]}],
        onnxruntime={"cudnn_conv_algo_search": "EXHAUSTIVE"},
    )
    engine = OnnxRuntimeEngine(EngineSpec.from_config(cfg, doubling(tmp_path / "1")), Device("CPU"))
    assert not engine.compiles_per_shape


def test_a_tensorrt_plan_compiles_per_shape() -> None:
    """Whatever the plan: said by the class, so no GPU is needed to read it."""
    assert object.__new__(TensorRTEngine).compiles_per_shape is True
