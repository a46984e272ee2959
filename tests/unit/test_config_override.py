"""Loading with a config sent in the request (Triton's `config` load parameter): it stands in
for config.yaml for that load only, is validated as config.yaml is, and is never written."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from server.config import ModelConfig
from server.dataplane import DataPlane
from server.errors import InvalidInput
from server.repository import ModelRepository
from tests.unit.onnx_models import DOUBLING_CONFIG, doubling, write_model


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[DataPlane]:
    repository = ModelRepository(tmp_path)
    write_model(tmp_path, "double", DOUBLING_CONFIG, doubling)
    await repository.load_all()
    yield DataPlane(repository)
    await repository.unload_all()


async def test_the_override_serves_for_that_load_and_config_yaml_is_untouched(plane: DataPlane) -> None:
    on_disk = (plane.repository.root / "double" / "config.yaml").read_bytes()
    override = {**DOUBLING_CONFIG, "max_batch_size": 2, "dynamic_batching": {"max_queue_delay_microseconds": 500}}
    await plane.load("double", {"config": json.dumps(override)})
    served = plane.model_config("double", None)
    assert (served["max_batch_size"], served["dynamic_batching"]["max_queue_delay_microseconds"]) == (2, 500)
    assert (plane.repository.root / "double" / "config.yaml").read_bytes() == on_disk
    await plane.load("double", {})
    assert plane.model_config("double", None)["max_batch_size"] == 4, "a later load reads config.yaml again"


@pytest.mark.parametrize(("config", "reason"), [
    ("not json", "not valid JSON"),
    ("[1, 2]", "expected an object"),
    (json.dumps({**DOUBLING_CONFIG, "max_batch_size": "many"}), "field 'max_batch_size'"),
    (json.dumps({**DOUBLING_CONFIG, "name": "other"}), "differs from the model's 'double'"),
    (json.dumps({**DOUBLING_CONFIG, "build": {"source": "double", "engine": "onnxruntime", "precision": "fp16"}}),
     "field 'build'"),
])
async def test_a_bad_override_is_refused_and_the_served_version_stays(plane: DataPlane, config: str, reason: str) -> None:
    with pytest.raises(InvalidInput, match=reason):
        await plane.load("double", {"config": config})
    assert plane.model_ready("double", None)
    assert plane.model_config("double", None)["max_batch_size"] == 4


@pytest.mark.parametrize("change", [
    {"inputs": [{"name": "x", "datatype": "FP64", "dims": [2]}]},
    {"outputs": [{"name": "y", "datatype": "FP32", "dims": [5]}]},
    {"inputs": [*DOUBLING_CONFIG["inputs"], {"name": "extra", "datatype": "FP32", "dims": [1]}]},
])
async def test_an_override_that_does_not_describe_the_model_is_a_bad_config(
    plane: DataPlane, change: dict[str, object]
) -> None:
    """400, as any bad config: a 503 tells clients and load balancers to retry what never loads."""
    with pytest.raises(InvalidInput, match="the config does not describe the model"):
        await plane.load("double", {"config": json.dumps({**DOUBLING_CONFIG, **change})})
    assert plane.model_ready("double", None)
    await plane.unload("double")
    with pytest.raises(InvalidInput, match="the config does not describe the model"):  # nothing serving: the same
        await plane.load("double", {"config": json.dumps({**DOUBLING_CONFIG, **change})})


async def test_files_and_a_config_that_is_not_text_are_refused(plane: DataPlane) -> None:
    with pytest.raises(InvalidInput, match="files is not supported"):
        await plane.load("double", {"file:1/model.onnx": b"\0"})
    with pytest.raises(InvalidInput, match="must be a string"):
        await plane.load("double", {"config": 7})
    with pytest.raises(InvalidInput, match="must be a string"):  # gRPC's bool_param: false was no config at all
        await plane.load("double", {"config": False})


@pytest.mark.parametrize("field", ["model_filename", "tokenizer"])
@pytest.mark.parametrize("value", ["/etc/passwd", "../../other/1/model.pt2", "sub/../../x", "a\\b"])
def test_a_config_names_files_inside_its_version_folder_only(field: str, value: str) -> None:
    """A config may arrive over the control plane (a load's override): it must not point the
    server at another file of the machine, an artifact being code."""
    raw = {"name": "x", "engine": "onnxruntime", "inputs": [{"name": "text", "datatype": "BYTES", "dims": [1]}],
           "outputs": [{"name": "y", "datatype": "FP32", "dims": [1]}]}
    if field == "tokenizer":
        raw["preprocess"] = {"tokenize": {"input": "text", "tokenizer": value}}
    else:
        raw[field] = value
    with pytest.raises(ValidationError, match="must name a file inside the version folder"):
        ModelConfig.model_validate(raw)
