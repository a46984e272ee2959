"""Model names and versions as clients write them: whatever a path segment holds is a model or
version the repository has, or a ModelNotFound (404); never an OSError or a ValueError (500)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.errors import ModelNotFound
from server.layout import version_number
from server.quantize.api import _source
from server.repository import ModelRepository
from tests.unit.hypothesis_profile import bounded
from tests.unit.onnx_models import DOUBLING_CONFIG, doubling, write_model


@pytest.mark.parametrize(
    ("version", "number"),
    [("1", 1), ("01", 1), ("0", 0), ("9" * 19, int("9" * 19)), ("9" * 20, None), ("9" * 5000, None),
     ("-1", None), ("+1", None), ("1.5", None), (" 1", None), ("1 ", None), ("", None),
     ("²", None), ("١", None), ("①", None), ("0x1", None)],
)
def test_a_version_is_ascii_digits_and_few_of_them(version: str, number: int | None) -> None:
    """"²" and "١" pass str.isdigit(); int("²") raises ValueError and int("١") is 1, a version
    no folder is named. int() of over 4300 digits raises ValueError."""
    assert version_number(version) == number


@pytest.mark.parametrize(
    "name", ["x" * 256, "x" * 5000, "é" * 200, "a\x00b", "\udcff", "..", ".", "", "a/b", "config.yaml"]
)
def test_a_name_no_folder_can_have_is_not_found(tmp_path: Path, name: str) -> None:
    repository = ModelRepository(tmp_path)
    with pytest.raises(ModelNotFound):
        repository.get(name)
    with pytest.raises(ModelNotFound):
        repository.config(name)


@pytest.mark.parametrize("version", ["²", "9" * 5000, "١"])
async def test_an_odd_version_of_a_model_on_disk_is_not_found(tmp_path: Path, version: str) -> None:
    repository = ModelRepository(tmp_path)
    repository._versions["m"] = {}  # a loaded model, so that the version is what is looked up
    with pytest.raises(ModelNotFound):
        repository.get("m", version)


@bounded(100)
@given(name=st.text(max_size=300), version=st.one_of(st.none(), st.text(max_size=30)))
def test_any_name_and_version_is_found_or_not_found(tmp_path_factory: pytest.TempPathFactory, name: str,
                                                    version: str | None) -> None:
    repository = ModelRepository(tmp_path_factory.getbasetemp() / "no-models-here")
    with pytest.raises(ModelNotFound):
        repository.get(name, version)


async def test_a_version_folder_with_leading_zeros_serves_as_its_number(tmp_path: Path) -> None:
    """"02" is version 2, as Triton reads it: it was read so, then loaded from a folder "2" that
    does not exist, and the model failed to load."""
    write_model(tmp_path, "padded", DOUBLING_CONFIG, doubling)
    (tmp_path / "padded" / "1").rename(tmp_path / "padded" / "02")
    repository = ModelRepository(tmp_path)
    await repository.load("padded")
    try:
        served = repository.get("padded", "2")
        assert served.version == 2 and served.path.name == "02"
        _, version, folder, _ = _source(tmp_path, "padded")  # a build reads the same folder
        assert (version, folder.name) == (2, "02")
        assert (await served.start_request({"x": ("FP32", np.array([[1.0, 2.0]], np.float32))}))["y"].tolist() == [[2.0, 4.0]]
    finally:
        await repository.unload_all()


async def test_a_model_folder_whose_name_is_not_utf8_is_left_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No client can name it, and the index (both protocols) and /metrics failed on it."""
    write_model(tmp_path, "good", DOUBLING_CONFIG, doubling)
    odd = Path(os.fsdecode(bytes(tmp_path) + b"/bad\xff"))
    write_model(odd.parent, odd.name, DOUBLING_CONFIG, doubling)
    repository = ModelRepository(tmp_path)
    assert repository.names_on_disk() == ["good"]
    assert repository.names_on_disk() == ["good"]
    assert [r.message for r in caplog.records].count(
        "the folder b'bad\\xff' in the model repository is left out: its name is not UTF-8") == 1
    with pytest.raises(ModelNotFound):
        await repository.load(odd.name)
