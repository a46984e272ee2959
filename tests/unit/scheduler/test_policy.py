"""The dispatch decision, rule by rule, with a given clock."""

from __future__ import annotations

import pytest

from server.scheduler.policy import BatchPolicy, Decision, DispatchReason

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
