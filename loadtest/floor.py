"""`bench floor`: the server against the HTTP floor of its own stack, in turn on one core.

The per-request cost target (10,000 req/s for the MLP at 64 clients, one core) was set on a
machine where a bare ASGI app on uvicorn and httptools (JSON parsed, no model) served 23,097
req/s: there, the target is 0.43 of that floor. On a shared machine whose speed drifts by half
within minutes, req/s alone says more about the machine than the server; the server's rate over
the floor's, both measured a minute apart on the same core under the same load, drifts less
(not nothing: the engine and the parser do not slow alike).

  floor      the bare app (loadtest/bareapp.py): read, parse, build the array, a constant answer
  batchline  `batchline serve` serving the MLP (ONNX Runtime, one thread, max batch 64, a 2 ms
             window), as the target's benchmark serves it

Both get the same static JSON body of one MLP item from wrk (its cheapest path: no Lua per
request, so the generator takes as little of its core as it can; its own CPU a request is
reported, so a generator that bounds a rate shows).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from loadtest import fanout, localserver, mlp, report, runs
from loadtest.mlp import write_mlp_model

SIDES = ("floor", "batchline")
TARGET_REQ_S = 10_000  # the target of record, at 64 clients
FLOOR_OF_RECORD_REQ_S = 23_097  # what the floor served where that target was set

HELP = f"""Serves the 256-float MLP with `batchline serve`, and a bare ASGI app on the same uvicorn,
httptools and uvloop that parses each body and builds its array but runs no model, one after the
other on --server-cpu, under the same wrk load on --generator-cpu, --rounds times. Reports each
one's req/s, p50/p99, its process's CPU per request and wrk's, and the server's rate over the
floor's in each round. The target of 10,000 req/s at 64 clients was set where such a floor (a bare
app on uvicorn and httptools) served {FLOOR_OF_RECORD_REQ_S:,} req/s: about {TARGET_REQ_S / FLOOR_OF_RECORD_REQ_S:.2f} of the floor here."""


def add_parser(modes: Any, parents: runs.Parents) -> None:
    parser = modes.add_parser("floor", help="the server against the HTTP floor of its stack, in turn on one core",
                              description=HELP, formatter_class=runs.Formatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for floor.json, floor.md and floor.png")
    parser.add_argument("--note", default="", help="free text stored in the report")
    parser.add_argument("--concurrency", type=runs.ints, default=[64], help="comma-separated connections")
    parser.add_argument("--duration", type=runs.positive, default=8.0, help="seconds per level")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each side's levels")
    parser.add_argument("--rounds", type=runs.count, default=3, help="both sides in turn, this many times")
    parser.add_argument("--server-cpu", type=int, default=0, metavar="N", help="the CPU both servers are pinned to")
    parser.add_argument("--generator-cpu", type=int, default=1, metavar="N", help="the CPU wrk is pinned to")
    parser.add_argument("--wrk-threads", type=int, default=2, help="wrk's threads")


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, str]:
    runs.require_wrk()
    parameters = {"model": f"{mlp.NAME} ({mlp.WIDTH} FP32 in, {mlp.CLASSES} out, max batch {mlp.MAX_BATCH}, "
                           f"{mlp.WINDOW_US / 1000:g} ms window, one engine thread)",
                  "concurrency": args.concurrency, "duration_s": args.duration, "warmup_s": args.warmup,
                  "rounds": args.rounds, "server_cpu": args.server_cpu, "generator_cpu": args.generator_cpu,
                  "wrk_threads": args.wrk_threads}
    record = runs.record(args, argv, parameters)
    levels: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="batchline-floor-") as folder:
        root = Path(folder)
        write_mlp_model(root / "models")
        script = root / "body.lua"
        script.write_text(fanout.static_body_script())
        for round_number, side in itertools.product(range(1, args.rounds + 1), SIDES):
            with served(side, root, args.server_cpu) as (url, pid):
                target = f"{url}/v2/models/{mlp.NAME}/infer"
                if args.warmup > 0:
                    fanout.wrk(target, script, max(args.concurrency), args.warmup, args.wrk_threads, args.generator_cpu)
                for connections in args.concurrency:
                    before = fanout.cpu_ticks([pid])[pid]
                    level = fanout.wrk(target, script, connections, args.duration, args.wrk_threads, args.generator_cpu)
                    spent = (fanout.cpu_ticks([pid])[pid] - before) / fanout.CLOCK_TICKS
                    level |= {"side": side, "round": round_number,
                              "cpu_us_per_request": round(spent * 1e6 / max(1, level["requests"]), 1)}
                    levels.append(level)
                    print(f"  round {round_number}, {side} c={connections}: {level['req_s']:,.0f} req/s, "
                          f"p50 {level['p50_ms']:.2f} ms, p99 {level['p99_ms']:.2f} ms, "
                          f"{level['cpu_us_per_request']:.1f} us CPU a request", file=sys.stderr)
    record["results"] = levels
    summary = ratio_summary(levels)
    medians = fanout.median_rates(levels, by="side")
    record["headline"] = {f"{side}@{connections}_req_s": rate for (side, connections), rate in medians.items()}
    record["headline"] |= {f"of_floor@{connections}": ratio for connections, ratio in median_ratios(levels).items()}
    record["notes"] += [
        ("of floor: the server's req/s over the floor's at the same concurrency in the same round. The target of "
         f"{TARGET_REQ_S:,} req/s at 64 clients was set where such a floor served {FLOOR_OF_RECORD_REQ_S:,}: "
         f"{TARGET_REQ_S / FLOOR_OF_RECORD_REQ_S:.2f} of it"),
        ("CPU us/request: the serving process's CPU time (user + system, /proc) over the level, per request "
         "served; wrk us/request: the load generator's own"),
        ("latency: wrk's own percentiles (--latency), which add coordinated-omission samples no request "
         "experienced (loadtest/wrk.py)"),
    ]
    return report.write(args.out, "floor", record, HEADERS, table_rows(levels), summary=summary,
                        plot=lambda path: plot(path, levels))


@contextlib.contextmanager
def served(side: str, root: Path, cpu: int) -> Iterator[tuple[str, int]]:
    """The side's server pinned to `cpu`: (its base URL, its pid)."""
    log_path = root / f"{side}.log"
    if side == "floor":
        port_file = root / "floor.port"
        port_file.unlink(missing_ok=True)
        started = localserver.started_process(
            [sys.executable, "-m", "loadtest.bareapp", "--port-file", str(port_file)], port_file,
            log_path=log_path, cpu=cpu, wait_path="/", startup_timeout_s=60)
    else:
        started = localserver.started_server(
            root / "models", "--engine-threads", "1", "--allow-grpc", "false", "--log-level", "warning",
            log_path=log_path, cpu=cpu)
    with started as server:
        yield server.url, server.process.pid


HEADERS = ["round", "side", "clients", "req/s", "of floor", "p50 ms", "p99 ms", "CPU us/request",
           "wrk us/request", "errors"]


def ratios(levels: list[dict[str, Any]]) -> list[float | None]:
    """Each server level's req/s over the floor's at its concurrency in its round (None for the
    floor's own levels, and where the round has no floor)."""
    floor = {(level["round"], level["concurrency"]): level["req_s"] for level in levels if level["side"] == "floor"}
    return [level["req_s"] / base if level["side"] != "floor" and (base := floor.get((level["round"], level["concurrency"])))
            else None for level in levels]


def _ratios_by_concurrency(levels: list[dict[str, Any]]) -> dict[int, list[float]]:
    per: dict[int, list[float]] = {}
    for level, ratio in zip(levels, ratios(levels), strict=True):
        if ratio is not None:
            per.setdefault(level["concurrency"], []).append(ratio)
    return per


def median_ratios(levels: list[dict[str, Any]]) -> dict[int, float]:
    return {c: round(float(np.median(values)), 3) for c, values in _ratios_by_concurrency(levels).items()}


def ratio_summary(levels: list[dict[str, Any]]) -> list[str]:
    """Per concurrency: the server's share of the floor, round by round, its median, and the
    rate that share is on the machine the target was set on."""
    medians = median_ratios(levels)
    lines = []
    for connections, values in _ratios_by_concurrency(levels).items():
        median = medians[connections]
        lines.append(f"at {connections} clients the server serves {', '.join(f'{r:.2f}' for r in values)} of the "
                     f"floor's rate by round, median {median:.2f} (where the floor served "
                     f"{FLOOR_OF_RECORD_REQ_S:,} req/s: {median * FLOOR_OF_RECORD_REQ_S:,.0f} req/s)")
    return lines


def table_rows(levels: list[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for level, ratio in zip(levels, ratios(levels), strict=True):
        wrk_cpu = level["wrk_cpu_us_per_request"]
        rows.append([level["round"], level["side"], level["concurrency"], level["req_s"],
                     round(ratio, 2) if ratio is not None else "", level["p50_ms"], level["p99_ms"],
                     level["cpu_us_per_request"], wrk_cpu if wrk_cpu is not None else "", level["errors"]])
    return rows


def plot(path: Path, levels: list[dict[str, Any]]) -> None:
    fig, (rates, shares) = report.panels("the server against the HTTP floor of its stack, one core", 2)
    for side in SIDES:
        mine = [level for level in levels if level["side"] == side]
        rates.plot([f"r{level['round']} c{level['concurrency']}" for level in mine], [level["req_s"] for level in mine],
                   "o-", label=side)
    rates.set_ylabel("req/s")
    rates.legend(fontsize=8)
    for connections, values in _ratios_by_concurrency(levels).items():
        shares.plot(range(1, len(values) + 1), values, "o-", label=f"{connections} clients")
    report.hline(shares, TARGET_REQ_S / FLOOR_OF_RECORD_REQ_S, "the target's share")
    shares.set_xlabel("round")
    shares.set_ylabel("server req/s / floor req/s")
    shares.legend(fontsize=8)
    report.save(fig, path)
