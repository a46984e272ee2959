"""One admitted inference request, as the scheduler sees it."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import numpy as np

from server.errors import without_tracebacks


@dataclass
class RequestRecord:
    """What an access log line (and a front end's answer) says about one request; filled in as
    it goes through."""

    request_id: str | None = None
    model_version: int | None = None
    queue_ns: int = 0
    compute_ns: int = 0
    tokens: int = 0  # a text model's tokens as the model reads them (after truncation), counted at admission


class RequestState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@dataclass(eq=False)
class InferenceRequest:
    """Engine-ready tensors (batch dim first when the model batches) and the future through
    which exactly one result or error comes back.

    `shape_key` says which requests may share a batch; `longest` is a text request's sequence
    bucket (0 for other models), for the token budget: what it pads to on a compiled engine, at
    least what it pads to on any other (a batch's longest text, within the bucket); `length` its
    longest text in tokens (0 for other models), which the batcher groups by; `padded` the dims
    past the batch dim of each input with a pad_value (none for other models), for the padding
    bound (policy.py).
    """

    feed: dict[str, np.ndarray]
    batch_size: int
    future: asyncio.Future[dict[str, np.ndarray]]
    shape_key: Hashable = ()
    longest: int = 0
    length: int = 0
    padded: tuple[tuple[int, ...], ...] = ()
    priority: int = 1
    deadline_ns: int | None = None
    arrival_ns: int = field(default_factory=time.perf_counter_ns)  # queued: the queue's clock starts
    received_ns: int = 0  # the model took it in, before admission: the request's clock starts (0: at arrival)
    state: RequestState = RequestState.QUEUED
    sequence: int = 0
    expiry: asyncio.TimerHandle | None = None
    record: RequestRecord | None = None
    bounded: bool = True  # False: a later chunk of a request the queue took (its place was counted)
    # What the queue runs when the future completes from outside (cancelled by its caller).
    # Taken off when the request is answered: it would only run, a loop callback later, to find
    # the request done.
    watch: Callable[[asyncio.Future[dict[str, np.ndarray]]], None] | None = None

    def __post_init__(self) -> None:
        self.received_ns = self.received_ns or self.arrival_ns

    def resolve(self, outputs: dict[str, np.ndarray]) -> None:
        self.state = RequestState.DONE
        self.unwatch()
        if not self.future.done():
            self.future.set_result(outputs)

    def fail(self, error: BaseException) -> None:
        """The request's error, its tracebacks dropped (`without_tracebacks`): the server logged
        what it needed of them where it caught it, and a client gets the message."""
        self.state = RequestState.DONE
        self.unwatch()
        if not self.future.done():
            self.future.set_exception(without_tracebacks(error))

    def unwatch(self) -> None:
        """Take `watch` off the future, and let go of it: it holds this request (no cycle is
        left for the garbage collector)."""
        if self.watch is not None:
            self.future.remove_done_callback(self.watch)
            self.watch = None
