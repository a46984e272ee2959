"""The shared-memory arena between a front end and the server process: slots handed out once,
reused by size, bounds-checked for the peer, and no file left behind."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from server.arena import MIN_SLOT, Arena


@pytest.fixture
def arena() -> Iterator[Arena]:
    made = Arena.create(8 * MIN_SLOT, "batchline-test")
    yield made
    made.forget_file()


def test_slots_are_handed_out_once_and_reused_by_size(arena: Arena) -> None:
    first = arena.allocate(10)
    second = arena.allocate(MIN_SLOT + 1)  # two minimum slots' worth: the next power of two
    assert first == 0 and second == MIN_SLOT
    assert arena.allocate(3 * MIN_SLOT) == 3 * MIN_SLOT  # 4 slots' worth
    assert arena.allocate(MIN_SLOT) == 7 * MIN_SLOT
    assert arena.allocate(1) is None  # full: the caller sends the tensor another way
    arena.free(first)
    arena.free(first)  # a second free is ignored: the slot must not go to two tensors
    assert arena.allocate(100) == first
    assert arena.allocate(100) is None
    arena.free(second)
    assert arena.allocate(2 * MIN_SLOT) == second


def test_a_full_arena_uncarves_the_free_slots_above_those_in_use(arena: Arena) -> None:
    """One tensor that took the whole arena, freed, must not leave it a single slot of that size
    (every smaller tensor would go the other way from then on)."""
    arena.free(arena.allocate(5 * MIN_SLOT))  # a slot of 8: the whole arena
    low = arena.allocate(MIN_SLOT)
    assert low == 0
    arena.free(arena.allocate(2 * MIN_SLOT))  # carved above it, freed
    assert arena.allocate(5 * MIN_SLOT) is None  # 7 free slots' worth above the one in use: not 8
    assert arena.allocate(4 * MIN_SLOT) == MIN_SLOT  # carved again from just above the one in use
    arena.free(low)
    assert arena.allocate(MIN_SLOT) == 0


def test_the_peer_sees_what_the_owner_writes_and_no_file_is_left(arena: Arena) -> None:
    peer = Arena.attach(arena.path)
    peer.forget_file()  # the peer removes the file once it has mapped it
    assert not os.path.exists(arena.path)
    offset = arena.allocate(16)
    assert offset is not None
    np.frombuffer(arena.slot(offset, 16), np.float32)[:] = [1, 2, 3, 4]
    assert np.frombuffer(peer.slot(offset, 16), np.float32).tolist() == [1, 2, 3, 4]


def test_a_slot_past_the_end_is_refused(arena: Arena) -> None:
    with pytest.raises(ValueError, match="run past"):
        arena.slot(arena.size - 8, 16)
    with pytest.raises(ValueError, match="run past"):
        arena.slot(-1, 4)


def test_only_shared_memory_files_are_attached(tmp_path: Path) -> None:
    outside = tmp_path / "arena"
    outside.write_bytes(b"\0" * 64)
    with pytest.raises(OSError, match="not a shared-memory file"):
        Arena.attach(str(outside))


def test_an_arena_too_big_for_dev_shm_fails_at_creation() -> None:
    free = os.statvfs("/dev/shm")
    with pytest.raises(OSError):
        Arena.create(free.f_bavail * free.f_frsize + (1 << 30), "batchline-test")
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"batchline-test-{os.getpid()}-")]
