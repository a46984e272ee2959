"""A published build serves where its source's evaluation data is absent (a serving image
carries configs and version folders, not eval/), and only when it was made by the config's spec
from the source's current artifact: anything else needs a rebuild, which needs the data."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from server.config import load_model_config
from server.engines.digests import record_digests
from server.errors import EngineError
from server.quantize.api import build
from server.quantize.ensure import ensure_built

ROOT = Path(__file__).resolve().parents[3]
ASSEMBLE = ROOT / "deploy" / "docker" / "assemble-repository.sh"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """digits and its bf16 build, assembled as the image assembles its repository."""
    from tests.integration.conftest import linked_repository

    work = tmp_path_factory.mktemp("published")
    source = linked_repository(work / "models", ("digits",))
    report = build(source, "digits", "torch", "bf16", name="digits-bf16", progress=lambda _: None, benchmark=False)
    assert report.servable and report.version == 1
    target = work / "image"
    subprocess.run(["sh", str(ASSEMBLE), str(source), str(target)], check=True, capture_output=True)
    assert not (target / "digits" / "eval").exists()
    return target


def _ensure(repository: Path, variant: str = "digits-bf16") -> int | None:
    return ensure_built(repository, variant, load_model_config(repository / variant / "config.yaml"))


def test_a_published_build_serves_without_the_evaluation_data(served: Path) -> None:
    assert _ensure(served) == 1
    assert sorted(p.name for p in (served / "digits-bf16").iterdir() if p.name.isdigit()) == ["1"]  # nothing rebuilt


def test_a_changed_spec_is_not_served_from_the_old_build(served: Path, tmp_path: Path) -> None:
    repository = tmp_path / "models"
    shutil.copytree(served, repository)
    config_path = repository / "digits-bf16" / "config.yaml"
    config = yaml.safe_load(config_path.read_text())
    config["build"]["precision"] = config["precision"] = "fp16"
    config_path.write_text(yaml.safe_dump(config))
    with pytest.raises(EngineError, match="no build of this spec is published.*eval/inputs.npz is missing"):
        _ensure(repository)


def test_a_changed_source_artifact_is_not_served_from_the_old_build(served: Path, tmp_path: Path) -> None:
    repository = tmp_path / "models"
    shutil.copytree(served, repository)
    artifact = repository / "digits" / "1" / "model.pt2"
    artifact.write_bytes(artifact.read_bytes() + b"\0")  # another source than the one built from
    with pytest.raises(EngineError, match="model.pt2 does not match its recorded sha256"):
        _ensure(repository)  # not recorded: a damaged source, said as such
    record_digests(artifact.parent)  # a new source, recorded
    with pytest.raises(EngineError, match="no build of this spec is published"):
        _ensure(repository)
