"""The `openai:` block of a model config: what it declares, and what it refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from server.config import ModelConfig, load_model_config
from server.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]


def text_model(**changes: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "name": "emb", "engine": "onnxruntime", "max_batch_size": 8,
        "inputs": [{"name": "text", "datatype": "BYTES", "dims": [1]}],
        "outputs": [{"name": "embedding", "datatype": "FP32", "dims": [384]}],
        "preprocess": {"tokenize": {"input": "text"}},
        "openai": {"task": "embeddings"},
    }
    return config | changes


def test_minilm_declares_embeddings_without_matryoshka_dimensions() -> None:
    config = load_model_config(ROOT / "models" / "minilm" / "config.yaml")
    assert config.openai is not None and config.openai.task == "embeddings"
    assert config.openai.matryoshka_dimensions is None
    assert config.embedding_output() is not None and config.embedding_output().name == "embedding"


def test_without_the_block_a_model_is_not_served_on_v1() -> None:
    config = ModelConfig.model_validate(text_model(openai=None))
    assert config.openai is None and config.embedding_output() is None


def test_matryoshka_dimensions_and_a_named_output_are_taken() -> None:
    config = ModelConfig.model_validate(text_model(
        outputs=[{"name": "tokens", "datatype": "FP32", "dims": [16]},
                 {"name": "embedding", "datatype": "FP32", "dims": [384]}],
        openai={"task": "embeddings", "output": "embedding", "matryoshka_dimensions": [64, 128, 256]},
    ))
    assert config.embedding_output() is not None and config.embedding_output().dims == [384]


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"openai": {"task": "chat"}}, "openai.task"),
        ({"openai": {"task": "embeddings", "matryoshka_dimensions": [256, 128]}}, "strictly increasing"),
        ({"openai": {"task": "embeddings", "matryoshka_dimensions": [128, 384]}}, "384 is not below the output's 384"),
        ({"openai": {"task": "embeddings", "matryoshka_dimensions": [0]}}, "matryoshka_dimensions"),
        ({"openai": {"task": "embeddings", "matryoshka_dimensions": []}}, "matryoshka_dimensions"),
        ({"openai": {"task": "embeddings", "output": "nope"}}, "'nope' is not one output"),
        ({"openai": {"task": "embeddings", "normalize": True}}, "openai.normalize"),
        ({"preprocess": None, "inputs": [{"name": "text", "datatype": "FP32", "dims": [4]}]}, "needs a text model"),
        ({"outputs": [{"name": "embedding", "datatype": "FP16", "dims": [384]}]}, "must be FP32 with fixed dims"),
        ({"outputs": [{"name": "a", "datatype": "FP32", "dims": [4]}, {"name": "b", "datatype": "FP32", "dims": [4]}]},
         "(the only output)"),
    ],
)
def test_a_bad_openai_block_names_the_file_the_field_and_the_reason(
    tmp_path: Path, changes: dict[str, Any], words: str
) -> None:
    folder = tmp_path / "emb"
    folder.mkdir()
    (folder / "config.yaml").write_text(yaml.safe_dump(text_model(**changes)))
    with pytest.raises(ConfigError) as caught:
        load_model_config(folder / "config.yaml")
    assert str(folder / "config.yaml") in caught.value.message
    assert words in caught.value.message, caught.value.message
