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
WATCH_INTERVAL_S = 0.02  # how often the abort rule looks at outstanding requests


def schedule(rate: float, duration_s: float, seed: int = 0, limit: int | None = None) -> list[float]:
    """Poisson arrival offsets in [0, duration_s): exponential gaps at `rate`/s, from `seed`.

    The same seed at another rate gives the same draws scaled by 1/rate (common random
    numbers): steps of a rate search then differ by their rate, not by their luck, and a
    simulation (loadtest/fakeserver.py) can replay the very arrivals the client sent.
    At most `limit` arrivals (default 2·rate·duration + 100)."""
    limit = int(2 * rate * duration_s) + 100 if limit is None else limit
    rng = random.Random(seed)
    offsets: list[float] = []
    at = 0.0
    while len(offsets) < limit:
        at += rng.expovariate(rate)
        if at >= duration_s:
            break
        offsets.append(at)
    return offsets


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
    schedule_s: list[float] = field(default_factory=list)  # every arrival, offset from the start
    ok_arrivals_s: list[float] = field(default_factory=list)  # arrival offset of each ok reply
    steady_from_s: float = 0.0  # the steady window starts here (the queue starts empty)
    aborted: str | None = None

    def steady(self) -> dict[str, Any]:
        """The steady window [steady_from_s, duration_s): arrivals and completions per second in
        it, and the latency of the requests that arrived in it. Completions in the window
        against arrivals in the window: a server that keeps up completes as many as arrive
        (the lag of one latency cancels out); one that does not falls behind by its deficit."""
        start, end = self.steady_from_s, self.duration_s
        window = max(end - start, 1e-9)
        arrivals = np.array(self.schedule_s)
        ok_arrivals = np.array(self.ok_arrivals_s)
        latencies = np.array(self.latencies_s)
        completions = ok_arrivals + latencies if len(latencies) else np.zeros(0)
        in_window = latencies[ok_arrivals >= start] * 1000 if len(latencies) else np.zeros(0)
        offered = float(np.count_nonzero((arrivals >= start) & (arrivals < end))) / window if len(arrivals) else 0.0
        achieved = float(np.count_nonzero((completions >= start) & (completions < end))) / window
        return {
            "from_s": round(start, 3),
            "to_s": round(end, 3),
            "replies": len(in_window),
            "offered_req_s": round(offered, 1),
            "achieved_req_s": round(achieved, 1),
            "achieved_share": round(achieved / offered, 4) if offered else None,
            "latency_ms": {f"p{q:g}": _pct(in_window, q) for q in (50, 90, 99)} | {"max": _pct(in_window, 100)},
        }

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        self.first_error = self.first_error or f"{kind}: {detail}"

    def as_dict(self, items: int) -> dict[str, Any]:
        latencies = np.array(self.latencies_s) * 1000
        lag = np.array(self.send_lag_s) * 1000
        pct = _pct
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
            "aborted": self.aborted,
            "steady": self.steady(),
        }


def _pct(values: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if len(values) else None


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


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class ConnectionPool:
    """Keep-alive connections: reuse an idle one, open up to `limit`, else wait for one. Counts
    the connections it opened and the requests that found every connection busy (their wait is
    the client's, not the server's)."""

    def __init__(self, host: str, port: int, limit: int) -> None:
        self.host, self.port, self.limit = host, port, limit
        self.idle: asyncio.Queue[Connection] = asyncio.Queue()
        self.open = 0
        self.opened = 0
        self.waited = 0

    async def get(self) -> Connection:
        if self.idle.empty():
            if self.open < self.limit:
                self.open += 1
                self.opened += 1
                try:
                    return await asyncio.open_connection(self.host, self.port)
                except BaseException:
                    self.open -= 1
                    raise
            self.waited += 1
        return await self.idle.get()

    def put(self, connection: Connection, close: bool = False) -> None:
        """Back to the idle ones, or closed when the server said it closes it."""
        if close:
            self.discard(connection)
        else:
            self.idle.put_nowait(connection)

    def discard(self, connection: Connection) -> None:
        self.open -= 1
        connection[1].close()

    def close(self) -> None:
        while not self.idle.empty():
            self.idle.get_nowait()[1].close()


async def _one(pool: ConnectionPool, payload: bytes, request: InferRequest, scheduled: float, offset: float,
               timeout_s: float, validate: bool, result: RateResult) -> float | None:
    """Send one request; its latency from `scheduled` when it succeeded, else None."""
    connection = None
    try:
        async with asyncio.timeout(timeout_s):
            connection = await pool.get()
            reader, writer = connection
            writer.write(payload)
            status, headers, body = await _read_reply(reader)
    except asyncio.CancelledError:  # an aborted step: hang up, so the server drops the request
        if connection:
            pool.discard(connection)
        raise
    except TimeoutError:
        result.error("timeout", f"no reply within {timeout_s}s")
        if connection:
            pool.discard(connection)
        return None
    except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        result.error("socket", repr(exc))
        if connection:
            pool.discard(connection)
        return None
    latency = time.perf_counter() - scheduled
    if headers.get("connection", "").lower() == "close":
        pool.discard(connection)
    else:
        pool.put(connection)
    if status != 200:
        result.error(f"http_{status}", body[:200].decode("utf-8", "replace"))
        return None
    if validate:
        result.validated += 1
        problem = check_response(request.model, request.items, status, headers, body)
        if problem:
            result.error("bad_reply", problem)
            return None
    result.ok += 1
    result.latencies_s.append(latency)
    result.ok_arrivals_s.append(offset)
    return latency


async def run_rate(url: str, requests: list[InferRequest], rate: float, duration_s: float,
                   max_connections: int = 256, timeout_s: float = 10.0, seed: int = 0,
                   steady_from_s: float = 0.0, abort_above_s: float | None = None,
                   abort_on_error: bool = False) -> RateResult:
    """Offer Poisson arrivals at `rate`/s for `duration_s`; wait at most `timeout_s` for stragglers.

    Bounded in count too: at most 2·rate·duration + 100 requests are scheduled.
    `abort_above_s`: stop early, hanging up on the requests still out, once more than 1% of the
    arrivals after `steady_from_s` took (or are taking) longer: their p99 is then above it
    whatever the rest do, and an overloaded server's backlog is not worth waiting for.
    `abort_on_error`: stop at the first failed request."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    payloads = [raw_request(r, host, port) for r in requests]
    result = RateResult(rate=rate, duration_s=duration_s, steady_from_s=steady_from_s)
    result.schedule_s = schedule(rate, duration_s, seed)
    counted = sum(1 for at in result.schedule_s if at >= steady_from_s)
    budget = 0.01 * counted + 1  # more requests over the bound than this: p99 is over it
    pool = ConnectionPool(host, port, max_connections)
    tasks: dict[asyncio.Task, float] = {}  # outstanding request -> its arrival offset
    slow = 0
    start = time.perf_counter()

    def finished(task: asyncio.Task) -> None:
        nonlocal slow
        offset = tasks.pop(task)
        if abort_above_s is not None and offset >= steady_from_s and not task.cancelled():
            latency = task.result()
            if latency is None or latency > abort_above_s:  # a failed request counts as slow too
                slow += 1

    def verdict() -> str | None:
        if abort_on_error and result.errors:
            return f"stopped at the first error ({result.first_error})"
        if abort_above_s is None:
            return None
        now = time.perf_counter() - start
        late = sum(1 for at in tasks.values() if at >= steady_from_s and now - at > abort_above_s)
        if slow + late > budget:
            return (f"stopped after {now:.1f} s: {slow + late} requests over {abort_above_s * 1000:g} ms, "
                    f"more than 1% of {counted} (p99 is above it whatever the rest do)")
        return None

    async def watch() -> None:
        while result.aborted is None:
            await asyncio.sleep(WATCH_INTERVAL_S)
            result.aborted = verdict()

    watcher = asyncio.create_task(watch()) if abort_above_s is not None or abort_on_error else None
    try:
        for offset in result.schedule_s:
            if result.aborted:
                break
            scheduled = start + offset
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if result.aborted:
                break
            result.send_lag_s.append(max(0.0, time.perf_counter() - scheduled))
            index = result.sent % len(requests)
            validate = result.sent % VALIDATE_EVERY == 0
            task = asyncio.create_task(
                _one(pool, payloads[index], requests[index], scheduled, offset, timeout_s, validate, result))
            tasks[task] = offset
            task.add_done_callback(finished)
            result.sent += 1
        if tasks and not result.aborted:
            remaining = set(tasks)
            while remaining and result.aborted is None:
                _, remaining = await asyncio.wait(remaining, timeout=WATCH_INTERVAL_S * 5)
                if time.perf_counter() - start > duration_s + timeout_s + 1:
                    break
        if result.aborted:
            result.duration_s = time.perf_counter() - start
        outstanding = list(tasks)
        for task in outstanding:  # aborted, or the per-request timeout failed to fire
            task.cancel()
        if outstanding:
            await asyncio.gather(*outstanding, return_exceptions=True)
            if not result.aborted:
                result.errors["unfinished"] = result.errors.get("unfinished", 0) + len(outstanding)
                result.first_error = result.first_error or "unfinished: still running after the drain"
    finally:
        if watcher:
            watcher.cancel()
        pool.close()
        result.connections_opened = pool.opened
    if not result.aborted:
        result.duration_s = duration_s
    return result


def run(coroutine: Any) -> Any:
    """Run one coroutine in a fresh event loop (uvloop when installed)."""
    try:
        import uvloop
        return uvloop.run(coroutine)
    except ImportError:
        return asyncio.run(coroutine)


def event_loop_name() -> str:
    try:
        import uvloop  # noqa: F401
        return "uvloop"
    except ImportError:
        return "asyncio"


def run_sweep(url: str, requests: list[InferRequest], rates: list[float], duration_s: float,
              max_connections: int, timeout_s: float) -> list[RateResult]:
    """Each rate in its own event loop run, one after the other."""
    return [run(run_rate(url, requests, rate, duration_s, max_connections, timeout_s, seed=i))
            for i, rate in enumerate(rates)]
