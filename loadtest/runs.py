"""What every bench mode shares: the run record, the check before load, the closed-loop sweep.

Kept apart from bench.py (the command line) so that each mode's module (capacity, compare,
batchsize, precision) can use them without importing the command line that imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import shlex
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from loadtest import machine, payloads


def ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of positive integers, got {text!r}")
    return values


def floats(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of positive numbers, got {text!r}")
    return values


def positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


@dataclasses.dataclass(frozen=True)
class Parents:
    """The option groups modes share (argparse parents), built once by bench.build_parser."""

    common: argparse.ArgumentParser  # --model, --out, --note
    http: argparse.ArgumentParser  # --binary, --timeout, --bodies, --generator-cpu
    items: argparse.ArgumentParser  # --items
    wrk: argparse.ArgumentParser  # --concurrency, --warmup


def record(args: argparse.Namespace, argv: list[str], parameters: dict[str, Any]) -> dict[str, Any]:
    """The head of every report: mode, exact command line, machine, parameters."""
    return {
        "mode": args.mode,
        "command_line": shlex.join([sys.executable, "-m", "loadtest.bench", *argv]),
        "cwd": os.getcwd(),
        "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "note": args.note,
        "machine": machine.machine_record(),
        "parameters": parameters,
        "notes": [],
    }


def served_as(requests: list[payloads.InferRequest], name: str | None) -> list[payloads.InferRequest]:
    """The same bodies, posted to model `name` (another server may serve the model under another name)."""
    if not name:
        return requests
    return [dataclasses.replace(r, path=f"/v2/models/{name}/infer") for r in requests]


def server_info(url: str, timeout: float = 5.0) -> dict[str, Any] | None:
    """GET /v2 (server name, version, extensions): which server a figure belongs to."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v2", timeout=timeout) as reply:
            return json.loads(reply.read())
    except (OSError, ValueError):
        return None


def post(url: str, path: str, body: bytes, headers: dict[str, str], timeout: float) -> tuple[int, dict[str, str], bytes]:
    """POST `body` and read the answer, whatever its status: (status, headers, body). SystemExit
    when no server answers."""
    http = urllib.request.Request(url.rstrip("/") + path, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(http, timeout=timeout) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()
    except OSError as exc:
        raise SystemExit(f"bench: no server answers at {url} ({exc}); see --help") from exc


def preflight(url: str, request: payloads.InferRequest, timeout: float) -> None:
    """One request, its reply checked, before any load: a sweep against a wrong server is void."""
    status, headers, body = post(url, request.path, request.body, request.headers, timeout)
    problem = payloads.check_response(request.model, request.items, status, headers, body)
    if problem:
        raise SystemExit(f"bench: {url}{request.path} answers {request.model} wrongly: {problem}")


def require_wrk() -> None:
    from loadtest import wrk

    try:
        wrk.wrk_path()
    except wrk.WrkMissing as exc:
        raise SystemExit(f"bench: {exc}") from exc


def pin_generator(cpu: int | None) -> None:
    """Pin this process (the Python load generator) to one CPU, away from the server."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def closed_sweep(url: str, requests: list[payloads.InferRequest], concurrency: list[int], duration_s: float,
                 warmup_s: float, timeout_s: float, cpu: int | None, folder: Path) -> list[dict[str, Any]]:
    """wrk at each concurrency level (after a warm-up at the highest); one dict per level."""
    from loadtest import wrk

    preflight(url, requests[0], timeout_s)
    script, arguments = wrk.write_script(folder, requests)
    target = url.rstrip("/") + requests[0].path
    if warmup_s > 0:
        wrk.run(target, script, arguments, max(concurrency), warmup_s, timeout_s, cpu)
    levels = []
    for connections in concurrency:
        result = wrk.run(target, script, arguments, connections, duration_s, timeout_s, cpu)
        levels.append(result.as_dict(requests[0].items))
        print(f"  c={connections}: {levels[-1]['req_s']:,.0f} req/s, p50 {levels[-1]['latency_ms']['p50']:.2f} ms, "
              f"p99 {levels[-1]['latency_ms']['p99']:.2f} ms, errors {levels[-1]['error_count']}", file=sys.stderr)
    return levels


def closed_row(level: dict[str, Any]) -> list[Any]:
    latency = level["latency_ms"]
    return [level["concurrency"], level["req_s"], level["items_s"], latency["p50"], latency["p90"],
            latency["p99"], level["error_count"]]


CLOSED_HEADERS = ["concurrency", "req/s", "items/s", "p50 ms", "p90 ms", "p99 ms", "errors"]
CLOSED_NOTES = [
    ("latency: each request timed by the wrk Lua script, send to complete reply, on the client "
     "(one wrk thread per connection); latency_ms_wrk_corrected in the JSON is wrk's own histogram, "
     "which adds coordinated-omission samples no request experienced (see loadtest/wrk.py)"),
    "errors: wrk's connect/read/write/timeout errors plus non-2xx replies",
]
