"""The server's own cost per request, without sockets: the real app (data plane, batcher,
engine) driven in-process over ASGI by concurrent clients, and the CPU time it took per request,
all threads together. What the server's Python path costs, apart from uvicorn and the kernel;
its scope carries the disconnect callbacks the server's HTTP protocol provides.

    taskset -c 0 python -m loadtest.inprocess --model-repository /tmp/mlprepo --model mlp --clients 64
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from loadtest import payloads
from server.asgi.disconnect import DISCONNECT_EXTENSION


async def measure(repository: Path, model: str, clients: int, seconds: float) -> dict[str, float]:
    """req/s and CPU microseconds per request, over `seconds` after a second of warm-up."""
    from prometheus_client import CollectorRegistry

    from server.dataplane import DataPlane
    from server.http.app import create_app
    from server.repository import ModelRepository

    plane = DataPlane(ModelRepository(repository, 1))  # one engine thread, as the pinned server runs
    app = create_app(plane, metrics=CollectorRegistry())
    plane.start([model])
    try:
        while not plane.server_ready():
            if plane.repository.versions(model) and not plane.model_ready(model, None):
                raise SystemExit(f"inprocess: {model} did not load: {plane.repository.versions(model)[0].reason}")
            await asyncio.sleep(0.05)
        bodies = [r.body for r in payloads.build_requests(model, 1, False, 32, repository)]
        served = 0
        stop = False

        async def client(first: int) -> None:
            nonlocal served
            index = first
            while not stop:
                body = bodies[index % len(bodies)]
                index += 1
                await _one(app, model, body)
                served += 1

        tasks = [asyncio.create_task(client(i)) for i in range(clients)]
        await asyncio.sleep(1.0)
        count, cpu, wall = served, time.process_time(), time.perf_counter()
        await asyncio.sleep(seconds)
        count, cpu, wall = served - count, time.process_time() - cpu, time.perf_counter() - wall
        stop = True
        await asyncio.gather(*tasks)
    finally:
        await plane.stop()
    return {"req_s": count / wall, "cpu_us_per_request": cpu / max(count, 1) * 1e6, "requests": count}


async def _one(app: Any, model: str, body: bytes) -> None:
    scope = {"type": "http", "method": "POST", "path": f"/v2/models/{model}/infer", "query_string": b"",
             "headers": [(b"host", b"local"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "http_version": "1.1", "scheme": "http", "root_path": "",
             "extensions": {DISCONNECT_EXTENSION: []}}
    answered = asyncio.Event()
    sent = False
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    answered.set()
    if status != 200:
        raise SystemExit(f"inprocess: the server answered {status}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.inprocess", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", type=Path, default=payloads.MODELS)
    parser.add_argument("--model", choices=sorted(payloads.SPECS), default="mlp")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args(argv)
    import uvloop

    result = uvloop.run(measure(args.model_repository, args.model, args.clients, args.seconds))
    print(f"{result['req_s']:,.0f} req/s, {result['cpu_us_per_request']:.1f} us CPU per request (all threads), "
          f"{args.clients} clients, {result['requests']:,} requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
