"""The README's commands, typed exactly as written, from a folder laid out as the repository root
(a relative `models/`), so that a path resolved against the wrong folder fails here first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.integration.conftest import MODELS, linked_repository

BATCHLINE = Path(sys.executable).parent / "batchline"


def test_the_readme_int8_build_works_with_the_default_relative_repository(tmp_path: Path) -> None:
    linked_repository(tmp_path / "models", ("minilm",))
    before = sorted(p.name for p in MODELS.iterdir())
    env = {k: v for k, v in os.environ.items() if k != "BATCHLINE_MODEL_REPOSITORY"}
    done = subprocess.run([str(BATCHLINE), "build", "minilm", "--engine", "onnxruntime", "--precision", "int8"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "models" / "minilm-onnxruntime-int8" / "1" / "model.onnx").is_file()
    assert "mean_cosine" in done.stdout
    assert "/v2/repository/models/minilm-onnxruntime-int8/load" in done.stderr  # how to serve it
    assert sorted(p.name for p in MODELS.iterdir()) == before  # the real repository is never written
