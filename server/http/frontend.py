"""The HTTP front end: uvicorn serving the ASGI app on a socket the caller bound.

The Server owns signals and the data plane's lifecycle, so uvicorn runs with neither: no
lifespan, no signal handlers of its own. Draining is uvicorn's graceful shutdown: the
listener closes, idle keep-alive connections close, requests in flight get up to `grace_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn

from server.asgi.types import ASGIApp
from server.http.door import Door, door_protocol
from server.server import StartFailed

GRACE_S = 30.0


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the Server handles SIGTERM and SIGINT for every front end


class HttpFrontEnd:
    name = "http"

    def __init__(self, app: ASGIApp, listener: socket.socket, log_level: str = "info", grace_s: float = GRACE_S) -> None:
        self._listener = listener
        door = Door.of(app)  # refusals answered before an ASGI task exists
        if listener.family == socket.AF_UNIX:  # the server process's own app, behind its front ends
            place: dict[str, object] = {"uds": listener.getsockname()}
        else:
            host, port = listener.getsockname()[:2]
            place = {"host": host, "port": port}  # for uvicorn's "running on" line; it serves `listener`
        self._uvicorn = _Uvicorn(uvicorn.Config(
            app,
            **place,  # type: ignore[arg-type]
            log_level=log_level,
            http=door_protocol(door) if door is not None else "httptools",
            lifespan="off",
            proxy_headers=False,  # X-Forwarded-*: an ASGI layer per request for the access log's address alone
            access_log=False,  # the server's own access log (--access-log) covers infer calls
            timeout_graceful_shutdown=int(grace_s),
        ))
        self._serving: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._serving = asyncio.create_task(self._uvicorn.serve(sockets=[self._listener]))
        while not self._uvicorn.started:
            if self._serving.done():
                error = self._serving.exception()
                raise StartFailed(f"HTTP did not start: {error or 'uvicorn stopped during its startup'}")
            await asyncio.sleep(0.01)

    async def drain(self) -> None:
        if self._serving is None:
            return
        self._uvicorn.should_exit = True
        await self._serving

    def force(self) -> None:
        self._uvicorn.force_exit = True
