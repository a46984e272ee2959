"""The serving process's collector policy: what loading leaves is frozen out of collections,
an unloaded model's cycles are still freed, and every pause is counted by generation."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from server.heap import YOUNG_THRESHOLD, HeapPolicy


@pytest.fixture
def policy() -> Iterator[HeapPolicy]:
    threshold = gc.get_threshold()
    heap = HeapPolicy().install()
    try:
        yield heap
    finally:
        heap.uninstall()
        gc.set_threshold(*threshold)
        gc.unfreeze()


class Cycle:
    """An object only the cyclic collector can free, like a torch module graph."""

    def __init__(self) -> None:
        self.me = self


def test_install_raises_the_young_threshold_only(policy: HeapPolicy) -> None:
    _, middle, old = gc.get_threshold()
    policy.install()  # twice: still one callback
    assert gc.get_threshold() == (YOUNG_THRESHOLD, middle, old)
    assert gc.callbacks.count(policy._on_collection) == 1


def test_settle_freezes_survivors_and_frees_what_was_frozen_before(policy: HeapPolicy) -> None:
    model = Cycle()
    policy.settle()
    assert gc.get_freeze_count() > 0
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is not None, "a frozen cycle is never collected, which is why settle unfreezes first"
    policy.settle()  # what an unload does next
    assert gone() is None


def test_pauses_are_counted_by_generation(policy: HeapPolicy) -> None:
    before = [policy.pauses[g].count for g in (0, 1, 2)]
    gc.collect(0)
    gc.collect(2)
    after = [policy.pauses[g].count for g in (0, 1, 2)]
    assert after[0] == before[0] + 1 and after[2] == before[2] + 1 and after[1] == before[1]
    assert policy.pauses[2].sum > 0


def test_uninstalled_policy_counts_nothing(policy: HeapPolicy) -> None:
    policy.uninstall()
    before = policy.pauses[0].count
    gc.collect(0)
    assert policy.pauses[0].count == before
