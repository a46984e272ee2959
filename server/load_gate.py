"""Models load side by side; a batch profile times alone.

A model's batch cap comes from timing its batch ladder at load (warm-up `profile`). Timed while
another model builds its engine or warms up on the same cores, every size runs slower by an amount
that changes from run to run, and the cap follows the neighbour, not the model: minilm's, timed
beside digits' load on one core, came out anywhere from 2 to 64 between starts of one server. So
a profile waits until nothing is being built and no other profile runs, and a build waits
while a profile runs (seconds). The profile's wait is bounded: an engine build that hangs (or a
TensorRT build that takes many minutes) must not keep every other model from serving. A
replacement for an instance stuck while serving never waits: its model is short of an instance.

Loads run on threads of their own (`run_load`), not the event loop's default executor: a load
holds its thread while it waits here or builds for minutes, and requests offload their parsing
and large admissions to the default executor, which a few loads could otherwise fill. What never
waits here (closing a version's instances at unload or reload, a stuck instance's replacement)
runs on threads of its own again (`run_now`): behind eight versions waiting for each other's
profiles, an unrelated model's unload waited 14 s for a load thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar, TypeVarTuple

logger = logging.getLogger(__name__)

WAIT_S = 120.0
T = TypeVar("T")
Args = TypeVarTuple("Args")


class LoadGate:
    def __init__(self, wait_s: float = WAIT_S) -> None:
        self._changed = threading.Condition()
        self._building = 0
        self._timing = 0  # profiles running: one, or more only after a wait ran out
        self._wait_s = wait_s

    @contextlib.contextmanager
    def building(self, label: str, wait: bool = True) -> Iterator[None]:
        """An instance built and warmed up, or an artifact built at load: beside other builds,
        and (`wait`) not while a profile runs; a profile waits for it either way."""
        with self._changed:
            if wait and not self._changed.wait_for(lambda: not self._timing, self._wait_s):
                logger.warning("%s waited %.0f s for another model's batch profile and is built beside it",
                               label, self._wait_s)
            self._building += 1
        try:
            yield
        finally:
            with self._changed:
                self._building -= 1
                self._changed.notify_all()

    @contextlib.contextmanager
    def alone(self, label: str) -> Iterator[None]:
        """A batch profile: once no instance is being built and no other profile runs."""
        with self._changed:
            quiet = self._changed.wait_for(lambda: not self._timing and not self._building, self._wait_s)
            if not quiet:
                logger.warning("model %s waited %.0f s for other models to load and times its batch ladder beside "
                               "them: its batch cap may be off (warmup.batch_cap fixes it)", label, self._wait_s)
            self._timing += 1
        try:
            yield
        finally:
            with self._changed:
                self._timing -= 1
                self._changed.notify_all()


LOADS = LoadGate()  # one per process: the models of a process share its cores
_LOAD_THREADS = concurrent.futures.ThreadPoolExecutor(  # as many as the default executor has
    max_workers=min(32, (os.cpu_count() or 1) + 4), thread_name_prefix="batchline-load")


# Made as needed: a replacement's warm-up on a wedged device may hold one for good, so there are
# enough that closes still find one.
_NOW_THREADS = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="batchline-close")


async def run_load(call: Callable[[*Args], T], *args: *Args) -> T:
    """`call(*args)` on a load thread: a model's build, warm-up, profile or artifact build."""
    return await asyncio.get_running_loop().run_in_executor(_LOAD_THREADS, call, *args)


async def run_now(call: Callable[[*Args], T], *args: *Args) -> T:
    """`call(*args)` on a thread no load waiting its turn holds: closing instances, replacing a
    stuck one (which builds beside anything, `building(wait=False)`)."""
    return await asyncio.get_running_loop().run_in_executor(_NOW_THREADS, call, *args)
