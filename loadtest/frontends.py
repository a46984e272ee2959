"""`bench frontends`: one model through each front end of one running server, in one run, so the
figures compare: KServe v2 over HTTP with JSON bodies and with binary tensors, Triton's gRPC
ModelInfer, and OpenAI's /v1/embeddings where the model serves it.

Each front end gets a C load generator, so the client is never what limits: wrk for the HTTP
ones (loadtest/wrk.py, latency timed per request by its Lua script), h2load (nghttp2) for gRPC,
which over h2c is an HTTP/2 POST of a gRPC frame. h2load sends one body again and again, so
every front end sends the same one request (the first of loadtest/payloads.py's), the gRPC one
carrying the very tensor bytes of the v2 binary body: the figures differ by front end alone.

h2load only sees HTTP statuses, and gRPC answers 200 even for a failed call (its status rides
in the trailers). So before the load one call goes through a real gRPC client and its answer is
checked, and each measured run is bracketed by the server's statistics extension: a call h2load
completed that the server does not count as a success was an error.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from loadtest import payloads, report, runs, wrk

FRONT_ENDS = ("v2-json", "v2-binary", "grpc", "openai")
GRPC_PATH = "/inference.GRPCInferenceService/ModelInfer"
GRPC_HEADERS = {"content-type": "application/grpc", "te": "trailers"}
OPENAI_PATH = "/v1/embeddings"
H2LOAD_INSTALL_HINT = (
    "h2load is not installed (needed by `bench frontends` for gRPC). On Debian/Ubuntu, as root: "
    "`apt-get update && apt-get install -y nghttp2-client`; then run this again."
)

HELP = """Measures one model through each front end of the server at --url (and its gRPC port at
--grpc-url), one after another in the same run: served req/s, items/s, p50/p99 latency and
errors, closed loop, at each --concurrency (clients, one connection each, each sending its next
request when its reply is back), after --warmup s of load at the highest.

  v2-json    POST /v2/models/M/infer, JSON body (wrk)
  v2-binary  the same with the binary tensor extension, binary output asked for (wrk)
  grpc       GRPCInferenceService/ModelInfer over h2c, raw_input_contents as tritonclient.grpc
             sends them (h2load -m 1: one stream per connection)
  openai     POST /v1/embeddings {"model": M, "input": TEXT}, the same sentences (wrk); only
             when GET /v1/models lists the model (minilm)

HTTP latency is timed per request by wrk's Lua script, gRPC latency from h2load's --log-file
(start of the stream to the end of its response): both on the client, both per request. Every
front end sends the same one request (h2load can send only one body). Before each front end's
load one request is checked (gRPC: through a real gRPC client, its status and
output shape). gRPC errors: h2load's failed or non-200 streams, plus the calls it completed that
the server's statistics (GET /v2/models/M/stats, success count, read before and after each
run) do not count as successes: so nothing else may send to the model meanwhile. Each level
starts once those counts stand still: a run's end leaves up to one request per client in the
server, which it still answers, to nobody. Pin the generators away from the server with
--generator-cpu (taskset)."""


# ---- the requests -------------------------------------------------------------------------------

def grpc_request(model: str, items: int = 1, offset: int = 0,
                 repository: Path = payloads.MODELS) -> Any:
    """The ModelInferRequest tritonclient.grpc would send for the v2 request at `offset`: each input's
    name, datatype and shape, its bytes in raw_input_contents. The bytes are the tail of the v2 binary
    body (FP32 little-endian; BYTES as 4-byte little-endian length + UTF-8), so both carry the same."""
    from server.grpc.protos import grpc_service_pb2 as pb

    binary = payloads.build_request(model, items, binary=True, offset=offset, repository=repository)
    split = int(binary.headers[payloads.HEADER_LENGTH])
    header, raw = json.loads(binary.body[:split]), binary.body[split:]
    request = pb.ModelInferRequest(model_name=model)
    position = 0
    for tensor in header["inputs"]:
        size = tensor["parameters"]["binary_data_size"]
        request.inputs.add(name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
        request.raw_input_contents.append(raw[position:position + size])
        position += size
    return request


def grpc_frame(message: bytes) -> bytes:
    """A gRPC length-prefixed message: flag 0 (not compressed), 4-byte big-endian length, the bytes."""
    return b"\x00" + struct.pack(">I", len(message)) + message


def read_frame(frame: bytes) -> bytes:
    """The message of one uncompressed gRPC frame (the inverse of grpc_frame)."""
    if len(frame) < 5 or frame[0] != 0:
        raise ValueError("not an uncompressed gRPC frame")
    (length,) = struct.unpack(">I", frame[1:5])
    if len(frame) != 5 + length:
        raise ValueError(f"frame holds {len(frame) - 5} bytes after its prefix, which says {length}")
    return frame[5:]


def openai_request(model: str, items: int = 1, offset: int = 0) -> payloads.InferRequest:
    """POST /v1/embeddings with the sentences the v2 request at `offset` carries: one sentence as a
    string, several as a list."""
    texts = [str(t) for t in payloads.items_for(model, items, offset).reshape(-1)]
    if payloads.SPECS[model][1] != "BYTES":
        raise ValueError(f"{model} takes no text: it has no OpenAI embeddings front end")
    body = json.dumps({"model": model, "input": texts[0] if items == 1 else texts},
                      separators=(",", ":"), ensure_ascii=False).encode()
    return payloads.InferRequest(model, items, False, OPENAI_PATH, body, {"Content-Type": "application/json"})


def http_request(front_end: str, model: str, items: int) -> payloads.InferRequest:
    if front_end == "openai":
        return openai_request(model, items)
    return payloads.build_request(model, items, binary=front_end == "v2-binary")


# ---- the checks before load ---------------------------------------------------------------------

def check_openai_response(model: str, items: int, status: int, body: bytes) -> str | None:
    """None when the reply is a 200 with `items` embeddings of the model's width; else why not."""
    if status != 200:
        return f"HTTP {status}: {body[:200]!r}"
    width = payloads.SPECS[model][3]
    try:
        data = json.loads(body)["data"]
        lengths = [len(d["embedding"]) for d in data]
    except (ValueError, KeyError, TypeError) as exc:
        return f"reply is not an OpenAI embeddings list: {exc!r}"
    if lengths != [width] * items:
        return f"embedding lengths {lengths}, expected {[width] * items}"
    return None


def check_grpc_response(model: str, items: int, response: Any) -> str | None:
    """None when the answer holds the model's output, shape [items, width], its raw bytes complete."""
    _, _, output_name, width = payloads.SPECS[model]
    names = [o.name for o in response.outputs]
    if output_name not in names:
        return f"no output {output_name!r} in the answer: {names}"
    index = names.index(output_name)
    output = response.outputs[index]
    if list(output.shape) != [items, width]:
        return f"output shape {list(output.shape)}, expected {[items, width]}"
    raw = response.raw_output_contents
    if len(raw) != len(names) or len(raw[index]) != items * width * 4:
        size = len(raw[index]) if index < len(raw) else 0
        return f"raw output of {size} bytes, expected {items * width * 4}"
    return None


def preflight_http(url: str, front_end: str, request: payloads.InferRequest, timeout: float) -> None:
    if front_end != "openai":
        runs.preflight(url, request, timeout)
        return
    status, _, body = runs.post(url, request.path, request.body, request.headers, timeout)
    problem = check_openai_response(request.model, request.items, status, body)
    if problem:
        raise SystemExit(f"bench: {url}{request.path} answers {request.model} wrongly: {problem}")


def preflight_grpc(target: str, model: str, items: int, request: Any, timeout: float) -> None:
    """One ModelInfer through grpc's own client, its answer checked: h2load cannot read gRPC statuses."""
    import grpc

    from server.grpc.protos import grpc_service_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise SystemExit(f"bench: gRPC ModelInfer at {target} failed: {exc.code()} {exc.details()}") from exc
    problem = check_grpc_response(model, items, response)
    if problem:
        raise SystemExit(f"bench: gRPC at {target} answers {model} wrongly: {problem}")


def openai_models(url: str, timeout: float = 5.0) -> list[str]:
    """The models GET /v1/models lists (none when the server has no OpenAI front end)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=timeout) as reply:
            return [m["id"] for m in json.loads(reply.read())["data"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def server_counts(url: str, model: str, timeout: float = 5.0) -> dict[str, int] | None:
    """The statistics extension's success and fail counts for `model`, summed over its versions."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v2/models/{model}/stats", timeout=timeout) as reply:
            entries = json.loads(reply.read())["model_stats"]
        return {key: sum(int(entry["inference_stats"][key]["count"]) for entry in entries)
                for key in ("success", "fail")}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def settled_counts(url: str, model: str, quiet_s: float = 0.3,
                   limit_s: float = 30.0) -> dict[str, int] | None:
    """The server's counts once they stop moving for `quiet_s` (at most `limit_s`). A run that ends
    leaves up to one request per client in the server, which it still answers to nobody: the next
    run must neither start under that backlog nor count its successes."""
    counts = server_counts(url, model)
    deadline = time.monotonic() + limit_s
    while counts is not None and time.monotonic() < deadline:
        time.sleep(quiet_s)
        again = server_counts(url, model)
        if again == counts:
            break
        counts = again
    return counts


# ---- h2load -------------------------------------------------------------------------------------

class H2loadMissing(RuntimeError):
    """h2load (or taskset, for pinning) is not on PATH."""


def h2load_path() -> str:
    path = shutil.which("h2load")
    if not path:
        raise H2loadMissing(H2LOAD_INSTALL_HINT)
    return path


def h2load_version() -> str | None:
    try:
        done = subprocess.run([h2load_path(), "--version"], check=False, capture_output=True, text=True,
                              timeout=10)
    except (H2loadMissing, OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else None


def h2load_command(target: str, body: Path, clients: int, duration_s: float, log: Path | None = None,
                   cpu: int | None = None, h2load: str = "h2load") -> list[str]:
    """h2load posting `body` as gRPC over h2c: `clients` connections of one stream each (as wrk's one
    request per connection), one thread, for whole seconds (as wrk). No --warm-up-time: its requests
    would reach the server but not the log, and the server's counts must bracket the logged run."""
    command = [h2load, "-c", str(clients), "-m", "1", "-t", "1", "-D", str(max(1, math.ceil(duration_s))),
               "-d", str(body)]
    for name, value in GRPC_HEADERS.items():
        command += ["-H", f"{name}: {value}"]
    if log is not None:
        command.append(f"--log-file={log}")
    command.append(f"http://{target}{GRPC_PATH}")
    if cpu is not None:
        command = ["taskset", "-c", str(cpu), *command]
    return command


_SUMMARY = re.compile(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
                      r"(\d+) errored, (\d+) timeout")


def parse_summary(stdout: str) -> dict[str, int]:
    """h2load's `requests:` line: total, started, done, succeeded, failed, errored, timeout."""
    match = _SUMMARY.search(stdout)
    if not match:
        raise RuntimeError(f"h2load printed no `requests:` line; its output was:\n{stdout[-2000:]}")
    keys = ("total", "started", "done", "succeeded", "failed", "errored", "timeout")
    return dict(zip(keys, (int(v) for v in match.groups())))


@dataclass(frozen=True)
class H2loadLog:
    """h2load's --log-file: a line per finished request (start µs since epoch, HTTP status, µs taken)."""

    statuses: np.ndarray
    latency_us: np.ndarray

    @classmethod
    def parse(cls, text: str) -> H2loadLog:
        rows = [line.split("\t") for line in text.splitlines() if line.strip()]
        statuses = np.array([int(r[1]) for r in rows], dtype=np.int64)
        latency = np.array([int(r[2]) for r in rows], dtype=np.int64)
        return cls(statuses, latency)

    @property
    def answered(self) -> int:
        """Requests with an HTTP status (failed streams, -1, have none)."""
        return int(np.count_nonzero(self.statuses > 0))

    @property
    def ok(self) -> int:
        return int(np.count_nonzero(self.statuses == 200))

    @property
    def not_ok(self) -> int:
        """Failed streams (status -1) and any status but 200."""
        return int(np.count_nonzero(self.statuses != 200))

    def latency_ms(self) -> dict[str, float]:
        """Percentiles, min, mean, max of the answered requests, as wrk.summarize computes them."""
        answered = self.latency_us[self.statuses > 0]
        return wrk.summarize(np.bincount(answered)) if len(answered) else {}


def grpc_errors(log: H2loadLog, summary: dict[str, int], before: dict[str, int] | None,
                after: dict[str, int] | None) -> dict[str, int]:
    """What went wrong in one h2load run. `grpc_status`: the 200s the server did not count as
    successes (a failed call is still HTTP 200), or its fail count if larger: a call h2load
    abandoned in flight at the end, that the server then finished, hides one error from the first
    figure, never from the second."""
    errors = {"http": max(log.not_ok, summary["failed"])}
    if before is None or after is None:
        errors["grpc_status"] = log.ok  # no statistics: nothing shows a call succeeded
    else:
        successes, failures = after["success"] - before["success"], after["fail"] - before["fail"]
        errors["grpc_status"] = max(0, log.ok - successes, failures)
    return errors


def run_h2load(target: str, body: Path, clients: int, duration_s: float, cpu: int | None,
               log: Path | None, timeout_s: float) -> tuple[list[str], str]:
    """One h2load run; its command and stdout. The log file is removed first: h2load appends to it."""
    command = h2load_command(target, body, clients, duration_s, log, cpu, h2load_path())
    if cpu is not None and not shutil.which("taskset"):
        raise H2loadMissing("taskset is not installed (util-linux); it pins h2load with --generator-cpu")
    if log is not None:
        log.unlink(missing_ok=True)
    seconds = max(1, math.ceil(duration_s))
    done = subprocess.run(command, check=False, capture_output=True, text=True,
                          timeout=seconds + timeout_s + 30)
    if done.returncode != 0:
        output = done.stderr.strip() or done.stdout[-2000:]
        raise RuntimeError(f"h2load exited with {done.returncode}: {output}")
    return command, done.stdout


# ---- one front end ------------------------------------------------------------------------------

def _level(front_end: str, generator: str, clients: int, requests: int, duration_s: float, items: int,
           latency_ms: dict[str, float], errors: dict[str, int], command: list[str],
           server: dict[str, Any]) -> dict[str, Any]:
    req_s = requests / duration_s if duration_s else 0.0
    return {
        "front_end": front_end, "generator": generator, "concurrency": clients, "requests": requests,
        "duration_s": round(duration_s, 3), "req_s": round(req_s, 1), "items_s": round(req_s * items, 1),
        "latency_ms": latency_ms, "errors": errors, "error_count": sum(errors.values()), "server": server,
        "command": command,
    }


def _bracket(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, Any]:
    if before is None or after is None:
        return {"successes": None, "failures": None}
    return {"successes": after["success"] - before["success"], "failures": after["fail"] - before["fail"]}


def h2load_level(log: H2loadLog, summary: dict[str, int], before: dict[str, int] | None,
                 after: dict[str, int] | None, clients: int, duration_s: float, items: int,
                 command: list[str]) -> dict[str, Any]:
    """One gRPC level from h2load's log and summary and the server's counts around the run. The
    rate is over h2load's whole seconds of -D, as h2load's own req/s."""
    level = _level("grpc", "h2load", clients, log.answered, max(1, math.ceil(duration_s)), items,
                   log.latency_ms(), grpc_errors(log, summary, before, after), command,
                   _bracket(before, after))
    level["h2load"] = summary | {"unanswered_at_stop": summary["started"] - summary["done"]}
    return level


def measure_http(args: argparse.Namespace, front_end: str, folder: Path) -> list[dict[str, Any]]:
    request = http_request(front_end, args.model, args.items)
    preflight_http(args.url, front_end, request, args.timeout)
    script, arguments = wrk.write_script(folder, [request])
    target = args.url.rstrip("/") + request.path
    if args.warmup > 0:
        wrk.run(target, script, arguments, max(args.concurrency), args.warmup, args.timeout,
                args.generator_cpu)
    levels = []
    for clients in args.concurrency:
        before = settled_counts(args.url, args.model, limit_s=args.timeout)
        result = wrk.run(target, script, arguments, clients, args.duration, args.timeout, args.generator_cpu)
        server = _bracket(before, server_counts(args.url, args.model))
        levels.append(_level(front_end, "wrk", clients, result.requests, result.duration_s, args.items,
                             result.latency_ms, result.errors, result.command, server))
        _progress(levels[-1])
    return levels


def measure_grpc(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    request = grpc_request(args.model, args.items)
    preflight_grpc(args.grpc_url, args.model, args.items, request, args.timeout)
    folder.mkdir(parents=True, exist_ok=True)
    body = folder / "body.grpc"
    body.write_bytes(grpc_frame(request.SerializeToString()))
    if args.warmup > 0:
        run_h2load(args.grpc_url, body, max(args.concurrency), args.warmup, args.generator_cpu, None,
                   args.timeout)
    levels = []
    for clients in args.concurrency:
        log_path = folder / f"h2load-c{clients}.log"
        before = settled_counts(args.url, args.model, limit_s=args.timeout)
        command, stdout = run_h2load(args.grpc_url, body, clients, args.duration, args.generator_cpu,
                                     log_path, args.timeout)
        after = server_counts(args.url, args.model)
        log = H2loadLog.parse(log_path.read_text() if log_path.exists() else "")  # none: nothing finished
        level = h2load_level(log, parse_summary(stdout), before, after, clients, args.duration, args.items,
                             command)
        levels.append(level)
        _progress(level)
    return levels


def _progress(level: dict[str, Any]) -> None:
    latency = level["latency_ms"]
    print(f"  {level['front_end']} c={level['concurrency']}: {level['req_s']:,.0f} req/s, "
          f"p50 {latency.get('p50', 0):.2f} ms, p99 {latency.get('p99', 0):.2f} ms, "
          f"errors {level['error_count']}", file=sys.stderr)


# ---- the mode -----------------------------------------------------------------------------------

def front_ends(text: str) -> list[str] | None:
    """--front-ends: a comma-separated subset of FRONT_ENDS, or `auto` (None: all the model has)."""
    if text.strip() == "auto":
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in FRONT_ENDS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated subset of {','.join(FRONT_ENDS)}, got {text!r}")
    return names


def grpc_target(text: str) -> str:
    """HOST:PORT from --grpc-url, which may carry a scheme (grpc://, http://)."""
    if "://" in text:
        parts = urlsplit(text)
        return f"{parts.hostname}:{parts.port or 8001}"
    return text


def add_parser(modes: Any, parents: runs.Parents) -> None:
    parser = modes.add_parser("frontends", parents=[parents.common, parents.items],
                              help="one model through each front end (v2 JSON and binary, gRPC, OpenAI)",
                              description=HELP, formatter_class=runs.Formatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's HTTP base URL")
    parser.add_argument("--grpc-url", type=grpc_target, default="127.0.0.1:8001",
                        help="the same server's gRPC address, HOST:PORT")
    parser.add_argument("--front-ends", type=front_ends, default="auto", metavar="LIST",
                        help=f"comma-separated subset of {','.join(FRONT_ENDS)}; auto: all of them, openai "
                             "only where GET /v1/models lists the model")
    parser.add_argument("--concurrency", type=runs.ints, default=[1, 64], help="comma-separated clients")
    parser.add_argument("--duration", type=runs.positive, default=10.0,
                        help="seconds per front end and concurrency (whole seconds: wrk and h2load round up)")
    parser.add_argument("--warmup", type=float, default=2.0,
                        help="seconds of load at the highest concurrency before each front end's levels "
                             "(0: none)")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds a request may take before it counts as an error")
    parser.add_argument("--generator-cpu", type=int, metavar="N", help="pin wrk and h2load to CPU N")


def _chosen(args: argparse.Namespace) -> list[str]:
    served = args.model in openai_models(args.url)
    if args.front_ends is None:
        return [f for f in FRONT_ENDS if f != "openai" or served]
    if "openai" in args.front_ends and not served:
        raise SystemExit(f"bench frontends: {args.url} does not serve {args.model} as /v1/embeddings "
                         "(GET /v1/models does not list it)")
    return [f for f in FRONT_ENDS if f in args.front_ends]


HEADERS = ["front end", "concurrency", "req/s", "items/s", "p50 ms", "p99 ms", "errors", "req/s vs v2-json"]


def table_rows(levels: list[dict[str, Any]]) -> list[list[Any]]:
    """One row per front end and concurrency; the last column: req/s over v2-json's at that concurrency."""
    base = {level["concurrency"]: level["req_s"] for level in levels if level["front_end"] == "v2-json"}
    rows = []
    for level in levels:
        reference = base.get(level["concurrency"])
        ratio = round(level["req_s"] / reference, 2) if reference else None
        latency = level["latency_ms"]
        rows.append([level["front_end"], level["concurrency"], level["req_s"], level["items_s"],
                     latency.get("p50"), latency.get("p99"), level["error_count"], ratio])
    return rows


def summary_lines(levels: list[dict[str, Any]]) -> list[str]:
    lines = []
    for clients in dict.fromkeys(level["concurrency"] for level in levels):
        parts = [f"{level['front_end']} {level['req_s']:,.0f}"
                 for level in levels if level["concurrency"] == clients]
        lines.append(f"{clients} client(s), req/s: " + ", ".join(parts))
    return lines


def notes(model: str, items: int, chosen: list[str], warmup_s: float) -> list[str]:
    out = [
        ("latency: per request on the client; HTTP timed by wrk's Lua script (send to complete reply), "
         "gRPC from h2load's --log-file (stream start to end of response); errors: wrk's "
         "connect/read/write/timeout and non-2xx, h2load's failed or non-200 streams plus the gRPC calls "
         "the server's success count does not cover"),
        ("the front ends ran one after another against the same server"
         + (f", each after {warmup_s:g} s of warm-up" if warmup_s > 0 else ", with no warm-up")
         + "; each level once the server had answered what the previous run left in flight"),
    ]
    sample = ""
    if payloads.SPECS[model][1] == "BYTES":
        sample = ": " + ", ".join(repr(str(t)) for t in payloads.items_for(model, items, 0).reshape(-1))
    out.append("every front end sent the same one request again and again (h2load can send only one body)"
               + sample)
    return out


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, str]:
    chosen = _chosen(args)
    if any(f != "grpc" for f in chosen):
        runs.require_wrk()
    if "grpc" in chosen:
        try:
            h2load_path()
        except H2loadMissing as exc:
            raise SystemExit(f"bench: {exc}") from exc
    parameters = {
        "url": args.url, "grpc_url": args.grpc_url, "model": args.model, "items": args.items,
        "front_ends": chosen, "concurrency": args.concurrency, "duration_s": args.duration,
        "warmup_s": args.warmup, "timeout_s": args.timeout,
        "generator_cpu": args.generator_cpu,
    }
    record = runs.record(args, argv, parameters)
    record["server"] = runs.server_info(args.url)
    record["generators"] = {"wrk": record["machine"].get("wrk"), "h2load": h2load_version()}
    levels: list[dict[str, Any]] = []
    for front_end in chosen:
        folder = args.out / front_end
        if front_end == "grpc":
            levels += measure_grpc(args, folder)
        else:
            levels += measure_http(args, front_end, folder)
    record["results"] = levels
    record["headline"] = {f"{level['front_end']}@{level['concurrency']}_req_s": level["req_s"]
                          for level in levels}
    record["notes"] += notes(args.model, args.items, chosen, args.warmup)

    def plot(path: Path) -> None:
        plot_front_ends(path, levels, args.model, args.items)

    return report.write(args.out, "frontends", record, HEADERS, table_rows(levels), summary_lines(levels),
                        plot)


def plot_front_ends(path: Path, levels: list[dict[str, Any]], model: str, items: int) -> None:
    """Bars per front end, grouped by concurrency: req/s on the left, p50 (solid) and p99 (hatched)
    on the right."""
    title = f"{model}, {items} item(s) per request, by front end (closed loop)"
    fig, (rates, latency) = report.panels(title, 2)
    names = list(dict.fromkeys(level["front_end"] for level in levels))
    counts = list(dict.fromkeys(level["concurrency"] for level in levels))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        mine = {level["concurrency"]: level for level in levels if level["front_end"] == name}
        xs = [c + (i - (len(names) - 1) / 2) * width for c in range(len(counts))]
        got = [mine.get(c) for c in counts]
        rates.bar(xs, [g["req_s"] if g else 0 for g in got], width, label=name, color=f"C{i}")
        latency.bar(xs, [g["latency_ms"].get("p99", 0) if g else 0 for g in got], width, color=f"C{i}",
                    alpha=0.35, hatch="//")
        latency.bar(xs, [g["latency_ms"].get("p50", 0) if g else 0 for g in got], width, color=f"C{i}",
                    label=name)
    for ax in (rates, latency):
        ax.set_xticks(range(len(counts)), [f"{c} client(s)" for c in counts])
    rates.set_ylabel("served (req/s)")
    rates.set_title("throughput", fontsize=9)
    rates.legend(fontsize=8)
    latency.set_ylabel("latency (ms): p50 solid, p99 hatched")
    latency.set_title("latency", fontsize=9)
    latency.legend(fontsize=8)
    report.save(fig, path)

