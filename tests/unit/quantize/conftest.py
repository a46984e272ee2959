"""Fixtures for the quantize tests: a scratch repository whose sources link to the built models.

Builds are the slow part (seconds each on 2 cores), so each one the tests need is made once per
session and shared; tests that change a repository get their own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import linked_repository

ROOT = Path(__file__).resolve().parents[3]
MODELS = ROOT / "models"


@pytest.fixture(scope="session")
def shared_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return linked_repository(tmp_path_factory.mktemp("quantize") / "models")


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    return linked_repository(tmp_path / "models")
