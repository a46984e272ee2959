"""`bench fanout`: how many cores feed one device. One server process, `--http-workers N`, and N
whole servers sharing the port, each against the same GPU stand-in, in one run.

  single    one server process: HTTP, batching and the device on one event loop
  workers   `--http-workers N`: N front-end processes parse and encode; one server process
            batches across all of them and owns the device
  replicas  N whole servers on one port (SO_REUSEPORT), each with its own batcher and its own
            copy of the model, taking turns on the one device

The model is the 256-float MLP (loadtest/mlp.py); its device is the stand-in (loadtest/standin.py):
a batch holds one device for --fixed-us + --item-us per row of wall time, as a GPU kernel does,
and spends no CPU, so the cores measured are the server's alone. wrk sends one static JSON body
(its cheapest path: the load generator takes as little of the machine as it can); its latency
percentiles are wrk's own. Each row also says the mean batch size the device saw, the CPU each
part spent per request (from /proc), wrk's own CPU per request and the cores left idle: on a
machine where the load generator shares the cores, what bounds a layout's rate. `--rounds N`
takes the layouts in turn N times, each round's ratios against its own single process.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from loadtest import localserver, mlp, report, runs, signals
from loadtest import wrk as wrk_runs
from loadtest.mlp import write_mlp_model

LAYOUTS = ("single", "workers", "replicas")
MODEL = mlp.NAME
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # what /proc's utime and stime count per second

HELP = """Measures one server process, --http-workers N and N whole servers on one port, closed loop
with wrk at each --concurrency, against a GPU stand-in whose batches cost wall time, not CPU
(--fixed-us + --item-us per row). Reports req/s, p50/p99, the mean batch size, the CPU each
process spent per request, and each layout's rate against the single process's."""


def add_parser(modes: Any, parents: runs.Parents) -> None:
    parser = modes.add_parser("fanout", help="one device fed by 1 or N processes (--http-workers vs N servers)",
                              description=HELP, formatter_class=runs.Formatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for fanout.json, fanout.md and fanout.png")
    parser.add_argument("--note", default="", help="free text stored in the report")
    parser.add_argument("--workers", type=int, default=2, help="N: front-end processes, and whole servers")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--concurrency", type=runs.ints, default=[64, 256], help="comma-separated connections")
    parser.add_argument("--duration", type=runs.positive, default=10.0, help="seconds per level")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each layout's levels")
    parser.add_argument("--fixed-us", type=float, default=1000.0, help="the stand-in device's cost per batch")
    parser.add_argument("--item-us", type=float, default=10.0, help="the stand-in device's cost per row")
    parser.add_argument("--wrk-threads", type=int, default=2, help="wrk's threads")
    parser.add_argument("--rounds", type=runs.count, default=1,
                        help="every layout in turn, this many times: on a machine whose speed drifts, each "
                             "round's ratios compare runs minutes apart, not a whole run apart")


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, str]:
    runs.require_wrk()
    layouts = [layout for layout in args.layouts.split(",") if layout]
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        raise SystemExit(f"bench fanout: unknown layouts {unknown} (of {', '.join(LAYOUTS)})")
    parameters = {"model": f"{MODEL} ({mlp.WIDTH} FP32 in, {mlp.CLASSES} out, max batch {mlp.MAX_BATCH}, "
                           f"{mlp.WINDOW_US / 1000:g} ms window)", "workers": args.workers,
                  "layouts": layouts, "concurrency": args.concurrency, "duration_s": args.duration,
                  "warmup_s": args.warmup, "fixed_us": args.fixed_us, "item_us": args.item_us,
                  "wrk_threads": args.wrk_threads, "rounds": args.rounds}
    record = runs.record(args, argv, parameters)
    levels: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="batchline-fanout-") as folder:
        root = Path(folder)
        repository = root / "models"
        write_mlp_model(repository)
        script = root / "body.lua"
        script.write_text(static_body_script())
        environment = {"STANDIN_FIXED_US": str(args.fixed_us), "STANDIN_ITEM_US": str(args.item_us),
                       "STANDIN_DEVICE_LOCK": str(root / "device.lock")}
        for round_number, layout in itertools.product(range(1, args.rounds + 1), layouts):
            with servers(layout, args.workers, repository, root, environment) as (url, stats_of, processes):
                target = f"{url}/v2/models/{MODEL}/infer"
                if args.warmup > 0:
                    wrk(target, script, max(args.concurrency), args.warmup, args.wrk_threads)
                for connections in args.concurrency:
                    serving, front_ends = processes()
                    before = stats_of(), cpu_ticks([*serving, *front_ends])
                    idle_before, started = idle_ticks(), time.monotonic()
                    level = wrk(target, script, connections, args.duration, args.wrk_threads)
                    idle_cores = (idle_ticks() - idle_before) / CLOCK_TICKS / (time.monotonic() - started)
                    serving, front_ends = processes()  # a front end restarted meanwhile is counted from 0
                    after = stats_of(), cpu_ticks([*serving, *front_ends])
                    level |= {"layout": layout, "round": round_number, "processes": len(after[1]),
                              "idle_cores": round(idle_cores, 2)}
                    level |= measured_costs(before, after, frozenset(front_ends))
                    levels.append(level)
                    print(f"  round {round_number}, {layout} c={connections}: {level['req_s']:,.0f} req/s, p50 {level['p50_ms']:.2f} ms, "
                          f"p99 {level['p99_ms']:.2f} ms, mean batch {level['mean_batch']:.1f}", file=sys.stderr)
    record["results"] = levels
    record["headline"] = {f"{layout}@{connections}_req_s": rate for (layout, connections), rate in median_rates(levels).items()}
    record["notes"] += [
        (f"N = {args.workers}; the device: {args.fixed_us:g} us per batch + {args.item_us:g} us per row, one batch "
         "at a time across every process"),
        ("x single: req/s over the single process's at the same concurrency, in the same round; with several "
         "rounds, the headline figures are each layout's median"),
        ("CPU us/request: CPU time of every server process (user + system) over the level, per request served; "
         "front ends: the --http-workers processes together"),
        (f"wrk us/request: the load generator's own CPU time per request it counted; cores idle: of every "
         f"core the machine has online ({os.cpu_count()}), over the level (/proc/stat), more than processes "
         "held to fewer cores (taskset, a container's limit) could use. On C cores shared with wrk, a layout "
         "serves at most C / (its CPU us/request + wrk's) requests a microsecond; one process, at most 1 / its "
         "own (one core)"),
        ("latency: wrk's own percentiles (--latency), which add coordinated-omission samples no request "
         "experienced (loadtest/wrk.py); the other closed-loop tables time each request instead"),
    ]
    return report.write(args.out, "fanout", record, HEADERS, table_rows(levels), summary=ratio_summary(levels),
                        plot=lambda path: plot(path, levels))


def static_body_script() -> str:
    """A wrk script that only sets the request: wrk then calls no Lua per request."""
    rng = np.random.default_rng(0)
    body = json.dumps({"inputs": [{"name": mlp.INPUT, "datatype": "FP32", "shape": [1, mlp.WIDTH],
                                   "data": [round(float(v), 4) for v in rng.uniform(-1, 1, mlp.WIDTH)]}]})
    return (f'wrk.method = "POST"\nwrk.body = {json.dumps(body)}\n'
            'wrk.headers["Content-Type"] = "application/json"\n')


Stats = dict[str, int]
Processes = tuple[list[int], list[int]]  # the server processes' pids, the front ends' pids


@contextlib.contextmanager
def servers(layout: str, workers: int, repository: Path, root: Path,
            environment: dict[str, str]) -> Iterator[tuple[str, Callable[[], Stats], Callable[[], Processes]]]:
    """The layout's server(s), started under the stand-in: (base URL, a function reading the
    model's statistics summed over servers, one listing the pids of the server processes and of
    the --http-workers front ends, from one look)."""
    launcher = ("-m", "loadtest.standin", "serve")
    common = ("--engine-threads", "1", "--log-level", "warning")
    with contextlib.ExitStack() as stack:
        if layout == "replicas":
            first = stack.enter_context(localserver.started_server(
                repository, *common, "--grpc-port-file", str(root / "grpc-0"), log_path=root / "replica-0.log",
                launcher=launcher, environment={**environment, "STANDIN_REUSE_PORT": "1"}))
            port = int(first.url.rsplit(":", 1)[1])
            replicas = [first]
            for index in range(1, workers):
                replicas.append(stack.enter_context(localserver.started_server(
                    repository, *common, "--grpc-port-file", str(root / f"grpc-{index}"),
                    log_path=root / f"replica-{index}.log", launcher=launcher, port=port,
                    environment={**environment, "STANDIN_REUSE_PORT": "1"})))
            grpc_ports = [replica_ready(root / f"grpc-{index}", replica.process)
                          for index, replica in enumerate(replicas)]
            yield (first.url, lambda: sum_stats([grpc_stats(p) for p in grpc_ports]),
                   lambda: ([r.process.pid for r in replicas], []))
        else:
            extra = ("--http-workers", str(workers)) if layout == "workers" else ()
            server = stack.enter_context(localserver.started_server(
                repository, *common, *extra, "--allow-grpc", "false", log_path=root / f"{layout}.log",
                launcher=launcher, environment=environment))
            yield (server.url, lambda: http_stats(server.url),
                   lambda: ([server.process.pid], children(server.process.pid)))


def replica_ready(port_file: Path, process: Any, timeout_s: float = 300) -> int:
    """The gRPC port of one replica, once that replica is ready: its HTTP readiness may have been
    answered by another one on the shared port."""
    import grpc

    from server.grpc.protos import grpc_service_pb2 as pb
    from server.grpc.protos import grpc_service_pb2_grpc as pb_grpc

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"bench fanout: a replica exited with {process.returncode}")
        if port_file.is_file():
            port = int(port_file.read_text())
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                try:
                    if pb_grpc.GRPCInferenceServiceStub(channel).ServerReady(pb.ServerReadyRequest(), timeout=5).ready:
                        return port
                except grpc.RpcError:
                    pass
        time.sleep(0.2)
    raise SystemExit("bench fanout: a replica did not become ready in time")


def http_stats(url: str) -> Stats:
    stats = signals.read_stats(url, MODEL, timeout=10.0)
    if stats is None:
        raise SystemExit(f"bench fanout: {url} answers no statistics for {MODEL}")
    return {"items": int(stats["inference_count"]), "batches": int(stats["execution_count"]),
            "requests": int(stats["success_count"])}


def grpc_stats(port: int) -> Stats:
    import grpc

    from server.grpc.protos import grpc_service_pb2 as pb
    from server.grpc.protos import grpc_service_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = pb_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(pb.ModelStatisticsRequest(name=MODEL), timeout=10)
    stats = reply.model_stats[0]
    return {"items": stats.inference_count, "batches": stats.execution_count,
            "requests": stats.inference_stats.success.count}


def sum_stats(each: list[Stats]) -> Stats:
    return {key: sum(stats[key] for stats in each) for key in each[0]}


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def cpu_ticks(pids: list[int]) -> dict[int, int]:
    """CPU time (user + system, in clock ticks) of each process still running."""
    ticks = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks[pid] = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return ticks


def idle_ticks() -> int:
    """The machine's idle time so far, every core's together, in clock ticks (idle + iowait)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(fields[4]) + int(fields[5])


def measured_costs(before: tuple[Stats, dict[int, int]], after: tuple[Stats, dict[int, int]],
                   front_ends: frozenset[int]) -> dict[str, Any]:
    """The level's mean batch size and each process's CPU per request served; `front_ends`:
    the pids of --http-workers processes, counted apart from the server processes."""
    (stats_0, ticks_0), (stats_1, ticks_1) = before, after
    served = max(1, stats_1["requests"] - stats_0["requests"])
    batches = max(1, stats_1["batches"] - stats_0["batches"])
    per_request = {pid: (ticks_1[pid] - ticks_0.get(pid, 0)) / CLOCK_TICKS * 1e6 / served
                   for pid in ticks_1}
    return {"mean_batch": (stats_1["items"] - stats_0["items"]) / batches,
            "cpu_us_per_request": [round(per_request[pid], 1) for pid in sorted(per_request)],
            "cpu_us_per_request_total": round(sum(per_request.values()), 1),
            "cpu_us_per_request_servers": round(sum(v for p, v in per_request.items() if p not in front_ends), 1),
            "cpu_us_per_request_front_ends": round(sum(v for p, v in per_request.items() if p in front_ends), 1)}


_RATE = re.compile(r"Requests/sec:\s+([\d.]+)")
_PERCENTILE = re.compile(r"^\s+(50|75|90|99)%\s+([\d.]+)(us|ms|s)\s*$", re.MULTILINE)
_COUNT = re.compile(r"(\d+) requests in ")
_NON_2XX = re.compile(r"Non-2xx or 3xx responses:\s+(\d+)")
_SOCKET_ERRORS = re.compile(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)")
_UNIT_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def wrk(url: str, script: Path, connections: int, duration_s: float, threads: int,
        cpu: int | None = None) -> dict[str, Any]:
    """wrk with the static body of `script` (pinned to `cpu` if given): req/s, wrk's p50 and p99,
    errors, the requests it counted and its own CPU a request."""
    command = [wrk_runs.wrk_path(), "-t", str(min(threads, connections)), "-c", str(connections), "-d", f"{max(1, round(duration_s))}s",
               "--latency", "-s", str(script), url]
    if cpu is not None:
        command = ["taskset", "-c", str(cpu), *command]
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=duration_s + 60)
    # wrk's alone: no other child of this process is reaped meanwhile
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0 or not _RATE.search(done.stdout):
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr.strip() or done.stdout[-2000:]}")
    wrk_cpu_s = (children_after.ru_utime + children_after.ru_stime) - (children_before.ru_utime + children_before.ru_stime)
    counted = _COUNT.search(done.stdout)
    wrk_cpu_us = round(wrk_cpu_s * 1e6 / int(counted[1]), 1) if counted and int(counted[1]) else None
    percentiles = {f"p{p}_ms": round(float(v) * _UNIT_MS[unit], 3) for p, v, unit in _PERCENTILE.findall(done.stdout)}
    non_2xx = _NON_2XX.search(done.stdout)
    socket_errors = _SOCKET_ERRORS.search(done.stdout)
    return {"concurrency": connections, "req_s": round(float(_RATE.search(done.stdout)[1]), 1),  # type: ignore[index]
            "requests": int(counted[1]) if counted else 0,
            "p50_ms": percentiles.get("p50_ms", 0.0), "p99_ms": percentiles.get("p99_ms", 0.0),
            "errors": (int(non_2xx[1]) if non_2xx else 0) + (sum(map(int, socket_errors.groups())) if socket_errors else 0),
            "wrk_cpu_us_per_request": wrk_cpu_us,
            "command": command}


HEADERS = ["round", "layout", "clients", "req/s", "x single", "p50 ms", "p99 ms", "mean batch", "CPU us/request",
           "of it, front ends", "wrk us/request", "cores idle", "processes", "errors"]


def table_rows(levels: list[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for level, ratio in zip(levels, ratios(levels), strict=True):
        wrk_cpu = level["wrk_cpu_us_per_request"]
        rows.append([level["round"], level["layout"], level["concurrency"], level["req_s"],
                     round(ratio, 2) if ratio is not None else "",
                     level["p50_ms"], level["p99_ms"],
                     round(level["mean_batch"], 1), level["cpu_us_per_request_total"],
                     level["cpu_us_per_request_front_ends"], wrk_cpu if wrk_cpu is not None else "",
                     level["idle_cores"], level["processes"], level["errors"]])
    return rows


def ratios(levels: list[dict[str, Any]]) -> list[float | None]:
    """Each level's req/s over the single process's at its concurrency in its round (None
    without one)."""
    single = {(level["round"], level["concurrency"]): level["req_s"] for level in levels if level["layout"] == "single"}
    return [level["req_s"] / base if (base := single.get((level["round"], level["concurrency"]))) else None
            for level in levels]


def median_rates(levels: list[dict[str, Any]], by: str = "layout") -> dict[tuple[str, int], float]:
    """Each (level[by], concurrency)'s median req/s over the rounds (`by`: what was measured,
    the layout here, the side in `bench floor`)."""
    rates: dict[tuple[str, int], list[float]] = {}
    for level in levels:
        rates.setdefault((level[by], level["concurrency"]), []).append(level["req_s"])
    return {key: float(np.median(values)) for key, values in rates.items()}


def ratio_summary(levels: list[dict[str, Any]]) -> list[str]:
    """With more than one round: each layout's x single, round by round, and their median."""
    per_key: dict[tuple[str, int], list[float]] = {}
    for level, ratio in zip(levels, ratios(levels), strict=True):
        if ratio is not None and level["layout"] != "single":
            per_key.setdefault((level["layout"], level["concurrency"]), []).append(ratio)
    if max((len(v) for v in per_key.values()), default=0) < 2:
        return []
    return [f"{layout} at {connections} clients: x single {', '.join(f'{r:.2f}' for r in values)} by round, "
            f"median {float(np.median(values)):.2f}" for (layout, connections), values in per_key.items()]


def plot(path: Path, levels: list[dict[str, Any]]) -> None:
    fig, (rates, batches) = report.panels("one device fed by one or several processes", 2)
    counts = list(dict.fromkeys(level["concurrency"] for level in levels))
    layouts = list(dict.fromkeys(level["layout"] for level in levels))
    groups = [f"{c} clients" for c in counts]

    def per_layout(key: str) -> list[tuple[str, list[float]]]:
        """Each layout's median of `key` over the rounds, at each concurrency."""
        found: dict[tuple[str, int], list[float]] = {}
        for level in levels:
            found.setdefault((level["layout"], level["concurrency"]), []).append(level[key])
        return [(layout, [float(np.median(found[(layout, c)])) if (layout, c) in found else 0 for c in counts])
                for layout in layouts]

    report.grouped_bars(rates, groups, per_layout("req_s"))
    report.grouped_bars(batches, groups, per_layout("mean_batch"))
    rates.set_ylabel("served (req/s)")
    batches.set_ylabel("mean batch size on the device")
    report.save(fig, path)
