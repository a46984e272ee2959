"""One HTTP front-end process of `batchline serve --http-workers N` (started by the server
process, never by hand): it accepts on the shared port, parses and encodes infer calls, sends
each to the server process over its link and every other route to the server process's own app.

It drains its connections on SIGTERM and when its link closes: a front end outlives its server
process by no more than its drain. A second SIGTERM changes nothing (a stopper that signals the
whole group, then the server process, sends two; the server process ends a front end that
drains too long), and SIGINT is ignored: Ctrl-C in a terminal reaches every process of the
group, and the server process then asks each front end to drain, once. Its garbage collector is
tuned as the server process's is (`server.heap`): with the default thresholds, collections were
most of a front end's tail (p99 at 64 clients 31-40 ms, 11-17 ms with them).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import signal
import sys

import orjson

from server.access_log import AccessLog
from server.errors import Unavailable
from server.heap import HeapPolicy
from server.http.auth import AccessGate, AccessPolicy
from server.http.extensions import EXTENSIONS
from server.http.forward import ForwardApp
from server.http.frontend import HttpFrontEnd
from server.http.infer import FastInferApp, InferEndpoint
from server.http.shared_port import reuse_port_socket
from server.http.v2_infer import infer_v2_remote, start_inline_remote
from server.http.workers import HEARTBEAT_S, READY_LINE
from server.inflight import InFlight
from server.link import LinkClient
from server.settings import ServerSettings


def front_end_app(settings: ServerSettings, link: LinkClient, forward: ForwardApp, workers: int) -> AccessGate:
    """The app of one front end: infer answered over the link, the rest forwarded. Each front
    end takes its share of the server's bounds on requests in flight."""
    flight = InFlight(math.ceil(settings.max_in_flight / workers), math.ceil(settings.max_in_flight_bytes / workers))
    endpoint = InferEndpoint(None, settings.max_body_bytes, AccessLog(settings.access_log), flight,
                             answer=functools.partial(infer_v2_remote, link),
                             start_inline=functools.partial(start_inline_remote, link))
    routes = FastInferApp(forward, endpoint, own_bodies=tuple(f"{extension.prefix}/" for extension in EXTENSIONS))
    return AccessGate(routes, AccessPolicy.from_settings(settings), EXTENSIONS)


async def serve(settings: ServerSettings, port: int, link_path: str, upstream_path: str, workers: int,
                heap: HeapPolicy) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        link = await LinkClient.connect(link_path, stop.set)
    except (OSError, Unavailable) as exc:
        raise SystemExit(f"this HTTP front end cannot reach its server process: {exc}") from None
    forward = ForwardApp(upstream_path)
    frontend = HttpFrontEnd(front_end_app(settings, link, forward, workers),
                            reuse_port_socket(settings.host, port, listen=True), settings.log_level)
    await frontend.start()
    heap.settle()  # what starting left (imports, the app), frozen out of later collections
    sys.stdout.buffer.write(READY_LINE)
    sys.stdout.flush()
    pipe = os.dup(sys.stdout.fileno())  # kept for the heartbeat alone
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # what else goes to standard output goes to the log
    os.set_blocking(pipe, False)
    beating = asyncio.create_task(_beat(pipe))
    await stop.wait()
    await frontend.drain()
    link.close()
    await forward.close()
    beating.cancel()
    os.close(pipe)


async def _beat(pipe: int) -> None:
    """Tell the server process, from this event loop, that it still turns (it kills a front end
    it has not heard from for a while, server/http/workers.py)."""
    while True:
        try:
            os.write(pipe, b".")
        except BlockingIOError:  # the server process reads nothing just now (stopped itself): a beat is skipped
            pass
        except OSError:  # it is gone: the link's closing stops this process
            return
        await asyncio.sleep(HEARTBEAT_S)


def main() -> int:
    """Arguments: port, link socket, the server process's HTTP socket, the number of front
    ends; the settings come as JSON on standard input (never argv: it shows in ps)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    port, link_path, upstream_path, workers = sys.argv[1:5]
    settings = ServerSettings(**orjson.loads(sys.stdin.buffer.read()))
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per forwarded call otherwise
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(settings, int(port), link_path, upstream_path, int(workers), HeapPolicy().install()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
