"""`--http-workers N`: N front-end processes share the HTTP port; this process keeps the models.

HTTP's per-request cost (parsing, JSON, encoding) is most of what one core spends on a small
model, so with N > 1 it moves to N processes on the port's SO_REUSEPORT group, while batches
still form across all of them here and one process owns each device's instances. Each front
end reaches this process over a link (`server.link`) for infer and over this process's own
HTTP app, on a private Unix socket, for every other route.

A front end that dies is started again (its own connections are lost, nobody else's); one that
keeps dying is started again after a growing pause. One that stops answering without dying (a
stopped process, an event loop stuck) would keep taking its share of new connections and hang
them: each front end's event loop writes a heartbeat to its pipe to this process, and one not
heard from for SILENT_S is killed, and so started again. Draining asks each front end to drain,
waits for them, and only then closes the links: the calls they hold still get answers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import sys
import time

import orjson
from pydantic import SecretStr

from server.dataplane import DataPlane
from server.http.v2_infer import infer_v2
from server.link import PlaneLink
from server.server import StartFailed
from server.settings import ServerSettings

logger = logging.getLogger(__name__)

READY_LINE = b"ready\n"  # what a front end writes to its standard output once it accepts
START_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 60.0  # past a front end's own grace period (30 s)
FAST_DEATH_S = 5.0  # a front end that dies sooner after its start waits before the next one
MAX_PAUSE_S = 30.0
HEARTBEAT_S = 1.0  # how often a front end's event loop says it still turns
SILENT_S = 10.0  # a front end not heard from for this long is killed and started again


class HttpWorkers:
    """The front-end processes as one front end of the Server: started with it, drained with it."""

    name = "http front ends"

    def __init__(
        self, settings: ServerSettings, plane: DataPlane, port: int, workers: int, upstream_path: str, link_path: str,
    ) -> None:
        self._settings = settings
        self._plane = plane
        self._port = port
        self._count = workers
        self._upstream_path = upstream_path
        self._link_path = link_path
        self._links: asyncio.AbstractServer | None = None
        self._processes: list[asyncio.subprocess.Process | None] = [None] * workers
        self._watchers: list[asyncio.Task[None]] = []
        self._stopping = False

    def pids(self) -> list[int]:
        return [p.pid for p in self._processes if p is not None and p.returncode is None]

    async def start(self) -> None:
        infer_raw = functools.partial(infer_v2, self._plane)
        self._links = await asyncio.get_running_loop().create_unix_server(
            lambda: PlaneLink(self._plane, infer_raw), self._link_path)
        os.chmod(self._link_path, 0o600)
        started = await asyncio.gather(*(self._spawn(index) for index in range(self._count)), return_exceptions=True)
        for index, outcome in enumerate(started):
            if isinstance(outcome, asyncio.subprocess.Process):
                self._processes[index] = outcome
        failed = next((o for o in started if isinstance(o, BaseException)), None)
        if failed is not None:
            await self.drain()
            raise failed
        self._watchers = [asyncio.create_task(self._watch(index)) for index in range(self._count)]
        logger.info("%d HTTP front-end processes share port %d: %s", self._count, self._port,
                    ", ".join(f"pid {pid}" for pid in self.pids()))

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        """Start front end `index` and wait until it accepts; StartFailed when it does not."""
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "server.http.worker_process",
            str(self._port), self._link_path, self._upstream_path, str(self._count),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(_settings_json(self._settings))
            process.stdin.close()
            try:
                line = await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT_S)
            except TimeoutError:
                line = b""
        except BaseException:  # a stop during the start: the process goes with it
            if process.returncode is None:
                process.kill()
            raise
        if line != READY_LINE:
            if process.returncode is None:
                process.kill()
            status = await process.wait()
            raise StartFailed(f"HTTP front end {index} did not start (exit status {status}); its log says why")
        return process

    async def _watch(self, index: int) -> None:
        """Start front end `index` again whenever it ends, until the server stops."""
        pause = 0.0
        while True:
            process = self._processes[index]
            assert process is not None
            started = time.monotonic()
            status = await self._until_ended(index, process)
            if self._stopping:
                return
            lived = time.monotonic() - started
            pause = 0.0 if lived > FAST_DEATH_S else min(MAX_PAUSE_S, max(0.5, pause * 2))
            logger.warning("HTTP front end %d (pid %d) ended with status %s; its connections are lost; starting "
                           "another%s", index, process.pid, status, f" in {pause:.1f} s" if pause else "")
            await asyncio.sleep(pause)
            while not self._stopping:
                try:
                    self._processes[index] = await self._spawn(index)
                    break
                except StartFailed as exc:
                    pause = min(MAX_PAUSE_S, max(0.5, pause * 2))
                    logger.error("%s; trying again in %.1f s", exc, pause)
                    await asyncio.sleep(pause)
            if self._stopping:
                return

    async def _until_ended(self, index: int, process: asyncio.subprocess.Process) -> int:
        """The front end's exit status, once it ends; killed first if it falls silent."""
        listening = asyncio.create_task(self._listen(index, process))
        listening.add_done_callback(_retrieve)
        try:
            return await process.wait()
        finally:
            listening.cancel()

    async def _listen(self, index: int, process: asyncio.subprocess.Process) -> None:
        """Kill the front end once SILENT_S of windows in a row brought no heartbeat. Counted in
        windows, not timed in one wait: a stall of this process's own loop (or of the whole
        group, frozen and thawed) times out one window at most before the pipe is read again,
        so it never reads as every front end falling silent at once."""
        assert process.stdout is not None
        window = 2 * HEARTBEAT_S
        silent = 0
        while silent * window < SILENT_S:
            try:
                heard = await asyncio.wait_for(process.stdout.read(4096), window)
            except TimeoutError:
                silent += 1
                continue
            if not heard:  # its end of the pipe closed: it is ending
                return
            silent = 0
        if process.returncode is None and not self._stopping:
            logger.error("HTTP front end %d (pid %d) has not been heard from for %.0f s (stopped, or its event "
                         "loop stuck): stopping it", index, process.pid, SILENT_S)
            process.kill()

    async def drain(self) -> None:
        self._stopping = True
        for watcher in self._watchers:
            watcher.cancel()
        running = [p for p in self._processes if p is not None and p.returncode is None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        if running:
            _, late = await asyncio.wait([asyncio.create_task(p.wait()) for p in running], timeout=DRAIN_TIMEOUT_S)
            if late:
                logger.error("%d HTTP front ends did not drain in %.0f s; stopping them", len(late), DRAIN_TIMEOUT_S)
                self.force()
                await asyncio.gather(*(p.wait() for p in running))
        if self._links is not None:
            self._links.close()
            await self._links.wait_closed()

    def force(self) -> None:
        for process in self._processes:
            if process is not None and process.returncode is None:
                process.kill()


def _retrieve(task: asyncio.Task[None]) -> None:
    """Log a listener's failure (none is expected) instead of leaving it unread."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("listening to an HTTP front end failed", exc_info=task.exception())


def _settings_json(settings: ServerSettings) -> bytes:
    """The settings for a front end, secrets included (sent on a pipe, never argv)."""
    values = {name: value.get_secret_value() if isinstance(value, SecretStr) else value
              for name, value in settings}
    return orjson.dumps(values, default=str)
