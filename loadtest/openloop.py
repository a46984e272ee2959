"""Open-loop load: requests arrive as a Poisson process at a fixed rate, whatever the server does.

A closed loop (wrk) slows down with the server and hides queueing ("coordinated omission");
here each request has a scheduled arrival time and its latency is measured from that time, so
waiting for a free connection or for a lagging client counts against the server like a real
user's wait would. Python's asyncio (uvloop when installed) keeps up with a few thousand
requests per second on one core; the report records the client's own lag (actual send time
minus scheduled time), so a run where the client fell behind is visible, not hidden.

Why a raw-socket HTTP/1.1 client: keep-alive on a pool of many connections with nothing between
us and the socket; aiohttp/httpx would cost more CPU per request than the server under test.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from loadtest.payloads import InferRequest, check_response

VALIDATE_EVERY = 50  # full reply check (JSON parse) on one reply in this many; status always


@dataclass
class RateResult:
    """What happened at one offered rate."""

    rate: float
    duration_s: float
    sent: int = 0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latencies_s: list[float] = field(default_factory=list)
    send_lag_s: list[float] = field(default_factory=list)
    connections_opened: int = 0
    validated: int = 0
    first_error: str | None = None

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        self.first_error = self.first_error or f"{kind}: {detail}"

    def as_dict(self, items: int) -> dict[str, Any]:
        latencies = np.array(self.latencies_s) * 1000
        lag = np.array(self.send_lag_s) * 1000

        def pct(values: np.ndarray, q: float) -> float | None:
            return round(float(np.percentile(values, q)), 3) if len(values) else None

        return {
            "offered_rate": self.rate,
            "duration_s": round(self.duration_s, 3),
            "sent": self.sent,
            "ok": self.ok,
            "achieved_req_s": round(self.ok / self.duration_s, 1) if self.duration_s else 0.0,
            "achieved_items_s": round(self.ok * items / self.duration_s, 1) if self.duration_s else 0.0,
            "latency_ms": {f"p{q:g}": pct(latencies, q) for q in (50, 90, 99, 99.9)} | {
                "max": pct(latencies, 100)},
            "client_send_lag_ms": {"p50": pct(lag, 50), "p99": pct(lag, 99), "max": pct(lag, 100)},
            "errors": self.errors,
            "error_count": sum(self.errors.values()),
            "first_error": self.first_error,
            "connections_opened": self.connections_opened,
            "validated_replies": self.validated,
        }


def raw_request(request: InferRequest, host: str, port: int) -> bytes:
    lines = [f"POST {request.path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {len(request.body)}"]
    lines += [f"{k}: {v}" for k, v in request.headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + request.body


async def _read_reply(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split(" ", 2)[1])
    headers = {}
    for line in header_lines:
        if ":" in line:
            key, value = line.split(":", 1)
            headers[key.strip().lower()] = value.strip()
    if "content-length" not in headers:
        raise ValueError(f"reply without Content-Length ({status_line}); chunked replies are not read")
    body = await reader.readexactly(int(headers["content-length"]))
    return status, headers, body


class _Pool:
    """Keep-alive connections: reuse an idle one, open up to `limit`, else wait for one."""

    def __init__(self, host: str, port: int, limit: int, result: RateResult) -> None:
        self.host, self.port, self.limit, self.result = host, port, limit, result
        self.idle: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
        self.open = 0

    async def get(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.idle.empty() and self.open < self.limit:
            self.open += 1
            self.result.connections_opened += 1
            try:
                return await asyncio.open_connection(self.host, self.port)
            except BaseException:
                self.open -= 1
                raise
        return await self.idle.get()

    def put(self, connection: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        self.idle.put_nowait(connection)

    def discard(self, connection: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        self.open -= 1
        connection[1].close()

    def close(self) -> None:
        while not self.idle.empty():
            self.idle.get_nowait()[1].close()


async def _one(pool: _Pool, payload: bytes, request: InferRequest, scheduled: float,
               timeout_s: float, validate: bool, result: RateResult) -> None:
    connection = None
    try:
        async with asyncio.timeout(timeout_s):
            connection = await pool.get()
            reader, writer = connection
            writer.write(payload)
            status, headers, body = await _read_reply(reader)
    except TimeoutError:
        result.error("timeout", f"no reply within {timeout_s}s")
        if connection:
            pool.discard(connection)
        return
    except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        result.error("socket", repr(exc))
        if connection:
            pool.discard(connection)
        return
    latency = time.perf_counter() - scheduled
    if headers.get("connection", "").lower() == "close":
        pool.discard(connection)
    else:
        pool.put(connection)
    if status != 200:
        result.error(f"http_{status}", body[:200].decode("utf-8", "replace"))
        return
    if validate:
        result.validated += 1
        problem = check_response(request.model, request.items, status, headers, body)
        if problem:
            result.error("bad_reply", problem)
            return
    result.ok += 1
    result.latencies_s.append(latency)


async def run_rate(url: str, requests: list[InferRequest], rate: float, duration_s: float,
                   max_connections: int = 256, timeout_s: float = 10.0, seed: int = 0) -> RateResult:
    """Offer Poisson arrivals at `rate`/s for `duration_s`; wait at most `timeout_s` for stragglers.

    Bounded in count too: at most 2·rate·duration + 100 requests are scheduled."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    payloads = [raw_request(r, host, port) for r in requests]
    result = RateResult(rate=rate, duration_s=duration_s)
    pool = _Pool(host, port, max_connections, result)
    rng = random.Random(seed)
    limit = int(2 * rate * duration_s) + 100
    tasks: set[asyncio.Task] = set()
    start = time.perf_counter()
    scheduled = start
    try:
        while result.sent < limit:
            scheduled += rng.expovariate(rate)
            if scheduled - start >= duration_s:
                break
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            result.send_lag_s.append(max(0.0, time.perf_counter() - scheduled))
            index = result.sent % len(requests)
            validate = result.sent % VALIDATE_EVERY == 0
            task = asyncio.create_task(
                _one(pool, payloads[index], requests[index], scheduled, timeout_s, validate, result))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            result.sent += 1
        if tasks:
            await asyncio.wait(set(tasks), timeout=timeout_s + 1)
        for task in list(tasks):  # only when the per-request timeout failed to fire
            task.cancel()
            result.error("unfinished", "still running after the drain")
    finally:
        pool.close()
    result.duration_s = duration_s
    return result


def event_loop_name() -> str:
    try:
        import uvloop  # noqa: F401
        return "uvloop"
    except ImportError:
        return "asyncio"


def run_sweep(url: str, requests: list[InferRequest], rates: list[float], duration_s: float,
              max_connections: int, timeout_s: float) -> list[RateResult]:
    """Each rate in its own event loop run, one after the other."""
    runner: Any
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    return [runner(run_rate(url, requests, rate, duration_s, max_connections, timeout_s, seed=i))
            for i, rate in enumerate(rates)]
