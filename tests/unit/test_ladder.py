"""The batch ladder, one for every part that builds, warms or times batch sizes."""

from __future__ import annotations

import pytest

from server.config import ModelConfig
from server.hf_export import sequence_buckets
from server.ladder import batch_ladder, doubling
from server.quantize.bench import batch_sizes

BASE = {"name": "m", "engine": "onnxruntime", "inputs": [{"name": "x", "datatype": "FP32", "dims": [4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [2]}]}


@pytest.mark.parametrize(("first", "last", "expected"), [
    (1, 1, [1]), (1, 2, [1, 2]), (1, 24, [1, 2, 4, 8, 16, 24]), (1, 32, [1, 2, 4, 8, 16, 32]),
    (16, 128, [16, 32, 64, 128]), (16, 100, [16, 32, 64, 100]), (16, 8, [8]),
])
def test_doubling_ends_at_its_last_size(first: int, last: int, expected: list[int]) -> None:
    assert doubling(first, last) == expected


def test_a_model_that_does_not_batch_has_a_ladder_of_one() -> None:
    assert batch_ladder(0) == [1]
    assert ModelConfig.model_validate({**BASE, "max_batch_size": 0}).batch_ladder() == [1]


def test_buckets_are_the_ladder_within_max_batch_size() -> None:
    assert batch_ladder(48, [1, 8, 32, 64]) == [1, 8, 32]


def test_every_part_reads_the_same_ladder() -> None:
    plain = ModelConfig.model_validate({**BASE, "max_batch_size": 24})
    bucketed = ModelConfig.model_validate({**BASE, "max_batch_size": 48, "batch_buckets": [1, 8, 32, 64]})
    assert plain.batch_ladder() == [1, 2, 4, 8, 16, 24]
    assert bucketed.batch_ladder() == [1, 8, 32]
    assert batch_sizes(bucketed) == bucketed.batch_ladder()
    assert batch_sizes(plain) == [1, 8]  # three points of a ladder without buckets, within its max
    assert sequence_buckets(128) == doubling(16, 128)
