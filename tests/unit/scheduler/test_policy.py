"""The dispatch decision, rule by rule, with a given clock."""

from __future__ import annotations

import pytest

from server.scheduler.policy import (
    MAX_PADDING,
    PADDED_FREELY,
    BatchPolicy,
    Decision,
    DispatchReason,
    PaddedBatch,
)

MS = 1_000_000


def decide(policy: BatchPolicy, items: int, *, blocked=False, oldest=0, now=0, busy=True) -> Decision:
    return policy.decide(items, blocked, oldest, now, busy)


def test_full_at_the_cap_even_when_busy_and_young() -> None:
    policy = BatchPolicy(max_batch_size=8, max_delay_ns=10 * MS)
    assert decide(policy, 8).reason is DispatchReason.FULL


def test_blocked_by_room_counts_as_full() -> None:
    policy = BatchPolicy(max_batch_size=8, max_delay_ns=10 * MS)
    assert decide(policy, 3, blocked=True).reason is DispatchReason.FULL


@pytest.mark.parametrize("items", [4, 6])
def test_preferred_sizes_go_at_once(items: int) -> None:
    policy = BatchPolicy(max_batch_size=8, preferred=(4, 6), max_delay_ns=10 * MS)
    assert decide(policy, items).reason is DispatchReason.PREFERRED


def test_past_the_largest_preferred_goes_too() -> None:
    policy = BatchPolicy(max_batch_size=8, preferred=(4,), max_delay_ns=10 * MS)
    assert decide(policy, 5).reason is DispatchReason.PREFERRED


def test_no_batching_tax_when_nothing_runs() -> None:
    policy = BatchPolicy(max_batch_size=8, preferred=(4,), max_delay_ns=10 * MS)
    assert decide(policy, 1, busy=False).reason is DispatchReason.IDLE


def test_busy_waits_for_the_delay_window_then_goes() -> None:
    policy = BatchPolicy(max_batch_size=8, max_delay_ns=10 * MS)
    waiting = decide(policy, 2, oldest=100 * MS, now=104 * MS)
    assert waiting.reason is None and waiting.wake_at_ns == 110 * MS
    assert decide(policy, 2, oldest=100 * MS, now=110 * MS).reason is DispatchReason.DELAY


def test_zero_delay_never_waits() -> None:
    policy = BatchPolicy(max_batch_size=8)
    assert decide(policy, 1, busy=True).reason is DispatchReason.IDLE


@pytest.mark.parametrize(
    ("items", "longest", "fits"),
    [(4, 25, True), (4, 26, False), (9, 1, False), (8, 12, True)],
)
def test_fits_checks_size_and_token_budget(items: int, longest: int, fits: bool) -> None:
    policy = BatchPolicy(max_batch_size=8, max_batch_tokens=100)
    assert policy.fits(items, longest) is fits


def test_without_a_budget_only_size_counts() -> None:
    assert BatchPolicy(max_batch_size=8).fits(8, 10_000)


FREE = BatchPolicy(max_batch_size=64)


def test_a_padded_batch_grows_while_padding_stays_within_the_bound() -> None:
    batch = PaddedBatch.of(((100, 3),), rows=2)
    assert batch.brought == 600
    joined = batch.joined(((120, 2),), rows=1, policy=FREE)
    assert joined == PaddedBatch(((120, 3),), 3, 840)  # each dim to the longest; values as brought


def test_a_request_that_would_pad_past_the_bound_does_not_join() -> None:
    """One long request pads every row beside it to its length: past PADDED_FREELY values, a
    batch may pad to at most MAX_PADDING times what its requests brought."""
    big = PADDED_FREELY  # values in one row of the big request
    alone = PaddedBatch.of(((big,),), rows=1)
    with_one = alone.joined(((4,),), rows=1, policy=FREE)
    assert with_one is not None and with_one.rows == 2  # 2 x big padded, against big + 4 brought
    assert with_one.joined(((4,),), rows=1, policy=FREE) is None  # 3 x big padded: past MAX_PADDING times
    assert PaddedBatch.of(((4,),), rows=63).joined(((big,),), rows=1, policy=FREE) is None  # nor the other way round
    assert MAX_PADDING == 2


def test_inputs_long_in_different_dims_do_not_share_a_batch() -> None:
    """5,000 x 1 and 1 x 5,000 pad to 5,000 x 5,000 each: 25 million values from 10,000."""
    assert PaddedBatch.of(((5000, 1),), rows=1).joined(((1, 5000),), rows=1, policy=FREE) is None
    assert PaddedBatch.of(((50, 1),), rows=1).joined(((1, 50),), rows=1, policy=FREE) is not None  # small: pads freely


def test_every_padded_input_counts() -> None:
    batch = PaddedBatch.of(((10,), (1000,)), rows=3)
    assert batch.joined(((10,), (PADDED_FREELY,)), rows=1, policy=FREE) is None
    assert batch.joined(((20,), (1000,)), rows=1, policy=FREE) == PaddedBatch(((20,), (1000,)), 4, 4050)


def test_rows_padded_up_to_a_batch_bucket_count_as_padding() -> None:
    """A batch of 2 on an engine built for 1 and 64 runs as 64 rows, each padded to the longest."""
    buckets = BatchPolicy(max_batch_size=64, batch_buckets=(1, 64))
    assert (buckets.rows(2), buckets.rows(1), FREE.rows(2)) == (64, 1, 2)
    alone = PaddedBatch.of(((PADDED_FREELY,),), rows=1)
    assert alone.joined(((4,),), rows=1, policy=FREE) is not None
    assert alone.joined(((4,),), rows=1, policy=buckets) is None
