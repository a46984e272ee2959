"""loadtest/merging.py: the merge of a batch's images, timed into a new array and into the
reused buffer, with its record."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest import merging


def test_both_ways_are_timed_per_batch_size_and_recorded(tmp_path: Path) -> None:
    assert merging.main(["--batch-sizes", "2,16", "--repeats", "2", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "merging.json").read_text())
    assert [(r["batch"], r["mib"]) for r in record["rows"]] == [(2, 1.1), (16, 9.2)]
    assert all(r["new_array_ms"] > 0 and r["reused_buffer_ms"] > 0 for r in record["rows"])
    assert record["machine"]["logical_cpus"] > 0 and "--repeats 2" in record["command_line"]
    assert "| 16 | 9.200 |" in (tmp_path / "merging.md").read_text()


def test_the_reused_way_merges_into_the_kept_buffer_and_the_new_way_does_not() -> None:
    import numpy as np

    requests = [{"image": np.full((1, *merging.SHAPE), i, np.float32)} for i in range(4)]
    for reuse_min_bytes, shared in ((0, True), (1 << 62, False)):
        runner = merging.pipeline(4, reuse_min_bytes)
        merged: list[np.ndarray] = []
        answer = runner.engine.run

        def recorded(inputs: dict[str, np.ndarray], answer=answer, merged=merged) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
            merged.append(inputs["image"])
            return answer(inputs)

        runner.engine.run = recorded  # type: ignore[method-assign]
        runner.run_batch(requests)
        runner.run_batch(requests)
        assert np.shares_memory(merged[0], merged[1]) is shared
        assert merged[1][:, 0, 0, 0].tolist() == [0, 1, 2, 3]
