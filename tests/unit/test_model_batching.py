"""From config.yaml's dynamic_batching to what the batcher is given: the policy (cap, preferred
sizes, delay, token budget) and the queue settings (levels, bound, ordering, merging)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from server.config import ModelConfig
from server.model import ModelVersion
from server.scheduler.batcher import QueueSettings
from server.scheduler.policy import BatchPolicy


def version(cap: int, **fields: Any) -> ModelVersion:
    """A model version as loading leaves it, with the batch cap the warm-up chose."""
    config = ModelConfig.model_validate({
        "name": "m", "engine": "onnxruntime", "max_batch_size": 64,
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [4]}],
        **fields,
    })
    model = ModelVersion(config, 1, Path("unused"))
    model.stats.batch_cap = cap
    return model


def test_every_dynamic_batching_field_reaches_the_batcher() -> None:
    model = version(64, dynamic_batching={
        "max_queue_delay_microseconds": 1500,
        "preferred_batch_size": [16, 4],
        "priority_levels": 3,
        "default_queue_policy": {"max_queue_size": 5},
        "preserve_ordering": True,
    })
    assert model._policy() == BatchPolicy(max_batch_size=64, preferred=(4, 16), max_delay_ns=1_500_000)
    assert model._queue_settings() == QueueSettings(
        levels=3, max_queue_size=5, merge=True, preserve_ordering=True, by_length=False,  # answers wait for the oldest
    )


def test_preferred_sizes_above_the_measured_cap_are_dropped() -> None:
    """A preferred size the cap forbids would never be reached: the batch would wait the whole
    delay for it every time."""
    model = version(8, dynamic_batching={"preferred_batch_size": [32, 2, 8, 4, 64], "max_queue_delay_microseconds": 100})
    policy = model._policy()
    assert policy.max_batch_size == 8 and policy.preferred == (2, 4, 8)


def test_the_defaults_of_dynamic_batching() -> None:
    model = version(16, dynamic_batching={})
    assert model._policy() == BatchPolicy(max_batch_size=16)
    assert model._queue_settings() == QueueSettings(levels=1, max_queue_size=0, merge=True, preserve_ordering=False)


@pytest.mark.parametrize("levels, expected", [(0, 1), (1, 1), (2, 2), (5, 5)])
def test_priority_levels_become_queues(levels: int, expected: int) -> None:
    assert version(4, dynamic_batching={"priority_levels": levels})._queue_settings().levels == expected


def test_without_dynamic_batching_requests_are_not_merged() -> None:
    model = version(32)
    assert model._queue_settings() == QueueSettings(merge=False)
    assert model._policy() == BatchPolicy(max_batch_size=32)


def test_the_token_budget_of_a_text_model_reaches_the_policy() -> None:
    model = version(
        8,
        inputs=[{"name": "text", "datatype": "BYTES", "dims": [1]}],
        preprocess={"tokenize": {"input": "text"}},
        dynamic_batching={"max_batch_tokens": 4096},
    )
    assert model._policy().max_batch_tokens == 4096


def test_the_batch_buckets_reach_the_policy_for_the_padding_bound() -> None:
    assert version(64, dynamic_batching={}, batch_buckets=[1, 8, 64])._policy().batch_buckets == (1, 8, 64)
    assert version(64, dynamic_batching={})._policy().batch_buckets == ()


@pytest.mark.parametrize("cap", [0, 1])
def test_an_unbatched_model_runs_one_request_at_a_time(cap: int) -> None:
    model = version(cap, max_batch_size=0)
    assert model._policy().max_batch_size == 1
    assert not model._queue_settings().merge
