"""torchao is optional (its own extra): a torch INT8 program served without it fails at load with
the install line, and the model is not ready; nothing else is blamed on it."""

from __future__ import annotations

import hashlib
import re
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from server.config import ModelConfig
from server.devices import Device
from server.engines import create_engine
from server.engines.torch import EXPORT_LOCK, load_program
from server.errors import EngineError

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def int8_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer program whose weight is a torchao INT8 tensor (weight-only), as `batchline
    build --engine torch --precision int8` saves them, in version folder 1."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    version = tmp_path_factory.mktemp("int8") / "1"
    version.mkdir()
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    with EXPORT_LOCK:
        quantize_(module, Int8WeightOnlyConfig())
        batch = torch.export.Dim("batch", max=4096)
        program = torch.export.export(module, (torch.randn(2, 8),), dynamic_shapes=({0: batch},))
        torch.export.save(program, str(version / "model.pt2"))
    digest = hashlib.sha256((version / "model.pt2").read_bytes()).hexdigest()
    (version / "SHA256SUMS").write_text(f"{digest}  model.pt2\n")
    return version


def config() -> ModelConfig:
    return ModelConfig.model_validate({
        "name": "int8",
        "engine": "torch",
        "max_batch_size": 4,
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [8]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [4]}],
    })


@pytest.fixture
def without_torchao(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if torchao were not installed: every torchao module is None in sys.modules, so an
    import of any of them raises ModuleNotFoundError (restored after the test)."""
    for name in [n for n in sys.modules if n == "torchao" or n.startswith("torchao.")] + ["torchao"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ModuleNotFoundError):
        import torchao.quantization  # noqa: F401


def torchao_pin() -> str:
    """The torchao requirement of pyproject.toml's `torchao` extra."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (requirement,) = extras["torchao"]
    return requirement


def test_the_program_loads_and_answers_with_torchao(int8_program: Path) -> None:
    engine = create_engine(config(), int8_program, Device("CPU"))
    assert engine.run({"x": np.ones((3, 8), np.float32)})["y"].shape == (3, 4)


@pytest.mark.usefixtures("without_torchao")
def test_without_torchao_the_load_says_what_to_install(int8_program: Path) -> None:
    with pytest.raises(ModuleNotFoundError, match="^torchao is not installed: pip install ") as raised:
        load_program(int8_program / "model.pt2")
    assert torchao_pin() in str(raised.value), "the message names the extra's pin"
    assert raised.value.name is not None and raised.value.name.split(".")[0] == "torchao"


@pytest.mark.usefixtures("without_torchao")
def test_without_torchao_the_model_fails_at_load_with_the_reason(int8_program: Path) -> None:
    expected = re.escape(f"torchao is not installed: pip install {torchao_pin()}")
    with pytest.raises(EngineError, match=expected):
        create_engine(config(), int8_program, Device("CPU"))


def test_other_missing_modules_are_not_blamed_on_torchao(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def load(path: str) -> None:
        raise ModuleNotFoundError("No module named 'elsewhere'", name="elsewhere")

    monkeypatch.setattr(torch.export, "load", load)
    with pytest.raises(ModuleNotFoundError, match="No module named 'elsewhere'") as raised:
        load_program(tmp_path / "model.pt2")
    assert "torchao" not in str(raised.value)
