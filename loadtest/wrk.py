"""Closed-loop load with wrk: C keep-alive connections, each sending its next request as soon as
the previous reply arrives.

Why wrk and not a Python client: the server under test answers thousands of requests per second
on one core; a Python client on the other core would saturate first and measure itself. wrk's
C event loop sends the pre-formatted bodies (loadtest/payloads.py, cycled) at a small fraction of
that cost. Connection i starts at body i (mod the bodies), so the requests in flight hold as
many different bodies as there are, as independent clients' would: started at the same body,
the connections walked the bodies nearly in step, and a text model's batches held one text
repeated, without the padding that mixed lengths cost (minilm's served rate was flattered).

Latency is measured by the Lua script, not taken from wrk's histogram: wrk 4 "corrects" its
histogram before reporting it (stats_correct in wrk.c): every latency v above the expected
interval e = runtime / (requests / connections) also adds synthetic samples v-e, v-2e, ... as if
the client had meant to send at a fixed rate (coordinated-omission correction). In a closed loop
nobody waited for those requests: a handful of 200 ms stalls then turns p90/p99 into 100-200 ms
and the mean into several times what Little's law allows. Debian's wrk 4.1.0 cannot hand the
histogram bins to Lua either (`latency[i]` came later), so the script timestamps each request
itself (LuaJIT FFI, clock_gettime(CLOCK_MONOTONIC)) when wrk asks for it and when its reply is
complete. That pairing needs one connection per wrk thread, so wrk runs with -t = -c: C threads,
each one connection, pinned together with --generator-cpu. wrk's own (corrected) figures stay in
the record as `latency_ms_wrk_corrected`, for comparison with other wrk numbers.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.payloads import HEADER_LENGTH, InferRequest

MARKER = "BATCHLINE_WRK_JSON "
PERCENTILES = (50.0, 75.0, 90.0, 99.0, 99.9)
INSTALL_HINT = (
    "wrk is not installed (the closed-loop modes need it). On Debian/Ubuntu, as root: "
    "`apt-get update && apt-get install -y wrk`; then run this again."
)

_LUA = r"""-- Written by loadtest/wrk.py. POSTs the bodies given after `--` (HEADERLEN:FILE), in turn,
-- each connection from its own first body;
-- times each request itself (one connection per thread, so a reply pairs with its request) and
-- prints one JSON line of totals, wrk's corrected percentiles and the measured histogram.
local ffi = require("ffi")
ffi.cdef[[
typedef struct { long tv_sec; long tv_nsec; } batchline_timespec;
int clock_gettime(int clock_id, batchline_timespec *tp);
]]
local CLOCK_MONOTONIC = 1
local now = ffi.new("batchline_timespec")
local function now_us()
  ffi.C.clock_gettime(CLOCK_MONOTONIC, now)
  return tonumber(now.tv_sec) * 1000000 + tonumber(now.tv_nsec) / 1000
end

local path = %(path)s
local headers = %(headers)s
local formatted = {}
local counter = 0
local threads = {}
sent_at = nil     -- per thread: when the request in flight was handed to wrk
histogram = {}    -- per thread: microseconds -> replies
samples = 0

function setup(thread)
  thread:set("first", #threads)  -- connection i starts at body i: in flight, bodies differ
  table.insert(threads, thread)
end

function init(args)
  for _, arg in ipairs(args) do
    local length, name = arg:match("^([^:]*):(.*)$")
    local file = assert(io.open(name, "rb"))
    local body = file:read("*a")
    file:close()
    local h = {}
    for k, v in pairs(headers) do h[k] = v end
    if length ~= "-" then h[%(header_length)s] = length end
    table.insert(formatted, wrk.format("POST", path, h, body))
  end
  if #formatted == 0 then error("no request bodies given after --") end
  counter = (first or 0) %% #formatted
end

function request()
  counter = counter %% #formatted + 1
  sent_at = now_us()
  return formatted[counter]
end

function response(status, headers, body)
  if sent_at then
    local us = math.floor(now_us() - sent_at)
    histogram[us] = (histogram[us] or 0) + 1
    samples = samples + 1
    sent_at = nil
  end
end

function done(summary, latency, _)
  local merged = {}
  local measured = 0
  for _, thread in ipairs(threads) do
    measured = measured + thread:get("samples")
    for us, count in pairs(thread:get("histogram")) do
      merged[us] = (merged[us] or 0) + count
    end
  end
  local bins = {}
  for us, count in pairs(merged) do
    table.insert(bins, string.format("%%d:%%d", us, count))
  end
  local e = summary.errors
  local p = {}
  for _, q in ipairs({%(percentiles)s}) do
    table.insert(p, string.format('"%%g":%%d', q, latency:percentile(q)))
  end
  io.write(string.format(
    '%(marker)s{"requests":%%d,"duration_us":%%d,"bytes":%%d,"threads":%%d,"measured":%%d,' ..
    '"errors":{"connect":%%d,"read":%%d,"write":%%d,"status":%%d,"timeout":%%d},' ..
    '"wrk_latency_us":{"min":%%.0f,"mean":%%.1f,"max":%%.0f,"percentiles":{%%s}},' ..
    '"histogram":"%%s"}\n',
    summary.requests, summary.duration, summary.bytes, #threads, measured,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency.min, latency.mean, latency.max, table.concat(p, ","), table.concat(bins, ",")))
end
"""


class WrkMissing(RuntimeError):
    """wrk (or taskset, for pinning) is not on PATH."""


@dataclass(frozen=True)
class WrkRun:
    """One wrk run at one concurrency, as wrk's done() reported it."""

    connections: int
    command: list[str]
    requests: int
    duration_s: float
    errors: dict[str, int]
    latency_ms: dict[str, float]
    latency_ms_wrk_corrected: dict[str, float]
    latency_samples: int

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def as_dict(self, items: int) -> dict[str, Any]:
        req_s = self.requests / self.duration_s if self.duration_s else 0.0
        return {
            "concurrency": self.connections,
            "requests": self.requests,
            "duration_s": round(self.duration_s, 3),
            "req_s": round(req_s, 1),
            "items_s": round(req_s * items, 1),
            "latency_ms": self.latency_ms,
            "latency_ms_wrk_corrected": self.latency_ms_wrk_corrected,
            "latency_samples": self.latency_samples,
            "errors": self.errors,
            "error_count": self.error_count,
            "command": self.command,
        }


def wrk_path() -> str:
    path = shutil.which("wrk")
    if not path:
        raise WrkMissing(INSTALL_HINT)
    return path


def _lua_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def write_script(folder: Path, requests: list[InferRequest]) -> tuple[Path, list[str]]:
    """The Lua script, and wrk's script arguments: one `HEADERLEN:FILE` per request body
    (HEADERLEN is Inference-Header-Content-Length, `-` for JSON bodies)."""
    folder.mkdir(parents=True, exist_ok=True)
    first = requests[0]
    common = {k: v for k, v in first.headers.items() if k != HEADER_LENGTH}
    arguments = []
    for index, request in enumerate(requests):
        if request.path != first.path or {k: v for k, v in request.headers.items() if k != HEADER_LENGTH} != common:
            raise ValueError("wrk requests must share path and headers (but the binary header length)")
        path = folder / f"body-{index:03d}.bin"
        path.write_bytes(request.body)
        arguments.append(f"{request.headers.get(HEADER_LENGTH, '-')}:{path}")
    headers = "{" + ", ".join(f"[{_lua_string(k)}] = {_lua_string(v)}" for k, v in common.items()) + "}"
    script = folder / "post.lua"
    script.write_text(_LUA % {
        "path": _lua_string(first.path),
        "headers": headers,
        "header_length": _lua_string(HEADER_LENGTH),
        "percentiles": ", ".join(f"{p:g}" for p in PERCENTILES),
        "marker": MARKER,
    })
    return script, arguments


def parse_output(stdout: str) -> dict[str, Any]:
    for line in stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    raise RuntimeError(f"wrk printed no {MARKER.strip()} line; its output was:\n{stdout[-2000:]}")


def parse_histogram(text: str) -> np.ndarray:
    """"value:count,..." → counts indexed by latency in microseconds."""
    if not text:
        return np.zeros(0, dtype=np.int64)
    pairs = np.array([[int(v) for v in item.split(":")] for item in text.split(",")], dtype=np.int64)
    counts = np.zeros(int(pairs[:, 0].max()) + 1, dtype=np.int64)
    counts[pairs[:, 0]] = pairs[:, 1]
    return counts


def percentile_us(counts: np.ndarray, p: float) -> int:
    """As wrk's stats_percentile: the smallest value whose cumulative count reaches round(p/100·n + 0.5)."""
    total = int(counts.sum())
    if total == 0:
        return 0
    rank = int(np.floor((p / 100.0) * total + 0.5 + 0.5))  # C round() of a positive number
    return int(np.searchsorted(np.cumsum(counts), rank))


def summarize(counts: np.ndarray) -> dict[str, float]:
    """Percentiles, min, mean, max in milliseconds."""
    total = int(counts.sum())
    if total == 0:
        return {}
    values = np.arange(len(counts))
    nonzero = np.nonzero(counts)[0]
    out = {f"p{p:g}": percentile_us(counts, p) / 1000 for p in PERCENTILES}
    out |= {"min": nonzero[0] / 1000, "mean": float((values * counts).sum() / total) / 1000,
            "max": nonzero[-1] / 1000}
    return {k: round(float(v), 3) for k, v in out.items()}


def run(
    url: str,
    script: Path,
    arguments: list[str],
    connections: int,
    duration_s: float,
    timeout_s: float = 10.0,
    cpu: int | None = None,
) -> WrkRun:
    """Run wrk once, one thread per connection. wrk takes whole seconds: the duration is rounded
    up (at least 1 s)."""
    seconds = max(1, math.ceil(duration_s))
    command = [
        wrk_path(), "-t", str(connections), "-c", str(connections),
        "-d", f"{seconds}s", "--timeout", f"{max(1, math.ceil(timeout_s))}s", "-s", str(script), url,
        "--", *arguments,
    ]
    if cpu is not None:
        taskset = shutil.which("taskset")
        if not taskset:
            raise WrkMissing("taskset is not installed (util-linux); it pins wrk with --generator-cpu")
        command = [taskset, "-c", str(cpu), *command]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=seconds + timeout_s + 30)
    if done.returncode != 0:
        raise RuntimeError(f"wrk exited with {done.returncode}: {done.stderr.strip() or done.stdout[-2000:]}")
    data = parse_output(done.stdout)
    measured = parse_histogram(data["histogram"])
    wrk_latency = data["wrk_latency_us"]
    wrk_ms = {f"p{k}": v / 1000 for k, v in wrk_latency["percentiles"].items()}
    wrk_ms |= {k: wrk_latency[k] / 1000 for k in ("min", "mean", "max")}
    return WrkRun(
        connections=connections,
        command=command,
        requests=int(data["requests"]),
        duration_s=data["duration_us"] / 1e6,
        errors={k: int(v) for k, v in data["errors"].items()},
        latency_ms=summarize(measured),
        latency_ms_wrk_corrected={k: round(v, 3) for k, v in wrk_ms.items()},
        latency_samples=int(measured.sum()),
    )
