"""A fake KServe v2 server of known service time: the yardstick the load tools are tested on.

One FIFO queue, one "instance": each infer request is served alone for `service_s` seconds
(+ `per_item_s` per batch row), in arrival order. With Poisson arrivals that is an M/D/1 queue,
whose latencies `simulate` computes exactly (Lindley's recursion), so a capacity search run
against it has a known answer. Service is timed on a virtual clock (start = max(arrival, previous
end)), so the event loop's sleep jitter delays replies but never accumulates into the queue.

It speaks what the load tools use: POST /v2/models/{m}/infer (JSON or Triton binary tensors;
replies of the right output name and shape, zeros), GET /v2/models/{m}/stats (statistics
extension: queue, compute_infer, success), health and metadata, and, unless --no-metrics,
GET /metrics with Batchline's names (queue depth, queue/compute/request histograms' sum and
count, instance busy seconds). Any model name is served; the output follows the input's name
(`image` -> `probabilities` [n, 10], `text` -> `embedding` [n, 384], else `output` [n, 1]).

    python -m loadtest.fakeserver --service-ms 5 --port 8100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest import localserver
from loadtest.payloads import HEADER_LENGTH

OUTPUTS: dict[str, tuple[str, int]] = {"image": ("probabilities", 10), "text": ("embedding", 384)}
READY_LINE = "fakeserver listening on "


def simulate(arrivals_s: Sequence[float], service_s: float) -> list[float]:
    """Sojourn times (wait + service) of a FIFO single server with a fixed service time."""
    free_at = 0.0
    sojourns = []
    for at in arrivals_s:
        free_at = max(at, free_at) + service_s
        sojourns.append(free_at - at)
    return sojourns


@dataclass
class _ModelStats:
    success: int = 0
    success_ns: int = 0
    queue_ns: int = 0
    compute_ns: int = 0
    items: int = 0
    busy_s: float = 0.0

    def as_dict(self, name: str) -> dict[str, Any]:
        def duration(count: int, ns: int) -> dict[str, int]:
            return {"count": count, "ns": ns}

        zero = duration(0, 0)
        return {
            "name": name, "version": "1", "last_inference": 0,
            "inference_count": self.items, "execution_count": self.success,
            "inference_stats": {
                "success": duration(self.success, self.success_ns), "fail": zero,
                "queue": duration(self.success, self.queue_ns),
                "compute_input": duration(self.success, 0),
                "compute_infer": duration(self.success, self.compute_ns),
                "compute_output": duration(self.success, 0), "cache_hit": zero, "cache_miss": zero,
            },
            "batch_stats": [],
        }


@dataclass
class _Job:
    model: str
    items: int
    arrival: float
    reader: asyncio.StreamReader
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class FakeServer:
    """The queue, the one instance and the statistics; `handle` is the connection handler."""

    def __init__(self, service_s: float, per_item_s: float = 0.0, metrics: bool = True) -> None:
        self.service_s, self.per_item_s, self.metrics = service_s, per_item_s, metrics
        self.queue: asyncio.Queue[_Job] = asyncio.Queue()
        self.stats: dict[str, _ModelStats] = {}

    async def serve_forever(self) -> None:
        """The instance: one job at a time, in arrival order, on the virtual clock."""
        loop = asyncio.get_running_loop()
        free_at = 0.0
        while True:
            job = await self.queue.get()
            if job.reader.at_eof():  # the client hung up while queued: never run it
                job.done.cancel()
                continue
            start = max(job.arrival, free_at)
            service = self.service_s + self.per_item_s * job.items
            free_at = start + service
            delay = free_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            stats = self.stats.setdefault(job.model, _ModelStats())
            stats.success += 1
            stats.items += job.items
            stats.queue_ns += int((start - job.arrival) * 1e9)
            stats.compute_ns += int(service * 1e9)
            stats.success_ns += int((free_at - job.arrival) * 1e9)
            stats.busy_s += service
            if not job.done.done():
                job.done.set_result(None)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                request_line, *header_lines = head.decode("latin-1").split("\r\n")
                method, path, _ = request_line.split(" ", 2)
                headers = {}
                for line in header_lines:
                    if ":" in line:
                        key, value = line.split(":", 1)
                        headers[key.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                arrival = asyncio.get_running_loop().time()
                status, reply_headers, reply = await self.route(method, path.split("?")[0], headers, body, arrival, reader)
                if status == 0:
                    return  # the client left while its request was queued
                head_out = [f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}", f"Content-Length: {len(reply)}"]
                head_out += [f"{k}: {v}" for k, v in reply_headers.items()]
                writer.write(("\r\n".join(head_out) + "\r\n\r\n").encode("latin-1") + reply)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    async def route(self, method: str, path: str, headers: dict[str, str], body: bytes, arrival: float,
                    reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
        parts = [p for p in path.split("/") if p]
        if method == "POST" and len(parts) == 4 and parts[:2] == ["v2", "models"] and parts[3] == "infer":
            return await self.infer(parts[2], headers, body, arrival, reader)
        if method != "GET":
            return _json(404, {"error": f"no route {method} {path}"})
        if path == "/metrics" and self.metrics:
            return 200, {"Content-Type": "text/plain; version=0.0.4"}, self.exposition().encode()
        if path in ("/v2/health/live", "/v2/health/ready"):
            return 200, {}, b""
        if path == "/v2":
            return _json(200, {"name": "fakeserver", "version": "0", "extensions": ["statistics"]})
        if parts[:2] == ["v2", "models"] and parts[-1] == "stats":
            names = [parts[2]] if len(parts) == 4 else sorted(self.stats)
            return _json(200, {"model_stats": [self.stats.get(n, _ModelStats()).as_dict(n) for n in names]})
        if parts[:2] == ["v2", "models"] and len(parts) in (3, 4):
            if len(parts) == 4 and parts[3] == "ready":
                return 200, {}, b""
            return _json(200, {"name": parts[2], "versions": ["1"], "platform": "fake"})
        return _json(404, {"error": f"no route {method} {path}"})

    async def infer(self, model: str, headers: dict[str, str], body: bytes, arrival: float,
                    reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
        header_length = headers.get(HEADER_LENGTH.lower())
        try:
            request = json.loads(body[: int(header_length)] if header_length else body)
            tensor = request["inputs"][0]
            items = int(tensor["shape"][0])
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            return _json(400, {"error": f"bad request: {exc}"})
        output, width = OUTPUTS.get(tensor.get("name", ""), ("output", 1))
        job = _Job(model, items, arrival, reader)
        self.queue.put_nowait(job)
        try:
            await job.done
        except asyncio.CancelledError:
            return 0, {}, b""
        binary = any((o.get("parameters") or {}).get("binary_data") for o in request.get("outputs") or [])
        described: dict[str, Any] = {"name": output, "datatype": "FP32", "shape": [items, width]}
        reply: dict[str, Any] = {"model_name": model, "model_version": "1", "outputs": [described]}
        if "id" in request:
            reply["id"] = request["id"]
        if not binary:
            described["data"] = [0.0] * (items * width)
            return _json(200, reply)
        raw = bytes(4 * items * width)
        described["parameters"] = {"binary_data_size": len(raw)}
        head = json.dumps(reply, separators=(",", ":")).encode()
        return 200, {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(head))}, head + raw

    def exposition(self) -> str:
        """Batchline's metric names, per model (compute is per batch; here a batch is a request)."""
        lines = []

        def family(name: str, kind: str, samples: list[tuple[str, str, float]]) -> None:
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(f"{sample}{{{labels}}} {value!r}" for sample, labels, value in samples)

        models = sorted(self.stats)
        labels = {m: f'model="{m}",version="1"' for m in models}
        waiting: dict[str, int] = {}
        for job in list(self.queue._queue):  # type: ignore[attr-defined]  # a snapshot of the FIFO
            waiting[job.model] = waiting.get(job.model, 0) + 1
        family("batchline_queue_depth", "gauge", [("batchline_queue_depth", labels[m], float(waiting.get(m, 0)))
                                                   for m in models])
        for name, attribute in (("batchline_queue_duration_seconds", "queue_ns"),
                                ("batchline_compute_duration_seconds", "compute_ns"),
                                ("batchline_request_duration_seconds", "success_ns")):
            samples = []
            for m in models:
                s = self.stats[m]
                samples += [(f"{name}_bucket", labels[m] + ',le="+Inf"', float(s.success)),
                            (f"{name}_sum", labels[m], getattr(s, attribute) / 1e9),
                            (f"{name}_count", labels[m], float(s.success))]
            family(name, "histogram", samples)
        family("batchline_instance_busy_seconds", "counter",
               [("batchline_instance_busy_seconds_total", labels[m] + f',model_instance="{m}-1-0"', self.stats[m].busy_s)
                for m in models])
        family("batchline_requests", "counter",
               [("batchline_requests_total", labels[m] + ',outcome="success"', float(self.stats[m].success))
                for m in models])
        return "\n".join(lines) + "\n"


def _json(status: int, payload: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    return status, {"Content-Type": "application/json"}, json.dumps(payload, separators=(",", ":")).encode()


async def serve(host: str, port: int, server: FakeServer) -> None:
    listener = await asyncio.start_server(server.handle, host, port, backlog=1024)
    worker = asyncio.create_task(server.serve_forever())
    bound = listener.sockets[0].getsockname()
    print(f"{READY_LINE}http://{bound[0]}:{bound[1]}", flush=True)
    async with listener:
        await asyncio.gather(listener.serve_forever(), worker)


@contextmanager
def running(service_ms: float, per_item_ms: float = 0.0, metrics: bool = True, cpu: int | None = None,
            startup_timeout_s: float = 60.0) -> Iterator[str]:
    """A fake server in its own process (not to share a GIL with the client), on the port the
    system picks (it binds port 0 and prints the address it got); yields its URL."""
    command = [sys.executable, "-m", "loadtest.fakeserver", "--port", "0", "--service-ms", str(service_ms),
               "--per-item-ms", str(per_item_ms), *([] if metrics else ["--no-metrics"])]
    if cpu is not None:
        command = ["taskset", "-c", str(cpu), *command]
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="fakeserver-") as folder:
        log_path = Path(folder) / "log"
        with open(log_path, "w") as log:  # a file, not a pipe: nobody has to keep reading it
            process = subprocess.Popen(command, cwd=root, stdout=log, stderr=subprocess.STDOUT,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
            try:
                yield _ready_url(process, log_path, time.monotonic() + startup_timeout_s)
            finally:
                localserver.stop(process, timeout_s=10)


def _ready_url(process: subprocess.Popen, log_path: Path, deadline: float) -> str:
    """The URL of the ready line, once printed; bounded by `deadline` (time.monotonic())."""
    while True:
        for line in log_path.read_text(errors="replace").splitlines(keepends=True):
            if line.startswith(READY_LINE) and line.endswith("\n"):  # a whole line, not one being written
                return line.strip()[len(READY_LINE):]
        if process.poll() is not None or time.monotonic() > deadline:
            tail = log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"the fake server did not start (exit {process.poll()}):\n{tail}")
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.fakeserver", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100, help="0: any free port (printed on the first line)")
    parser.add_argument("--service-ms", type=float, default=5.0, help="service time of each request")
    parser.add_argument("--per-item-ms", type=float, default=0.0, help="service time added per batch row")
    parser.add_argument("--no-metrics", dest="metrics", action="store_false",
                        help="no /metrics: clients must fall back to the statistics extension")
    args = parser.parse_args(argv)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        parser.error("the fake server listens on loopback only")
    server = FakeServer(args.service_ms / 1000, args.per_item_ms / 1000, args.metrics)
    try:
        asyncio.run(serve(args.host, args.port, server))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
