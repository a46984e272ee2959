"""The repository with real (tiny) ONNX models: Triton's words for unknown models, configs
checked against their models at load and by warm-up, and models with string tensors served."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from server.errors import ModelNotFound
from server.repository import ModelRepository
from tests.unit.onnx_models import (
    DOUBLING_CONFIG,
    FORMAT_NUMBERS_CONFIG,
    PARSE_AND_DOUBLE_CONFIG,
    doubling,
    format_numbers,
    parse_and_double,
    unstated_rank,
    write_model,
)


@pytest.fixture
async def repository(tmp_path: Path) -> AsyncIterator[ModelRepository]:
    repository = ModelRepository(tmp_path)
    yield repository
    await repository.unload_all()


def states(repository: ModelRepository) -> dict[str, tuple[str, str]]:
    return {e.name: (e.state, e.reason) for e in repository.index()}


def texts(*items: str) -> tuple[str, np.ndarray]:
    array = np.empty((len(items), 1), dtype=object)
    array[:, 0] = [item.encode() for item in items]
    return "BYTES", array


async def test_unknown_models_and_versions_in_tritons_words(repository: ModelRepository) -> None:
    write_model(repository.root, "double", DOUBLING_CONFIG, doubling)
    await repository.load_all()
    with pytest.raises(ModelNotFound) as unknown:
        repository.get("nosuchmodel")
    assert unknown.value.message == "Request for unknown model: 'nosuchmodel' is not found"
    with pytest.raises(ModelNotFound) as version:
        repository.get("double", "7")
    assert version.value.message == "Request for unknown model: 'double' version 7 is not found"
    assert repository.get("double", "1").ready
    with pytest.raises(ModelNotFound) as huge:  # no folder has such a name: it is not echoed whole
        repository.get("x" * 5_000_000)
    assert huge.value.message == f"Request for unknown model: '{'x' * 255}...' is not found"


async def test_a_config_that_misdescribes_its_model_leaves_it_unavailable_and_others_serving(
    repository: ModelRepository,
) -> None:
    write_model(repository.root, "double", DOUBLING_CONFIG, doubling)
    wrong = {**DOUBLING_CONFIG, "outputs": [{"name": "y", "datatype": "FP32", "dims": [3]}]}
    write_model(repository.root, "misdescribed", wrong, doubling)
    await repository.load_all()
    found = states(repository)
    assert found["double"][0] == "READY"
    state, reason = found["misdescribed"]
    assert state == "UNAVAILABLE"
    assert "output 'y': the config says FP32 [-1, 3], the model has FP32 [-1, 2]" in reason
    doubled = await repository.get("double").start_request({"x": ("FP32", np.ones((1, 2), np.float32))})
    assert doubled["y"].tolist() == [[2.0, 2.0]]


async def test_warm_up_checks_what_the_static_signature_leaves_open(repository: ModelRepository) -> None:
    """The graph's output rank is unknown until it runs: only warm-up can tell [2] from [3]."""
    config = {
        "engine": "onnxruntime",
        "inputs": [
            {"name": "x", "datatype": "FP32", "dims": [1, 2]},
            {"name": "axes", "datatype": "INT64", "dims": [1]},
        ],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [3]}],
    }
    write_model(repository.root, "checked", config, unstated_rank)
    write_model(repository.root, "unchecked", {**config, "warmup": {"enabled": False}}, unstated_rank)
    write_model(
        repository.root,
        "right",
        {**config, "outputs": [{"name": "y", "datatype": "FP32", "dims": [2]}]},
        unstated_rank,
    )
    await repository.load_all()
    found = states(repository)
    assert found["checked"][0] == "UNAVAILABLE"
    assert (
        "warm-up at batch size 1 failed: output 'y': the config says FP32 [3], the model returned FP32 [2]"
        in found["checked"][1]
    )
    assert found["unchecked"][0] == found["right"][0] == "READY"


async def test_a_model_of_string_inputs_warms_up_with_its_own_values_and_serves(
    repository: ModelRepository,
) -> None:
    write_model(repository.root, "parse", PARSE_AND_DOUBLE_CONFIG, parse_and_double)
    default_text = {k: v for k, v in PARSE_AND_DOUBLE_CONFIG.items() if k != "warmup"}
    write_model(repository.root, "parse-default-warmup", default_text, parse_and_double)
    write_model(repository.root, "format", FORMAT_NUMBERS_CONFIG, format_numbers)
    await repository.load_all()
    found = states(repository)
    assert found["parse"][0] == found["format"][0] == "READY"
    assert found["parse-default-warmup"][0] == "UNAVAILABLE"  # its warm-up text is not a number
    assert "warm-up at batch size 1 failed" in found["parse-default-warmup"][1]
    parsed = await repository.get("parse").start_request({"text": texts("2.25", "10")})
    assert parsed["doubled"].tolist() == [[4.5], [20.0]]
    assert parsed["doubled_text"].tolist() == [[b"4.5"], [b"20"]]
    formatted = await repository.get("format").start_request({"x": ("FP32", np.array([[0.25]], np.float32))})
    assert formatted["text"].tolist() == [[b"0.25"]]


async def test_a_model_asked_for_but_missing_keeps_the_server_unready(repository: ModelRepository) -> None:
    """Strict readiness, as Triton: a model named at start that is not in the repository is a
    failure to load, shown in the index, until it is there and loads."""
    write_model(repository.root, "double", DOUBLING_CONFIG, doubling)
    await repository.load_all(["double", "absent"])
    assert repository.get("double").ready
    assert not repository.all_ready()
    assert states(repository)["absent"] == ("UNAVAILABLE", "Request for unknown model: 'absent' is not found")
    write_model(repository.root, "absent", {**DOUBLING_CONFIG, "name": "absent"}, doubling)
    await repository.load("absent")
    assert repository.all_ready() and states(repository)["absent"][0] == "READY"


async def test_a_model_whose_folder_is_gone_still_unloads(repository: ModelRepository) -> None:
    """Loaded, or failed to load, and then removed from the repository: unloading it must still
    free it and let the server read as ready, without a restart."""
    write_model(repository.root, "double", DOUBLING_CONFIG, doubling)
    wrong = {**DOUBLING_CONFIG, "name": "broken", "outputs": [{"name": "y", "datatype": "FP32", "dims": [3]}]}
    write_model(repository.root, "broken", wrong, doubling)
    await repository.load_all()
    assert not repository.all_ready()
    shutil.rmtree(repository.root / "broken")
    shutil.rmtree(repository.root / "double")
    assert states(repository)["double"][0] == "READY"  # still serving, so still listed
    await repository.unload("broken")
    await repository.unload("double")
    assert repository.all_ready() and states(repository) == {}
    with pytest.raises(ModelNotFound):
        await repository.unload("double")  # neither loaded nor on disk any more
