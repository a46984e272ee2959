"""`bench engine --in-flight N`: the batches a batcher could form at best from N requests at a
time. Checks the batches, not the engine's speed."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from loadtest import bench, mlp
from loadtest.engine import in_flight_batches, sweep


def test_each_group_of_requests_in_flight_is_sorted_by_length_and_cut_into_batches() -> None:
    texts = ["ccc", "a", "bb", "dddd", "eeeee"]
    batches = in_flight_batches(texts, 4, 2, len)
    assert batches[:2] == [["a", "bb"], ["ccc", "dddd"]], "the first four sent, shortest first"
    assert batches[2:4] == [["a", "bb"], ["ccc", "eeeee"]], "the next four sent (eeeee, then the cycle again)"
    assert all(len(batch) == 2 for batch in batches) and len(batches) == 2 * len(texts)
    sent = Counter(text for batch in batches for text in batch)
    assert sent == Counter(texts[i % len(texts)] for i in range(4 * len(texts))), "every text as often as sent"
    for first in range(len(texts)):
        group = batches[2 * first] + batches[2 * first + 1]
        assert [len(t) for t in group] == sorted(len(t) for t in group)


def test_a_batch_size_that_does_not_divide_the_requests_in_flight_is_refused() -> None:
    with pytest.raises(ValueError, match="not a multiple of batch size 3"):
        in_flight_batches(["a", "b"], 4, 3, len)


def test_in_flight_is_for_texts_only(tmp_path: Path) -> None:
    mlp.write_mlp_model(tmp_path)
    with pytest.raises(ValueError, match="minilm only"):
        sweep("mlp", tmp_path, [1], 0.1, 1, in_flight=4)
    args = bench.build_parser().parse_args(["engine", "--model", "minilm", "--in-flight", "64", "--out", str(tmp_path)])
    assert args.in_flight == 64
    with pytest.raises(SystemExit):  # two ways of grouping texts: one at a time
        bench.build_parser().parse_args(["engine", "--model", "minilm", "--in-flight", "64", "--length-sorted",
                                         "--out", str(tmp_path)])
