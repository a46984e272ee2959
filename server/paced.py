"""Renders that cost the event loop milliseconds (a /metrics scrape), shared and paced.

Such a render runs on the event loop, so clients asking for it back to back would take the loop
from everyone else: eight connections scraping /metrics as fast as they could cut other
clients' rate by almost two thirds. Here callers waiting at once share one render, which
always begins after each of them asked (no caller gets figures older than its call), and
renders are spaced so they take at most `loop_share` of the loop's time. A lone caller, such
as Prometheus every few seconds, is answered at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

LOOP_SHARE = 0.1  # of the event loop's time, at most, spent on one paced render


class PacedRender(Generic[T]):
    """`render`, run on the event loop for every caller waiting, at most `loop_share` of its time."""

    def __init__(self, render: Callable[[], T], loop_share: float = LOOP_SHARE) -> None:
        if not 0 < loop_share <= 1:
            raise ValueError(f"loop_share must be in (0, 1], not {loop_share}")
        self._render = render
        self._rest_per_busy = 1 / loop_share - 1  # seconds idle per second of rendering
        self._next: asyncio.Future[T] | None = None  # the render not begun yet, shared by its callers
        self._free_at = 0.0  # perf_counter time before which the next render waits

    async def __call__(self) -> T:
        if self._next is None:
            delay = self._free_at - time.perf_counter()
            if delay <= 0:
                return self._timed()  # free: rendered now, for this caller alone
            loop = asyncio.get_running_loop()
            self._next = loop.create_future()
            loop.call_later(delay, self._run)
        # shielded: a caller that gives up does not cancel the render the others wait for
        return await asyncio.shield(self._next)

    def _run(self) -> None:
        shared, self._next = self._next, None  # callers from now on wait for the next render
        assert shared is not None
        try:
            result = self._timed()
        except Exception as exc:  # noqa: BLE001 - handed to every caller waiting, as a lone caller gets it
            shared.set_exception(exc)
            shared.exception()  # retrieved: with every caller gone, nothing is logged as lost
        else:
            shared.set_result(result)

    def _timed(self) -> T:
        began = time.perf_counter()
        try:
            return self._render()
        finally:
            ended = time.perf_counter()
            self._free_at = ended + (ended - began) * self._rest_per_busy
