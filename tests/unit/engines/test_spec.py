"""EngineSpec: what an engine is given, made from a model config and its version folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from server.config import ModelConfig
from server.engines.spec import EngineIO, EngineSpec, TensorSpec, TokenSpec
from server.errors import EngineError


def config(**overrides: Any) -> ModelConfig:
    return ModelConfig.model_validate({
        "name": "digits", "engine": "torch", "precision": "bf16",
        "max_batch_size": 8, "batch_buckets": [4, 8],
        "inputs": [{"name": "image", "datatype": "FP32", "dims": [1, 8, 8], "engine_name": "x"}],
        "outputs": [{"name": "probabilities", "datatype": "FP32", "dims": [10]}],
        "torch": {"num_threads": 2}, "onnxruntime": {"intra_op_num_threads": 3},
        **overrides,
    })


def version(folder: Path, *files: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in files:
        (folder / name).write_bytes(b"an artifact")
    return folder


def test_the_spec_takes_its_fields_from_the_config(tmp_path: Path) -> None:
    cfg = config()
    spec = EngineSpec.from_config(cfg, version(tmp_path, "model.pt2"))
    assert spec.artifact == tmp_path / "model.pt2"
    assert spec.precision == "bf16"
    assert spec.options is cfg.torch  # the engine's own block, and nothing else of the config
    assert spec.io == EngineIO(
        model="digits",
        inputs=(TensorSpec("image", "x", "FP32", (1, 8, 8)),),
        outputs=(TensorSpec("probabilities", "probabilities", "FP32", (10,)),),
        max_batch_size=8,
        batch_buckets=(4, 8),
        batch_ladder=(4, 8),
        tokens=None,
    )
    assert spec.io.batched and not EngineIO.from_config(config(max_batch_size=0, batch_buckets=None)).batched


def test_each_engine_gets_its_own_options(tmp_path: Path) -> None:
    folder = version(tmp_path, "model.onnx", "model.plan")
    onnx = config(engine="onnxruntime", precision="fp32")
    assert EngineSpec.from_config(onnx, folder).options is onnx.onnxruntime
    plan = config(engine="tensorrt", precision="fp16")
    assert EngineSpec.from_config(plan, folder).options is None  # a plan carries its own settings


def test_a_text_input_becomes_its_token_tensors() -> None:
    text = config(
        engine="onnxruntime", precision="fp32", max_batch_size=32, batch_buckets=None,
        inputs=[{"name": "text", "datatype": "BYTES", "dims": [1]}],
        outputs=[{"name": "embedding", "datatype": "FP32", "dims": [4]}],
        preprocess={"tokenize": {"input": "text", "max_length": 64, "sequence_buckets": [16, 64],
                                 "token_type_ids": None}},
    )
    io = EngineIO.from_config(text)
    assert io.inputs == (
        TensorSpec("input_ids", "input_ids", "INT64", (-1,), token_of="text"),
        TensorSpec("attention_mask", "attention_mask", "INT64", (-1,), token_of="text"),
    )
    assert io.tokens == TokenSpec("input_ids", 64, (16, 64))
    assert (io.batch_buckets, io.batch_ladder) == ((), (1, 2, 4, 8, 16, 32))


def test_model_filename_names_another_artifact(tmp_path: Path) -> None:
    folder = version(tmp_path, "model.pt2", "digits-bf16.pt2")
    spec = EngineSpec.from_config(config(model_filename="digits-bf16.pt2"), folder)
    assert spec.artifact == folder / "digits-bf16.pt2"


def test_a_missing_artifact_is_an_engine_error(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match=r"artifact .*/model\.pt2 is missing \(was the model built\?\)"):
        EngineSpec.from_config(config(), version(tmp_path, "model.onnx"))
    with pytest.raises(EngineError, match="other.pt2 is missing"):
        EngineSpec.from_config(config(model_filename="other.pt2"), version(tmp_path, "model.pt2"))
