"""The fairness benchmark (loadtest/fairness.py) against the real server: it serves the model as
configured and without its token budget, and reports what each ran. It checks the tool, not the
server's speed: no threshold on a time here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import linked_repository
from tests.loadtest.conftest import run_command

pytestmark = pytest.mark.integration


def test_the_fairness_benchmark_serves_both_copies_and_reports_their_batches(tmp_path: Path) -> None:
    repository = linked_repository(tmp_path / "models", ("minilm",))
    out = tmp_path / "out"
    run_command(sys.executable, "-m", "loadtest.fairness", "--model-repository", str(repository), "--texts", "32",
                "--batch-cap", "16", "--out", str(out), timeout=600)
    configured, without = json.loads((out / "fairness.json").read_text())
    assert configured["max_batch_tokens"] == 2048 and without["max_batch_tokens"] is None
    long_batches = {variant["variant"]: max(int(size) for size in variant["batches"]) for variant in (configured, without)}
    # texts past 256 tokens: 8 a request within 2048 tokens; the batch cap's 16 without
    assert long_batches == {"as configured": 8, "without max_batch_tokens": 16}
    assert configured["small_calls"] >= 1 and without["small_calls"] >= 1
    assert "| as configured | 2048 |" in (out / "fairness.md").read_text()
