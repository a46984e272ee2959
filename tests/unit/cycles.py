"""The objects a piece of work leaves in reference cycles: what outlives its work until a
collection walks it, which the server's tuned collector runs rarely."""

from __future__ import annotations

import gc
from collections.abc import Awaitable, Callable


async def left_in_cycles(work: Callable[[int], Awaitable[None]], warm_up: int, count: int) -> int:
    """`work(warm_up)` first (what a first run builds once, caches and pools, is built then),
    then `work(count)` with the collector off: the objects a collection then finds."""
    await work(warm_up)
    gc.disable()
    try:
        gc.collect()
        await work(count)
        return gc.collect()
    finally:
        gc.enable()
