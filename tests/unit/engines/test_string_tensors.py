"""ONNX graphs with string tensors: BYTES (bytes items) in and out, ONNX Runtime's str inside."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from server.config import ModelConfig
from server.devices import Device
from server.engines import create_engine
from server.errors import EngineError
from tests.unit.onnx_models import (
    FORMAT_NUMBERS_CONFIG,
    PARSE_AND_DOUBLE_CONFIG,
    format_numbers,
    parse_and_double,
)


def texts(*items: bytes) -> np.ndarray:
    array = np.empty((len(items), 1), dtype=object)
    array[:, 0] = list(items)
    return array


def test_string_inputs_are_given_to_onnxruntime_as_text(tmp_path: Path) -> None:
    config = ModelConfig.model_validate({"name": "parse", **PARSE_AND_DOUBLE_CONFIG})
    engine = create_engine(config, parse_and_double(tmp_path / "1"), Device("CPU"))
    out = engine.run({"text": texts(b"1.5", b"-4")})
    assert out["doubled"].ravel().tolist() == [3.0, -8.0]
    assert out["doubled_text"].ravel().tolist() == [b"3", b"-8"]
    assert all(type(item) is bytes for item in out["doubled_text"].ravel())
    assert [t.datatype for t in engine.signature().inputs] == ["BYTES"]


def test_string_outputs_come_back_as_bytes(tmp_path: Path) -> None:
    config = ModelConfig.model_validate({"name": "format", **FORMAT_NUMBERS_CONFIG})
    engine = create_engine(config, format_numbers(tmp_path / "1"), Device("CPU"))
    out = engine.run({"x": np.array([[0.5], [2.0]], np.float32)})["text"]
    assert out.dtype == object and out.shape == (2, 1) and out.ravel().tolist() == [b"0.5", b"2"]


def test_text_that_is_not_utf8_names_the_input(tmp_path: Path) -> None:
    config = ModelConfig.model_validate({"name": "parse", **PARSE_AND_DOUBLE_CONFIG})
    engine = create_engine(config, parse_and_double(tmp_path / "1"), Device("CPU"))
    with pytest.raises(EngineError, match="input 'text' item 1 is not UTF-8"):
        engine.run({"text": texts(b"1", b"\xff")})


def test_a_numeric_config_for_a_string_input_is_refused(tmp_path: Path) -> None:
    numeric = {
        **PARSE_AND_DOUBLE_CONFIG,
        "inputs": [{"name": "text", "datatype": "FP32", "dims": [1]}],
        "warmup": {},
    }
    with pytest.raises(
        EngineError, match=r"input 'text': the config says FP32 \[-1, 1\], the model has BYTES \[-1, 1\]"
    ):
        create_engine(
            ModelConfig.model_validate({"name": "parse", **numeric}),
            parse_and_double(tmp_path / "1"),
            Device("CPU"),
        )
