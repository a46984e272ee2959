"""Artifacts are checked against their recorded sha256 before any engine loads them: a damaged or
swapped artifact leaves its model unavailable with the reason (others serve), a folder without
a record loads with a warning that says how to record one, and the record is `sha256sum -c`'s."""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from server.config import ModelConfig
from server.devices import Device
from server.engines import create_engine
from server.engines.digests import RECORD, read_digests, record_digests, verify_artifact
from server.engines.spec import EngineSpec
from server.errors import EngineError
from server.repository import ModelRepository
from tests.unit.onnx_models import DOUBLING_CONFIG, doubling, write_model

MODELS = Path(__file__).resolve().parents[3] / "models"
TORCH_CONFIG = {
    "name": "digits", "engine": "torch", "max_batch_size": 4,
    "inputs": [{"name": "image", "datatype": "FP32", "dims": [1, 8, 8]}],
    "outputs": [{"name": "probabilities", "datatype": "FP32", "dims": [10]}],
}


def sha256sum_check(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sha256sum", "-c", RECORD], check=False, cwd=folder, capture_output=True, text=True)


def tamper(path: Path) -> None:
    """Same size, other bytes: what a swapped file looks like to anything but a digest."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def recorded_onnx(tmp_path: Path) -> Path:
    folder = doubling(tmp_path / "double" / "1")
    record_digests(folder)
    return folder


@pytest.fixture
async def repository(tmp_path: Path) -> AsyncIterator[ModelRepository]:
    repository = ModelRepository(tmp_path / "models")
    yield repository
    await repository.unload_all()


def test_the_record_is_what_sha256sum_writes_and_checks(recorded_onnx: Path) -> None:
    written = (recorded_onnx / RECORD).read_text()
    by_hand = subprocess.run(["sha256sum", "model.onnx"], cwd=recorded_onnx, capture_output=True, text=True,
                             check=True).stdout
    assert written == by_hand
    assert sha256sum_check(recorded_onnx).returncode == 0
    tamper(recorded_onnx / "model.onnx")
    assert sha256sum_check(recorded_onnx).returncode != 0


def test_the_shipped_models_carry_a_record_that_checks() -> None:
    for folder, files in ((MODELS / "digits" / "1", {"model.pt2", "heldout.npz"}),
                          (MODELS / "minilm" / "1", {"model.onnx", "tokenizer.json"})):
        assert set(read_digests(folder) or {}) == files, f"{folder}: rebuild it (make models)"
        assert sha256sum_check(folder).returncode == 0, sha256sum_check(folder).stdout


def test_a_matching_artifact_loads(recorded_onnx: Path) -> None:
    engine = create_engine(ModelConfig.model_validate({"name": "double", **DOUBLING_CONFIG}), recorded_onnx,
                           Device("CPU"))
    assert engine.describe().artifact.endswith("model.onnx")


def test_a_swapped_onnx_artifact_is_refused(recorded_onnx: Path) -> None:
    tamper(recorded_onnx / "model.onnx")
    with pytest.raises(EngineError, match=r"model.onnx does not match its recorded sha256 .*damaged, half-copied or"
                                          r" replaced"):
        create_engine(ModelConfig.model_validate({"name": "double", **DOUBLING_CONFIG}), recorded_onnx,
                      Device("CPU"))


def test_a_swapped_torch_program_is_refused_before_torch_reads_it(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A `.pt2` can run code as it loads: a mismatch must stop the load before torch opens it."""
    import server.engines.torch as torch_engine

    folder = tmp_path / "1"
    folder.mkdir()
    shutil.copyfile(MODELS / "digits" / "1" / "model.pt2", folder / "model.pt2")
    record_digests(folder)
    tamper(folder / "model.pt2")
    opened: list[Path] = []
    monkeypatch.setattr(torch_engine, "load_program", lambda path: opened.append(path))
    with pytest.raises(EngineError, match="model.pt2 does not match its recorded sha256"):
        create_engine(ModelConfig.model_validate(TORCH_CONFIG), folder, Device("CPU"))
    assert opened == []


def test_a_tensorrt_plan_is_checked_where_every_engine_gets_its_artifact(tmp_path: Path) -> None:
    """The tensorrt engine needs a GPU to get further; its plan is checked as it becomes the
    engine's spec, before any engine is made, as every engine's artifact is."""
    config = ModelConfig.model_validate({**TORCH_CONFIG, "engine": "tensorrt"})
    (tmp_path / "model.plan").write_bytes(b"PLAN")
    record_digests(tmp_path)
    assert EngineSpec.from_config(config, tmp_path).artifact == tmp_path / "model.plan"
    (tmp_path / "model.plan").write_bytes(b"PLAX")
    with pytest.raises(EngineError, match="model.plan does not match its recorded sha256"):
        create_engine(config, tmp_path, Device("CPU"))


def test_no_record_loads_with_a_warning_naming_how_to_record_one(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    folder = doubling(tmp_path / "mine" / "1")
    config = ModelConfig.model_validate({"name": "mine", **DOUBLING_CONFIG})
    with caplog.at_level(logging.WARNING, logger="server.engines"):
        create_engine(config, folder, Device("CPU"))
        create_engine(config, folder, Device("CPU"))  # a second instance: no second warning
    warnings = [r.getMessage() for r in caplog.records if RECORD in r.getMessage()]
    assert len(warnings) == 1 and "loads unverified" in warnings[0]
    assert f"cd {folder} && sha256sum model.onnx > {RECORD}" in warnings[0]
    subprocess.run(f"cd {folder} && sha256sum model.onnx > {RECORD}", shell=True, check=True)  # as told
    verify_artifact(folder / "model.onnx", folder)
    tamper(folder / "model.onnx")
    with pytest.raises(EngineError, match="does not match"):
        verify_artifact(folder / "model.onnx", folder)


def test_a_record_must_cover_the_artifact_and_every_file_it_lists(recorded_onnx: Path) -> None:
    artifact = recorded_onnx / "model.onnx"
    (recorded_onnx / "extra.bin").write_bytes(b"weights")
    record_digests(recorded_onnx, ["extra.bin"])
    with pytest.raises(EngineError, match="does not list model.onnx, the file this model loads"):
        verify_artifact(artifact, recorded_onnx)
    record_digests(recorded_onnx)
    assert set(read_digests(recorded_onnx) or {}) == {"model.onnx", "extra.bin"}
    (recorded_onnx / "extra.bin").unlink()
    with pytest.raises(EngineError, match="lists extra.bin, which is missing"):
        verify_artifact(artifact, recorded_onnx)


def test_a_record_that_is_not_sha256sum_lines_is_refused(recorded_onnx: Path) -> None:
    for text in ("not a digest  model.onnx\n", f"{'0' * 64}  ../other/model.onnx\n", f"{'0' * 64}  /etc/passwd\n"):
        (recorded_onnx / RECORD).write_text(text)
        with pytest.raises(EngineError, match="line 1 is not a sha256sum line"):
            verify_artifact(recorded_onnx / "model.onnx", recorded_onnx)
    digest = (recorded_onnx / "model.onnx")
    from server.engines.digests import file_digest

    (recorded_onnx / RECORD).write_text(f"# by hand\n{file_digest(digest).upper()} *model.onnx\n")  # binary mode
    verify_artifact(recorded_onnx / "model.onnx", recorded_onnx)
    assert sha256sum_check(recorded_onnx).returncode == 0


def test_a_file_rewritten_in_place_is_seen_at_once(recorded_onnx: Path) -> None:
    """Digests are remembered per file identity and timestamps, never across a change."""
    artifact = recorded_onnx / "model.onnx"
    verify_artifact(artifact, recorded_onnx)
    tamper(artifact)  # same inode, same size, same clock tick, likely
    with pytest.raises(EngineError, match="does not match"):
        verify_artifact(artifact, recorded_onnx)


async def test_a_swapped_artifact_leaves_its_model_unavailable_and_others_serving(
    repository: ModelRepository,
) -> None:
    for name in ("good", "swapped"):
        record_digests(write_model(repository.root, name, DOUBLING_CONFIG, doubling) / "1")
    tamper(repository.root / "swapped" / "1" / "model.onnx")
    await repository.load_all()
    states = {e.name: (e.state, e.reason) for e in repository.index()}
    assert states["good"][0] == "READY"
    assert states["swapped"][0] == "UNAVAILABLE"
    assert "model.onnx does not match its recorded sha256" in states["swapped"][1]


def test_an_assembled_repository_carries_the_records_and_refuses_a_damaged_copy(tmp_path: Path) -> None:
    assemble = Path(__file__).resolve().parents[3] / "deploy" / "docker" / "assemble-repository.sh"
    source = tmp_path / "source"
    record_digests(write_model(source, "double", DOUBLING_CONFIG, doubling) / "1")
    write_model(source, "mine", DOUBLING_CONFIG, doubling)  # copied in by hand, no record
    done = subprocess.run(["sh", str(assemble), str(source), str(tmp_path / "image")], capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert sha256sum_check(tmp_path / "image" / "double" / "1").returncode == 0
    assert "mine/1 has no SHA256SUMS; it loads unverified" in done.stderr
    tamper(source / "double" / "1" / "model.onnx")
    done = subprocess.run(["sh", str(assemble), str(source), str(tmp_path / "image2")], capture_output=True,
                          text=True, check=False)
    assert done.returncode == 1 and "does not match its SHA256SUMS" in done.stderr
