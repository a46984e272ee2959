"""`bench overload`: a server offered several times what it can serve must refuse the excess fast,
keep serving its capacity, keep its memory bounded, and stay up.

The other modes measure a server within its means; this one measures what happens past them,
where an unbounded queue turns into latency that grows without end, memory that grows with it,
and a throughput that collapses as the server spends its time on requests whose clients gave up.
First the capacity: a short closed-loop wrk run at high concurrency (its sustained success rate),
or --capacity when known. Then open-loop Poisson arrivals at --factor x that for --duration s,
each request sent with a deadline (the KServe `timeout` parameter), while the server's resident
memory is sampled from /proc. Every reply is sorted by status: 200 accepted, 429 refused, 504
deadline, anything else (or a broken connection) an error the server must not make.

Latency is timed from the moment a request is written on its connection (the server's answer
time, what `latency_ms` holds), and also from its scheduled arrival (`from_arrival_ms`: the
user's view, which adds the client's own lag when the client falls behind the schedule).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlsplit

import numpy as np

from loadtest import openloop, payloads, report, runs, signals

HELP = """Offers --factor x the server's capacity as open-loop Poisson arrivals for --duration s
and reports how the server at --url holds: offered and accepted rates, the share refused (429)
and their latency, accepted latency p50/p99, deadline errors (504), every other error (a server
that survives overload makes none), the server's peak resident memory, and accepted throughput
as a share of capacity (no collapse: close to 1).

Capacity: --capacity REQ_S, else a closed-loop wrk run (--capacity-concurrency connections,
--capacity-duration s, pinned with --generator-cpu) whose success rate is taken as the capacity;
wrk must report no error. Each request carries `"parameters": {"timeout": --deadline-ms x 1000}`
(microseconds): the server answers 504 for a request whose deadline passes while it waits in the
queue. Memory: VmRSS of --server-pid (or of the process listening on --url's port, found in
/proc/net/tcp) every --rss-interval s, its idle value before the load and VmHWM after it; Linux
only. The client (asyncio, raw sockets, up to --connections keep-alive connections: keep it
above the server's in-flight cap, or the client's pool, not the server, is what limits) is one
Python process: pinned with --generator-cpu it offers a few thousand requests/s, maybe less than
factor x capacity; the report says what it offered, and its lag behind the schedule. A request
that finds every connection busy waits in the client, outside the figures (the report counts them). Rates are
counted over the window after --settle s (while the server's in-flight population fills). After
the load, /v2/health/live must still answer 200."""

# statuses of requests with no (valid) HTTP reply; UNSENT: still waiting in the client for a free
# connection when the drain ended, CUT: sent, then cut by the drain's end before its own timeout
# (the client's backlog, not a server error); UNFINISHED: sent, past its timeout, still not answered
TIMEOUT, SOCKET, BAD_REPLY, UNFINISHED, UNSENT, CUT = -1, -2, -3, 0, -4, -5
ERROR_NAMES = {TIMEOUT: "timeout", SOCKET: "socket", BAD_REPLY: "bad_reply", UNFINISHED: "unfinished"}
VALIDATE_EVERY = 50  # one 200 in this many is fully checked (JSON parse, output shape)
BIN_S = 0.5  # the timeline's resolution


# ---- the server's memory --------------------------------------------------------------------------

def listening_pid(port: int) -> int | None:
    """The process listening on TCP `port` (loopback or any address), from /proc; None if not ours to see."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    return int(entry.name)
        except OSError:  # gone, or not ours
            continue
    return None


def status_kib(pid: int, key: str) -> int | None:
    """A `key:  N kB` line of /proc/PID/status, in KiB; None once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


class RssSampler:
    """VmRSS of one process every `interval_s` on a thread, for the peak and the plot: the kernel's
    VmHWM alone would count start-up and warm-up, not the overload."""

    def __init__(self, pid: int, interval_s: float = 0.1, limit: int = 100_000) -> None:
        self.pid, self.interval_s, self.limit = pid, interval_s, limit
        self.samples: list[tuple[float, int]] = []  # (seconds since start, KiB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
        self._start = 0.0

    def __enter__(self) -> Self:
        self._start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _sample(self) -> None:
        while not self._stop.is_set() and len(self.samples) < self.limit:
            kib = status_kib(self.pid, "VmRSS")
            if kib is not None:
                self.samples.append((time.perf_counter() - self._start, kib))
            self._stop.wait(self.interval_s)


# ---- the requests -----------------------------------------------------------------------------------

def with_deadline(request: payloads.InferRequest, deadline_ms: float) -> payloads.InferRequest:
    """The same request with `"parameters": {"timeout": microseconds}` in its JSON (or binary header)."""
    parameter = {"timeout": max(1, round(deadline_ms * 1000))}
    length = request.headers.get(payloads.HEADER_LENGTH)
    split = int(length) if length is not None else len(request.body)
    header = json.loads(request.body[:split])
    header["parameters"] = {**header.get("parameters", {}), **parameter}
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    headers = dict(request.headers)
    if length is not None:
        headers[payloads.HEADER_LENGTH] = str(len(encoded))
    return dataclasses.replace(request, body=encoded + request.body[split:], headers=headers)


@dataclass
class Replies:
    """Every request of one overload run: when it was due, sent, answered, and how (status)."""

    due_s: np.ndarray  # scheduled arrival, seconds from the start
    sent_s: np.ndarray  # written on its connection (NaN: never)
    done_s: np.ndarray  # reply read (NaN: none)
    status: np.ndarray  # HTTP status, or TIMEOUT / SOCKET / BAD_REPLY / UNFINISHED
    duration_s: float
    first_errors: dict[str, str] = field(default_factory=dict)
    connections_opened: int = 0
    waited_for_connection: int = 0  # requests that found every connection busy

    @classmethod
    def empty(cls, due: list[float], duration_s: float) -> Replies:
        n = len(due)
        return cls(np.array(due), np.full(n, np.nan), np.full(n, np.nan), np.zeros(n, dtype=np.int32), duration_s)

    def error(self, index: int, status: int, detail: str) -> None:
        self.status[index] = status
        self.first_errors.setdefault(ERROR_NAMES.get(status, f"http_{status}"), detail[:300])


async def _one(pool: openloop.ConnectionPool, index: int, payload: bytes, request: payloads.InferRequest, start: float,
               timeout_s: float, replies: Replies) -> None:
    """One request; the timeout runs from its write: a wait for a free connection is the client's."""
    connection = None
    try:
        try:
            connection = await pool.get()
        except asyncio.CancelledError:
            replies.status[index] = UNSENT
            raise
        reader, writer = connection
        replies.sent_s[index] = time.perf_counter() - start
        async with asyncio.timeout(timeout_s):
            writer.write(payload)
            status, headers, body = await openloop._read_reply(reader)  # one HTTP reader for both clients
    except TimeoutError:
        replies.error(index, TIMEOUT, f"no reply within {timeout_s}s")
        if connection:
            pool.discard(connection)
        return
    except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        replies.error(index, SOCKET, repr(exc))
        if connection:
            pool.discard(connection)
        return
    except asyncio.CancelledError:
        if connection:
            pool.discard(connection)
            if time.perf_counter() - start - replies.sent_s[index] < timeout_s:
                replies.status[index] = CUT
        raise
    replies.done_s[index] = time.perf_counter() - start
    pool.put(connection, headers.get("connection", "").lower() == "close")
    if status == 200 and index % VALIDATE_EVERY == 0:
        problem = payloads.check_response(request.model, request.items, status, headers, body)
        if problem:
            replies.error(index, BAD_REPLY, problem)
            return
    replies.status[index] = status
    if status not in (200, 429, 504):
        replies.first_errors.setdefault(f"http_{status}", body[:300].decode("utf-8", "replace"))


async def offer(url: str, requests: list[payloads.InferRequest], rate: float, duration_s: float,
                connections: int, timeout_s: float, seed: int = 0) -> Replies:
    """Poisson arrivals at `rate`/s for `duration_s`, whatever the server answers; then wait at
    most `timeout_s` + 1 s for the last replies. At most 2·rate·duration + 100 requests."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    raw = [openloop.raw_request(r, host, port) for r in requests]
    replies = Replies.empty(openloop.schedule(rate, duration_s, seed), duration_s)
    pool = openloop.ConnectionPool(host, port, connections)
    tasks: set[asyncio.Task[None]] = set()
    start = time.perf_counter()
    try:
        for index, due in enumerate(replies.due_s):
            delay = start + due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            which = index % len(requests)
            task = asyncio.create_task(_one(pool, index, raw[which], requests[which], start, timeout_s, replies))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(set(tasks), timeout=timeout_s + 1)
        for task in list(tasks):  # unsent (the client's backlog), or sent and the timeout failed to fire
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        pool.close()
        replies.connections_opened, replies.waited_for_connection = pool.opened, pool.waited
    return replies


# ---- the figures ------------------------------------------------------------------------------------

def _ms(values: np.ndarray) -> dict[str, float | None]:
    values = values[~np.isnan(values)] * 1000
    pct = openloop._pct  # the same rounding as the other modes
    return {"p50": pct(values, 50), "p90": pct(values, 90), "p99": pct(values, 99), "max": pct(values, 100)}


def summarize(replies: Replies, capacity: float, factor: float, deadline_ms: float, settle_s: float,
              items: int) -> dict[str, Any]:
    """Rates over the window [settle_s, duration_s), latencies and counts over the whole run."""
    start, end = min(settle_s, replies.duration_s / 2), replies.duration_s
    window = end - start
    status, sent, done = replies.status, replies.sent_s, replies.done_s
    wire = done - sent

    def rate(times: np.ndarray, mask: np.ndarray | None = None) -> float:
        picked = times if mask is None else times[mask]
        return round(float(np.count_nonzero((picked >= start) & (picked < end))) / window, 1)

    accepted, refused, expired = status == 200, status == 429, status == 504
    errors = {ERROR_NAMES.get(int(s), f"http_{int(s)}"): int(np.count_nonzero(status == s))
              for s in np.unique(status) if int(s) not in (200, 429, 504, UNSENT, CUT)}
    answered = int(np.count_nonzero(~np.isnan(done)))
    accepted_rate = rate(done, accepted)
    late = wire[accepted] * 1000 - deadline_ms
    offered = rate(sent)
    total = int(np.count_nonzero(~np.isnan(sent)))  # shares are of what the server was sent
    return {
        "capacity_req_s": capacity,
        "factor": factor,
        "target_rate": round(capacity * factor, 1),
        "window_s": [round(start, 3), round(end, 3)],
        "scheduled": len(status),
        "sent": int(np.count_nonzero(~np.isnan(sent))),
        "answered": answered,
        "offered_req_s": offered,
        "offered_factor": round(offered / capacity, 3) if capacity else None,
        "accepted_req_s": accepted_rate,
        "accepted_items_s": round(accepted_rate * items, 1),
        "refused_req_s": rate(done, refused),
        "accepted_share_of_capacity": round(accepted_rate / capacity, 3) if capacity else None,
        "counts": {"accepted": int(accepted.sum()), "refused_429": int(refused.sum()),
                   "deadline_504": int(expired.sum()), "other_errors": sum(errors.values())},
        "shares": {"accepted": _share(accepted.sum(), total), "refused_429": _share(refused.sum(), total),
                   "deadline_504": _share(expired.sum(), total)},
        "errors": errors,
        "first_errors": replies.first_errors,
        "latency_ms": {"accepted": _ms(wire[accepted]), "refused_429": _ms(wire[refused]),
                       "deadline_504": _ms(wire[expired])},
        "from_arrival_ms": {"accepted": _ms((done - replies.due_s)[accepted]),
                            "refused_429": _ms((done - replies.due_s)[refused])},
        "deadline_ms": deadline_ms,
        "accepted_after_deadline": int(np.count_nonzero(late > 0)),
        "accepted_most_over_deadline_ms": round(float(late.max()), 3) if len(late) else None,
        "client_send_lag_ms": _ms(sent - replies.due_s),
        "unsent": int(np.count_nonzero(status == UNSENT)),
        "cut_by_the_drain": int(np.count_nonzero(status == CUT)),
        "connections_opened": replies.connections_opened,
        "waited_for_connection": replies.waited_for_connection,
    }


def _share(count: int, total: int) -> float | None:
    return round(float(count) / total, 4) if total else None


def timeline(replies: Replies, bin_s: float = BIN_S) -> dict[str, list[float | None]]:
    """Per bin of `bin_s` seconds: sends, 200s, 429s, 504s per second, and the 200s' p99 (ms)."""
    bins = max(1, int(np.ceil(replies.duration_s / bin_s)))
    edges = np.arange(bins + 1) * bin_s
    out: dict[str, list[float | None]] = {"t_s": [round(float(t), 3) for t in edges[:-1] + bin_s / 2]}
    out["offered"] = (np.histogram(replies.sent_s[~np.isnan(replies.sent_s)], edges)[0] / bin_s).tolist()
    for key, code in (("accepted", 200), ("refused", 429), ("expired", 504)):
        times = replies.done_s[replies.status == code]
        out[key] = (np.histogram(times, edges)[0] / bin_s).tolist()
    ok = replies.status == 200
    done, wire = replies.done_s[ok], (replies.done_s - replies.sent_s)[ok] * 1000
    p99: list[float | None] = []
    for low, high in itertools.pairwise(edges):
        inside = wire[(done >= low) & (done < high)]
        p99.append(round(float(np.percentile(inside, 99)), 3) if len(inside) else None)
    out["accepted_p99_ms"] = p99
    return out


# ---- the mode ------------------------------------------------------------------------------------------

def add_parser(modes: Any, parents: runs.Parents) -> None:
    parser = modes.add_parser("overload", parents=[parents.common, parents.http, parents.items],
                              help="factor x capacity, open loop: refusals, latency, memory, no collapse",
                              description=HELP, formatter_class=runs.Formatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--duration", type=runs.positive, default=10.0, help="seconds of overload")
    parser.add_argument("--factor", type=runs.positive, default=3.0, help="offered load as a multiple of the capacity")
    parser.add_argument("--capacity", type=runs.positive, metavar="REQ_S",
                        help="the server's capacity, if known (else measured with wrk)")
    parser.add_argument("--capacity-duration", type=runs.positive, default=3.0, help="seconds of the wrk run")
    parser.add_argument("--capacity-concurrency", type=int, default=64, help="wrk's connections")
    parser.add_argument("--deadline-ms", type=runs.positive, default=1000.0,
                        help="each request's deadline (the `timeout` parameter)")
    parser.add_argument("--connections", type=int, default=1024,
                        help="most connections the client opens: above the server's in-flight cap, not far "
                             "(each one past it holds a request unread in the server's socket, before any cap)")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds before the window rates are counted in")
    parser.add_argument("--server-pid", type=int, help="the server's process (default: the one listening on --url's port)")
    parser.add_argument("--rss-interval", type=runs.positive, default=0.1, help="seconds between memory samples")
    parser.add_argument("--seed", type=int, default=0, help="arrival draws")


def live(url: str, timeout_s: float = 5.0) -> bool:
    """GET /v2/health/live answers 200."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v2/health/live", timeout=timeout_s) as reply:
            return reply.status == 200
    except OSError:
        return False


def measure_capacity(url: str, requests: list[payloads.InferRequest], concurrency: int, duration_s: float,
                     timeout_s: float, cpu: int | None, folder: Path) -> dict[str, Any]:
    """wrk at `concurrency` connections: its success rate is the capacity (no error allowed)."""
    runs.require_wrk()
    level = runs.closed_sweep(url, requests, [concurrency], duration_s, 0.0, timeout_s, cpu, folder)[0]
    if level["error_count"]:
        raise SystemExit(f"bench overload: the capacity run had errors {level['errors']}: not a capacity")
    return level


@dataclass
class Held:
    """One overload run: its summary (with liveness and memory), every reply, the memory samples."""

    result: dict[str, Any]
    replies: Replies
    rss_series: list[tuple[float, int]]


def hold(url: str, requests: list[payloads.InferRequest], capacity: float, factor: float, duration_s: float, *,
         deadline_ms: float, connections: int, timeout_s: float, settle_s: float, pid: int | None,
         rss_interval_s: float = 0.1, seed: int = 0) -> Held:
    """Offer `factor` x `capacity` open loop for `duration_s` while the server's memory is sampled;
    then ask whether it is still live. `requests` carry their deadline already (`with_deadline`).
    The server's own counters bracket the run: whether it kept its instances busy on full batches
    while it refused the excess (`server_signals`: busy_fraction, items per execution)."""
    before = signals.snapshot(url, requests[0].model)
    idle_kib = status_kib(pid, "VmRSS") if pid else None
    sampler = RssSampler(pid, rss_interval_s) if pid else None
    if sampler:
        sampler.__enter__()
    try:
        replies = openloop.run(offer(url, requests, capacity * factor, duration_s, connections, timeout_s, seed))
    finally:
        if sampler:
            sampler.__exit__()
    after = signals.snapshot(url, requests[0].model)
    result = summarize(replies, capacity, factor, deadline_ms, settle_s, requests[0].items)
    result["server_signals"] = signals.window(before, after, requests[0].model)
    result["live_after"] = live(url)
    result["server_alive_after"] = bool(pid) and Path(f"/proc/{pid}").exists()
    samples = sampler.samples if sampler else []
    rss = [kib for _, kib in samples]
    result["rss_mib"] = {
        "idle": _mib(idle_kib), "peak": _mib(max(rss)) if rss else None, "last": _mib(rss[-1]) if rss else None,
        "peak_over_idle": _mib(max(rss) - idle_kib) if rss and idle_kib else None,
        "vm_hwm": _mib(status_kib(pid, "VmHWM")) if pid else None, "samples": len(rss),
    }
    return Held(result, replies, samples)


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, str]:
    if args.capacity_concurrency < 1 or args.connections < 1:
        raise SystemExit("bench overload: --capacity-concurrency and --connections must be >= 1")
    port = urlsplit(args.url).port or 80
    pid = args.server_pid or listening_pid(port)
    parameters = {
        "url": args.url, "model": args.model, "binary": args.binary, "items": args.items, "bodies": args.bodies,
        "duration_s": args.duration, "factor": args.factor, "capacity_given": args.capacity,
        "capacity_duration_s": args.capacity_duration, "capacity_concurrency": args.capacity_concurrency,
        "deadline_ms": args.deadline_ms, "connections": args.connections, "settle_s": args.settle,
        "timeout_s": args.timeout, "server_pid": pid, "rss_interval_s": args.rss_interval, "seed": args.seed,
        "generator_cpu": args.generator_cpu, "client": f"python asyncio ({openloop.event_loop_name()})",
    }
    record = runs.record(args, argv, parameters)
    record["server"] = runs.server_info(args.url)
    requests = [with_deadline(r, args.deadline_ms)
                for r in payloads.build_requests(args.model, args.items, args.binary, args.bodies)]
    runs.preflight(args.url, requests[0], args.timeout)
    if args.capacity:
        capacity, capacity_run = args.capacity, None
    else:
        capacity_run = measure_capacity(args.url, requests, args.capacity_concurrency, args.capacity_duration,
                                        args.timeout, args.generator_cpu, args.out / "wrk")
        capacity = capacity_run["req_s"]
    print(f"  capacity {capacity:,.0f} req/s; offering {capacity * args.factor:,.0f}/s for {args.duration:g} s",
          file=sys.stderr)
    runs.pin_generator(args.generator_cpu)  # after wrk: taskset pins wrk itself
    held = hold(args.url, requests, capacity, args.factor, args.duration, deadline_ms=args.deadline_ms,
                connections=args.connections, timeout_s=args.timeout, settle_s=args.settle, pid=pid,
                rss_interval_s=args.rss_interval, seed=args.seed)
    result = held.result
    record["results"] = {"capacity_run": capacity_run, "overload": result, "timeline": timeline(held.replies),
                         "rss_series": [[round(t, 2), kib] for t, kib in held.rss_series]}
    record["headline"] = {key: result[key] for key in ("capacity_req_s", "offered_req_s", "accepted_req_s",
                                                        "accepted_share_of_capacity", "live_after")}
    record["headline"] |= {"refused_share": result["shares"]["refused_429"],
                           "other_errors": result["counts"]["other_errors"], "rss_peak_mib": result["rss_mib"]["peak"]}
    record["notes"] += _notes(result, args, pid)
    headers = ["", "req/s", "share", "p50 ms", "p99 ms", "max ms"]
    latency = result["latency_ms"]
    counts, shares = result["counts"], result["shares"]
    rows = [
        ["offered", result["offered_req_s"], result["offered_factor"], None, None, None],
        ["accepted (200)", result["accepted_req_s"], shares["accepted"], *_lat(latency["accepted"])],
        ["refused (429)", result["refused_req_s"], shares["refused_429"], *_lat(latency["refused_429"])],
        ["deadline (504)", None, shares["deadline_504"], *_lat(latency["deadline_504"])],
        ["other errors", None, counts["other_errors"], None, None, None],
    ]
    summary = [
        (f"capacity {capacity:,.0f} req/s; offered {result['offered_req_s']:,.0f}/s "
         f"({result['offered_factor']}x); accepted {result['accepted_req_s']:,.0f}/s = "
         f"{result['accepted_share_of_capacity']} of capacity"),
        (f"refused {shares['refused_429']:.1%} (p99 {latency['refused_429']['p99']} ms), accepted p50/p99 "
         f"{latency['accepted']['p50']}/{latency['accepted']['p99']} ms, 504: {counts['deadline_504']}, "
         f"other errors: {counts['other_errors']}; RSS peak {result['rss_mib']['peak']} MiB "
         f"(idle {result['rss_mib']['idle']}); live after: {result['live_after']}"),
    ]

    def plot(path: Path) -> None:
        plot_overload(path, record["results"]["timeline"], record["results"]["rss_series"], capacity,
                      args.deadline_ms, args.model, args.factor)

    return report.write(args.out, "overload", record, headers, rows, summary, plot)


def _lat(latency: dict[str, float | None]) -> list[float | None]:
    return [latency["p50"], latency["p99"], latency["max"]]


def _mib(kib: int | None) -> float | None:
    return round(kib / 1024, 1) if kib is not None else None


def _notes(result: dict[str, Any], args: argparse.Namespace, pid: int | None) -> list[str]:
    notes = [
        ("latency: from the request's write on its connection to its reply (the server's answer time); "
         "from_arrival_ms in the JSON adds the client's lag behind the Poisson schedule"),
        (f"rates over the window {result['window_s']} s; accepted share of capacity = accepted req/s in it / "
         "the capacity (no collapse: close to 1)"),
    ]
    if result["offered_factor"] is not None and result["offered_factor"] < 0.9 * args.factor:
        notes.append(f"the client offered {result['offered_factor']}x, not {args.factor:g}x: one Python process "
                     f"fell behind the schedule (send lag p99 {result['client_send_lag_ms']['p99']} ms)")
    if result["waited_for_connection"]:
        notes.append(f"{result['waited_for_connection']} requests found all {args.connections} connections busy "
                     "and waited in the client: raise --connections above the server's in-flight cap")
    if result["unsent"] or result["cut_by_the_drain"]:
        notes.append(f"the drain ({args.timeout:g} s + 1 s after the last arrival) ended with {result['unsent']} "
                     f"requests still waiting for a connection and {result['cut_by_the_drain']} sent but not yet "
                     "answered within their timeout: the client's backlog, not counted as errors")
    if not pid:
        notes.append("no server process found (another user's, or not on this machine): no memory figures; "
                     "give --server-pid")
    return notes


def plot_overload(path: Path, line: dict[str, list[Any]], rss: list[list[float]], capacity: float,
                  deadline_ms: float, model: str, factor: float) -> None:
    fig, (rates, latency, memory) = report.panels(f"{model}: {factor:g}x capacity, open loop (Poisson)", 3)
    t = line["t_s"]
    for key, style in (("offered", ":"), ("accepted", "-"), ("refused", "--"), ("expired", "-.")):
        rates.plot(t, line[key], style, label={"expired": "504"}.get(key, key))
    report.hline(rates, capacity, f"capacity {capacity:,.0f}/s", color="tab:green")
    rates.set_xlabel("time (s)")
    rates.set_ylabel("requests/s")
    rates.set_title("offered and answered", fontsize=9)
    rates.legend(fontsize=7)
    points = [(x, y) for x, y in zip(t, line["accepted_p99_ms"]) if y is not None]
    latency.plot([p[0] for p in points], [p[1] for p in points], "o-", label="accepted p99")
    report.hline(latency, deadline_ms, f"deadline {deadline_ms:g} ms")
    latency.set_xlabel("time (s)")
    latency.set_ylabel("latency (ms)")
    latency.set_title("accepted latency", fontsize=9)
    latency.legend(fontsize=7)
    if rss:
        memory.plot([r[0] for r in rss], [r[1] / 1024 for r in rss], "-")
    memory.set_xlabel("time (s)")
    memory.set_ylabel("server RSS (MiB)")
    memory.set_title("server memory", fontsize=9)
    report.save(fig, path)
