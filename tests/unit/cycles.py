"""The objects a piece of work leaves in reference cycles: what outlives its work until a
collection walks it, which the server's tuned collector runs rarely."""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType

import server


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


async def server_objects_left_in_cycles(
    work: Callable[[int], Awaitable[None]], warm_up: int, count: int,
) -> Counter[str]:
    """As `left_in_cycles`, but only what belongs to the server found: its objects (by type) and
    the frames of its code (by function). What else the test process runs (the test's own
    clients, asyncio's streams, what earlier tests left behind) may leave garbage of its own."""
    await work(warm_up)
    gc.disable()
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        await work(count)
        gc.collect()
        found: Counter[str] = Counter()
        for thing in gc.garbage:
            if isinstance(thing, FrameType):
                if Path(thing.f_code.co_filename).is_relative_to(_SERVER):
                    found[f"frame of {thing.f_code.co_qualname}"] += 1
            elif type(thing).__module__.startswith("server."):
                found[type(thing).__qualname__] += 1
        return found
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


_SERVER = Path(server.__file__).parent
