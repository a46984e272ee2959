"""`bench batchsize`: the classic exercise, client-side batches of 1..64 items per request.

A client that batches pays latency per request to get items/s; the server's batcher does the
same on its side. This sweep shows the trade for one concurrency (or a few): per items-per-request
size, wrk's req/s, items/s, latency, and how busy the model's instances were (the busy seconds the
server exports at /metrics), so "faster" can be told apart from "the engine was idle anyway".
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from loadtest import payloads, report, runs, signals

HELP = """For each --sizes value N (items, i.e. batch rows, per request) and each --concurrency level,
runs wrk against --url for --duration s with N-item requests (the bodies of `closed --items N`), after
one --warmup at the first size. Reports req/s, items/s, p50/p99 latency per request, errors, and,
from the server's counters over each level: the instance busy share (batchline_instance_busy_seconds_total
at /metrics: busy seconds / elapsed / instances; "n/a" when the server does not export it) and
the items per executed batch (statistics extension). Needs wrk (see `closed --help`). A size above
the model's max_batch_size is refused by the server (400): the preflight says so."""


def add_parser(modes: Any, parents: runs.Parents) -> None:
    parser = modes.add_parser("batchsize", parents=[parents.common, parents.http],
                              help="client-side batch sizes: latency, items/s, busy share",
                              description=HELP, formatter_class=runs.Formatter)
    # its own options, not the shared wrk parent's: set_defaults would change them for every mode
    parser.add_argument("--concurrency", type=runs.ints, default=[1], help="comma-separated connection counts")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of load before the sweep (0: none)")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--sizes", type=runs.ints, default=[1, 8, 16, 32, 64], help="items per request, comma-separated")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per level")


def measure(args: argparse.Namespace, items: int, concurrency: int, warmup_s: float) -> dict[str, Any]:
    """One wrk run with `items`-item requests, bracketed by the server's counters."""
    from loadtest import wrk

    requests = payloads.build_requests(args.model, items, args.binary, args.bodies)
    runs.preflight(args.url, requests[0], args.timeout)
    script, arguments = wrk.write_script(args.out / f"wrk-{items}", requests)
    target = args.url.rstrip("/") + requests[0].path
    if warmup_s > 0:
        wrk.run(target, script, arguments, concurrency, warmup_s, args.timeout, args.generator_cpu)
    before = signals.snapshot(args.url, args.model)
    level = wrk.run(target, script, arguments, concurrency, args.duration, args.timeout, args.generator_cpu).as_dict(items)
    after = signals.snapshot(args.url, args.model)
    level["items"] = items
    level["signals"] = signals.window(before, after, args.model)
    print(f"  {items} item(s) x c={concurrency}: {level['items_s']:,.0f} items/s, p99 {level['latency_ms']['p99']} ms, "
          f"busy {level['signals'].get('busy_fraction')}", file=sys.stderr)
    return level


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, str]:
    runs.require_wrk()
    parameters = {"url": args.url, "model": args.model, "binary": args.binary, "sizes": args.sizes,
                  "concurrency": args.concurrency, "duration_s": args.duration, "warmup_s": args.warmup,
                  "timeout_s": args.timeout, "bodies": args.bodies, "generator_cpu": args.generator_cpu}
    record = runs.record(args, argv, parameters)
    record["server"] = runs.server_info(args.url)
    levels: list[dict[str, Any]] = []
    for index, items in enumerate(args.sizes):
        for concurrency in args.concurrency:
            levels.append(measure(args, items, concurrency, args.warmup if index == 0 and not levels else 0))
            time.sleep(0.2)
    record["results"] = levels
    best = max(levels, key=lambda level: level["items_s"])
    busy_known = any(level["signals"].get("busy_fraction") is not None for level in levels)
    record["headline"] = {"peak_items_s": best["items_s"], "at_items": best["items"], "at_concurrency": best["concurrency"],
                          "busy_share_source": "/metrics" if busy_known else None}
    record["notes"] += [*runs.CLOSED_NOTES,
                        ("busy: batchline_instance_busy_seconds_total over the level / elapsed / instances (/metrics); "
                        "items/batch: inference_count / execution_count over the level (statistics extension)")]
    if not busy_known:
        record["notes"].append("busy share n/a: the server exports no batchline_instance_busy_seconds_total at /metrics")
    headers = ["items/request", "concurrency", "req/s", "items/s", "p50 ms", "p99 ms", "errors", "busy", "items/batch"]

    def busy(level: dict[str, Any]) -> Any:
        value = level["signals"].get("busy_fraction")
        return "n/a" if value is None else value

    rows = [[level["items"], level["concurrency"], level["req_s"], level["items_s"], level["latency_ms"]["p50"],
             level["latency_ms"]["p99"], level["error_count"], busy(level),
             (level["signals"].get("stats") or {}).get("items_per_execution")] for level in levels]
    summary = [(f"peak {best['items_s']:,.0f} items/s with {best['items']} items per request at concurrency "
               f"{best['concurrency']} (p99 {best['latency_ms']['p99']} ms)")]

    def plot(path: Path) -> None:
        fig, (left, right) = report.panels(f"{args.model}: items per request ({'binary' if args.binary else 'JSON'})", 2)
        twin = left.twinx() if busy_known else None
        for concurrency in args.concurrency:
            mine = [level for level in levels if level["concurrency"] == concurrency]
            sizes = [level["items"] for level in mine]
            left.plot(sizes, [level["items_s"] for level in mine], "o-", label=f"items/s, c={concurrency}")
            report.latency_curves(right, sizes, [level["latency_ms"] for level in mine], label=f"c={concurrency}",
                                  keys=("p50", "p99"))
            if twin is not None:
                twin.plot(sizes, [level["signals"].get("busy_fraction") for level in mine], "s:", color="tab:grey",
                          label=f"busy share, c={concurrency}")
                twin.set_ylim(0, 1.05)
                twin.set_ylabel("instance busy share")
                twin.legend(fontsize=7, loc="lower right")
        for ax in (left, right):
            report.log_axis(ax, "x", 2)
            ax.set_xlabel("items per request")
        left.set_ylabel("items/s")
        left.set_title("throughput vs items per request", fontsize=9)
        left.legend(fontsize=7, loc="upper left")
        right.set_title("latency per request vs items per request", fontsize=9)
        right.legend(fontsize=7)
        report.save(fig, path)

    return report.write(args.out, "batchsize", record, headers, rows, summary, plot)
