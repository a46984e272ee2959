"""Fixtures for the quantize tests: a scratch repository whose sources link to the built models.

Builds are the slow part (seconds each on 2 cores), so each one the tests need is made once per
session and shared; tests that change a repository get their own.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
MODELS = ROOT / "models"


def make_repository(root: Path, models: tuple[str, ...] = ("digits", "minilm")) -> Path:
    """Sources as in models/: their config copied, version 1 and eval/ linked (never written)."""
    for name in models:
        if not (MODELS / name / "1").is_dir():
            pytest.fail(f"models/{name}/1 is not built; run `make models` (make test does it)")
        (root / name).mkdir(parents=True)
        shutil.copyfile(MODELS / name / "config.yaml", root / name / "config.yaml")
        (root / name / "1").symlink_to(MODELS / name / "1")
        (root / name / "eval").symlink_to(MODELS / name / "eval")
    return root


@pytest.fixture(scope="session")
def shared_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_repository(tmp_path_factory.mktemp("quantize") / "models")


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    return make_repository(tmp_path / "models")
