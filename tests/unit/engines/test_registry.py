"""The engine registry: one entry per engine, read by everything that needs an engine fact."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from server.cli import build_parser
from server.config import EngineName, ModelConfig
from server.engines import engine_class
from server.engines.base import Engine
from server.engines.registry import ENGINES, EngineEntry, engine_entry
from server.errors import EngineError

ROOT = Path(__file__).resolve().parents[3]


def config(engine: str) -> ModelConfig:
    return ModelConfig.model_validate({
        "name": "double", "engine": engine, "max_batch_size": 4,
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [2]}],
        "onnxruntime": {"intra_op_num_threads": 8}, "torch": {"num_threads": 8},
    })


def test_the_config_schema_takes_exactly_the_registered_engines() -> None:
    """`engine:` is a Literal in server/config.py (the registry cannot be imported there without
    an import circle): this keeps the two the same."""
    assert get_args(EngineName) == tuple(ENGINES)
    assert all(name == entry.name for name, entry in ENGINES.items())


@pytest.mark.parametrize("name", list(ENGINES))
def test_each_engine_class_imports_as_an_engine(name: str) -> None:
    """tensorrt's module imports without TensorRT (the runtime is imported at load), so every
    class imports here."""
    loaded = engine_class(ENGINES[name])
    assert issubclass(loaded, Engine) and loaded is not Engine


def test_a_runtime_that_is_not_installed_is_an_engine_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    monkeypatch.delitem(sys.modules, "server.engines.torch", raising=False)
    with pytest.raises(EngineError, match="the torch engine is not installed: .*torch"):
        engine_class(ENGINES["torch"])
    absent = EngineEntry("absent", "server.engines.no_such_runtime:AbsentEngine", "model.bin", "absent_plan",
                         None, None, ("absent",))
    with pytest.raises(EngineError, match="the absent engine is not installed: No module named"):
        engine_class(absent)


def test_an_unknown_engine_names_the_known_ones() -> None:
    known = r"\(engines: onnxruntime, torch, tensorrt\)"
    with pytest.raises(EngineError, match=rf"unknown engine 'tflite' {known}"):
        engine_entry("tflite")
    assert engine_entry("torch") is ENGINES["torch"]


def test_artifacts_and_triton_platforms() -> None:
    assert {name: (e.artifact, e.triton_platform) for name, e in ENGINES.items()} == {
        "onnxruntime": ("model.onnx", "onnxruntime_onnx"),
        "torch": ("model.pt2", "pytorch_libtorch"),
        "tensorrt": ("model.plan", "tensorrt_plan"),
    }


def test_engine_threads_pin_the_models_own_engine_only() -> None:
    onnx = ENGINES["onnxruntime"].with_threads(config("onnxruntime"), 3)
    assert (onnx.onnxruntime.intra_op_num_threads, onnx.torch.num_threads) == (3, 8)
    torch = ENGINES["torch"].with_threads(config("torch"), 3)
    assert (torch.onnxruntime.intra_op_num_threads, torch.torch.num_threads) == (8, 3)
    plan = config("tensorrt")
    assert ENGINES["tensorrt"].with_threads(plan, 3) is plan  # no threads to pin


@pytest.mark.parametrize("name", list(ENGINES))
def test_the_build_command_offers_every_engine(name: str) -> None:
    args = build_parser().parse_args(["build", "digits", "--engine", name, "--precision", "fp16"])
    assert args.engine == name


def test_importing_the_registry_and_the_engine_factory_imports_no_runtime() -> None:
    """torch takes seconds to import: a server whose models use ONNX Runtime never pays for it."""
    code = (
        "import sys, server.engines, server.engines.registry, server.triton_config\n"
        "print(sorted({'torch', 'onnxruntime', 'tensorrt'} & set(sys.modules)))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == "[]"


def test_where_an_engine_runs_and_what_runs_it_come_from_its_entry() -> None:
    from server.quantize.runner import build_device

    assert [name for name, entry in ENGINES.items() if entry.gpu_only] == ["tensorrt"]
    assert build_device("tensorrt", "cpu").kind == "GPU" and build_device("onnxruntime", "cpu").kind == "CPU"
    assert ENGINES["onnxruntime"].distributions == ("onnxruntime-gpu", "onnxruntime")
    assert "tensorrt" in ENGINES["tensorrt"].distributions
