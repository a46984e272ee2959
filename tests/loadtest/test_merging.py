"""loadtest/merging.py: the merge of a batch's images, into a new array and into the reused buffer."""

from __future__ import annotations

import re

import pytest

from loadtest import merging
from server.workers import pipeline


def test_both_ways_are_timed_per_batch_size_and_the_shipped_threshold_is_left_as_it_was(
    capsys: pytest.CaptureFixture[str],
) -> None:
    shipped = pipeline.REUSE_MIN_BYTES
    assert merging.main(["--batch-sizes", "2,16", "--repeats", "2"]) == 0
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", capsys.readouterr().out, re.MULTILINE)
    assert [(int(r[0]), float(r[1])) for r in rows] == [(2, 1.1), (16, 9.2)]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
    assert pipeline.REUSE_MIN_BYTES == shipped


def test_the_reused_way_merges_into_the_kept_buffer() -> None:
    import numpy as np

    runner = merging.pipeline(4)
    requests = [{"image": np.full((1, *merging.SHAPE), i, np.float32)} for i in range(4)]
    merged: list[np.ndarray] = []
    engine_run = runner.engine.run
    runner.engine.run = lambda inputs: (merged.append(inputs["image"]), engine_run(inputs))[1]  # type: ignore[method-assign]
    original = pipeline.REUSE_MIN_BYTES
    try:
        pipeline.REUSE_MIN_BYTES = 0
        runner.run_batch(requests)
        runner.run_batch(requests)
    finally:
        pipeline.REUSE_MIN_BYTES = original
    assert np.shares_memory(merged[0], merged[1]) and merged[1][:, 0, 0, 0].tolist() == [0, 1, 2, 3]
