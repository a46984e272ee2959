"""Closed-loop load with wrk: C keep-alive connections, each sending its next request as soon as
the previous reply arrives.

Why wrk and not a Python client: the server under test answers thousands of requests per second
on one core; a Python client on the other core would saturate first and measure itself. wrk's
C event loop sends the pre-formatted bodies (loadtest/payloads.py, cycled) at a small fraction of
that cost, and its `done()` hook prints the latency percentiles, which we read back as JSON.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.payloads import HEADER_LENGTH, InferRequest

MARKER = "BATCHLINE_WRK_JSON "
PERCENTILES = (50.0, 75.0, 90.0, 99.0, 99.9)
INSTALL_HINT = (
    "wrk is not installed (needed by `closed` and `batching`). On Debian/Ubuntu, as root: "
    "`apt-get update && apt-get install -y wrk`; then run this again."
)

_LUA = r"""-- Written by loadtest/wrk.py. POSTs the bodies given after `--` (HEADERLEN:FILE), in turn,
-- and prints one JSON line of totals and latency percentiles (microseconds) when done.
local path = %(path)s
local headers = %(headers)s
local formatted = {}
local counter = 0

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
end

function request()
  counter = counter %% #formatted + 1
  return formatted[counter]
end

function done(summary, latency, _)
  local e = summary.errors
  local p = {}
  for _, q in ipairs({%(percentiles)s}) do
    table.insert(p, string.format('"%%g":%%d', q, latency:percentile(q)))
  end
  io.write(string.format(
    '%(marker)s{"requests":%%d,"duration_us":%%d,"bytes":%%d,' ..
    '"errors":{"connect":%%d,"read":%%d,"write":%%d,"status":%%d,"timeout":%%d},' ..
    '"latency_us":{"min":%%d,"mean":%%.1f,"max":%%d,"stdev":%%.1f,"percentiles":{%%s}}}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency.min, latency.mean, latency.max, latency.stdev, table.concat(p, ",")))
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


def run(
    url: str,
    script: Path,
    arguments: list[str],
    connections: int,
    duration_s: float,
    threads: int = 1,
    timeout_s: float = 10.0,
    cpu: int | None = None,
) -> WrkRun:
    """Run wrk once. wrk takes whole seconds, so the duration is rounded up (at least 1 s)."""
    seconds = max(1, math.ceil(duration_s))
    command = [
        wrk_path(), "-t", str(max(1, min(threads, connections))), "-c", str(connections),
        "-d", f"{seconds}s", "--timeout", f"{max(1, math.ceil(timeout_s))}s", "-s", str(script), url,
        "--", *arguments,
    ]
    if cpu is not None:
        taskset = shutil.which("taskset")
        if not taskset:
            raise WrkMissing("taskset is not installed (util-linux); it pins wrk with --generator-cpu")
        command = [taskset, "-c", str(cpu), *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + timeout_s + 30)
    if done.returncode != 0:
        raise RuntimeError(f"wrk exited with {done.returncode}: {done.stderr.strip() or done.stdout[-2000:]}")
    data = parse_output(done.stdout)
    latency = data["latency_us"]
    latency_ms = {f"p{k}": v / 1000 for k, v in latency["percentiles"].items()}
    latency_ms.update({k: latency[k] / 1000 for k in ("min", "mean", "max", "stdev")})
    return WrkRun(
        connections=connections,
        command=command,
        requests=int(data["requests"]),
        duration_s=data["duration_us"] / 1e6,
        errors={k: int(v) for k, v in data["errors"].items()},
        latency_ms={k: round(v, 3) for k, v in latency_ms.items()},
    )
