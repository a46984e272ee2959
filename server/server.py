"""One serving process: the data plane and its front ends, started and stopped together.

The Server owns the lifecycle every front end shares, so a front end is only an adapter: it
binds, serves calls through the data plane, and drains its own connections when told.

Start: the models begin loading (the process is live at once, ready when they are), then each
front end starts accepting. Stop (SIGTERM or SIGINT): readiness turns false and new inference is
refused at once on every front end, each drains what it holds in flight within its grace
period, then the models finish their queued work and unload. A second SIGINT stops waiting.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence
from typing import Protocol

from server.dataplane import DataPlane

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class FrontEnd(Protocol):
    """A protocol adapter over the data plane (HTTP today)."""

    name: str

    async def start(self) -> None:
        """Accept calls once this returns; raise `StartFailed` when it cannot."""

    async def drain(self) -> None:
        """Stop accepting, answer what is in flight (within the front end's grace period), return."""

    def force(self) -> None:
        """Stop waiting for calls in flight: a second interrupt."""


class StartFailed(Exception):
    """A front end could not start serving."""


class Server:
    def __init__(self, plane: DataPlane, frontends: Sequence[FrontEnd], models: list[str] | None = None) -> None:
        self.plane = plane
        self._frontends = list(frontends)
        self._models = models
        self._stop: asyncio.Event | None = None

    async def run(self) -> None:
        """Serve until a stop signal (or `request_stop`), then drain and unload. Raises
        `StartFailed` when a front end cannot start; the others are drained first."""
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, self.request_stop)
        started: list[FrontEnd] = []
        try:
            self.plane.accepting = False  # one front end may answer readiness before the others accept
            self.plane.start(self._models)
            for frontend in self._frontends:
                await frontend.start()
                started.append(frontend)
            self.plane.accepting = True
            await self._stop.wait()
        finally:
            self.plane.begin_stop()
            drained = await asyncio.gather(*(frontend.drain() for frontend in started), return_exceptions=True)
            for frontend, outcome in zip(started, drained):
                if isinstance(outcome, BaseException):  # the others drained; the models still unload
                    logger.error("the %s front end did not drain cleanly", frontend.name, exc_info=outcome)
            await self.plane.stop()
            for signum in STOP_SIGNALS:
                loop.remove_signal_handler(signum)
        logger.info("stopped: the front ends drained, the models unloaded")

    def request_stop(self) -> None:
        """The first call begins a graceful stop; a later one stops waiting for calls in flight."""
        if self._stop is None:
            return
        if self._stop.is_set():
            logger.warning("stopping now: calls still in flight are dropped")
            for frontend in self._frontends:
                frontend.force()
            return
        logger.info("stopping: no new calls; what is in flight finishes, then the models unload")
        self.plane.begin_stop()
        self._stop.set()
