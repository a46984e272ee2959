"""The batch ladder: the batch sizes worth building, warming and timing, said once.

A model's ladder is its batch buckets within max_batch_size when it declares them (a compiled
engine runs only those shapes), else powers of two up to max_batch_size, then max_batch_size
itself; 1 alone when the model does not batch. Sequence buckets for text follow the same
doubling from 16 tokens.
"""

from __future__ import annotations

from collections.abc import Sequence


def doubling(first: int, last: int) -> list[int]:
    """first, 2*first, 4*first, ... while below `last`, then `last`: few shapes, little padding."""
    sizes, size = [], first
    while size < last:
        sizes.append(size)
        size *= 2
    return [*sizes, last]


def batch_ladder(max_batch_size: int, buckets: Sequence[int] | None = None) -> list[int]:
    if max_batch_size <= 0:
        return [1]
    if buckets:
        return [b for b in buckets if b <= max_batch_size]
    return doubling(1, max_batch_size)
