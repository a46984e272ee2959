"""When a formed batch should go: the dynamic batcher's decision, as a pure function.

Kept apart from the batcher so that every rule is tested deterministically with a given clock.

The rules, in order:
1. full: the batch reached the cap, or the next waiting request cannot join (size or token budget);
2. preferred: the batch reached a preferred size (or the largest one);
3. idle: no batch of this model is running, so waiting would only add latency: at low load a
   request never pays a batching tax;
4. delay: the oldest request of the batch has waited max_queue_delay;
otherwise wait until (4) comes due, or a new arrival or a finished batch changes the picture.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

# Inputs with a pad_value join a batch whatever their variable dims, each padded to the batch's
# longest in every such dim: one request of 15 million values made a batch of 64 rows hold 64
# times that (3.8 GB, other clients stalled 7 s), and two of 5,000 x 1 and 1 x 5,000 values made
# every row 5,000 x 5,000 (5 GB from 40 KB of requests). A request joins a batch only if its
# padded inputs then hold at most MAX_PADDING times the values its requests brought, or at most
# PADDED_FREELY values in all (small batches pad as they like).
MAX_PADDING = 2
PADDED_FREELY = 1 << 20


class DispatchReason(enum.StrEnum):
    FULL = "full"
    PREFERRED = "preferred"
    IDLE = "idle"
    DELAY = "delay"


@dataclass(frozen=True)
class Decision:
    reason: DispatchReason | None  # None: wait
    wake_at_ns: int | None = None  # when waiting: when to decide again at the latest


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_size: int
    preferred: tuple[int, ...] = ()
    max_delay_ns: int = 0
    max_batch_tokens: int | None = None
    batch_buckets: tuple[int, ...] = ()  # the row counts a batch is padded up to (a compiled engine's)

    def rows(self, items: int) -> int:
        """The rows a batch of `items` runs as: the smallest bucket that holds it, else itself."""
        return next((b for b in self.batch_buckets if b >= items), items)

    def fits(self, items: int, longest: int) -> bool:
        """Whether a batch of `items` padded to `longest` tokens stays within both caps."""
        if items > self.max_batch_size:
            return False
        return self.max_batch_tokens is None or items * longest <= self.max_batch_tokens

    def decide(self, items: int, blocked: bool, oldest_arrival_ns: int, now_ns: int, busy: bool) -> Decision:
        """`blocked`: a request is waiting that could not join this batch for lack of room."""
        if items >= self.max_batch_size or blocked:
            return Decision(DispatchReason.FULL)
        if self.preferred and (items in self.preferred or items >= self.preferred[-1]):
            return Decision(DispatchReason.PREFERRED)
        if not busy:
            return Decision(DispatchReason.IDLE)
        due = oldest_arrival_ns + self.max_delay_ns
        if now_ns >= due:
            return Decision(DispatchReason.DELAY if self.max_delay_ns else DispatchReason.IDLE)
        return Decision(None, wake_at_ns=due)


Dims = tuple[tuple[int, ...], ...]  # each padded input's dims past the batch dim, in config order


@dataclass(frozen=True)
class PaddedBatch:
    """What a forming batch's padded inputs hold: each input's longest dims so far, its rows,
    and the values its requests brought."""

    longest: Dims
    rows: int
    brought: int

    @classmethod
    def of(cls, dims: Dims, rows: int) -> PaddedBatch:
        return cls(dims, rows, rows * sum(math.prod(d) for d in dims))

    def joined(self, dims: Dims, rows: int, policy: BatchPolicy) -> PaddedBatch | None:
        """This batch with a request of `rows` rows whose padded inputs have `dims`; None when
        the batch would then pad past the bound (MAX_PADDING, PADDED_FREELY), its rows counted
        up to their batch bucket, whose rows are padded too. (A text model on an engine compiled
        per shape also rounds the first variable dim up to a sequence bucket, not counted here:
        at most its largest bucket.)"""
        longest = tuple(tuple(map(max, mine, theirs)) for mine, theirs in zip(self.longest, dims, strict=True))
        total = self.rows + rows
        brought = self.brought + rows * sum(math.prod(d) for d in dims)
        padded = policy.rows(total) * sum(math.prod(d) for d in longest)
        if padded > PADDED_FREELY and padded > MAX_PADDING * brought:
            return None
        return PaddedBatch(longest, total, brought)
