"""`bench compare`: the same sweep, the same bytes, against two KServe v2 servers, side by side.

Batchline against Triton or MLServer (or one build against another) is only a comparison when
both get identical requests from the same generator on the same machine: so one closed-loop
(wrk) sweep, and optionally one open-loop sweep, run against A and then B, one at a time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from loadtest import openloop, payloads, report, runs

HELP = """Runs the closed-loop sweep of `closed` (wrk, --concurrency levels, --duration s each) against
--url-a and then --url-b with the same request bodies, and, with --rates, the open-loop sweep of
`open` (Poisson arrivals) against both too. Both servers must serve --model's payload (digits:
image FP32 [n,1,8,8] -> probabilities [n,10]; minilm: text BYTES [n,1] -> embedding [n,384]);
--name-a/--name-b change the model name in the URL when a server calls it otherwise. Each reply
is checked before the sweep. Reports both sweeps side by side (throughput ratio B/A per level) and
plots latency percentiles against throughput for both. Run one server at a time on a small
machine, or pin them to the same CPUs in turn: two servers sharing cores measure each other."""


def add_parser(modes: Any, parents: runs.Parents) -> None:
    parser = modes.add_parser("compare", parents=[parents.common, parents.http, parents.items, parents.wrk],
                              help="the same sweep against two KServe v2 servers, side by side",
                              description=HELP, formatter_class=runs.Formatter)
    parser.add_argument("--url-a", required=True, help="base URL of server A")
    parser.add_argument("--url-b", required=True, help="base URL of server B")
    parser.add_argument("--label-a", default="batchline", help="name of A in the report")
    parser.add_argument("--label-b", default="other", help="name of B in the report")
    parser.add_argument("--name-a", help="model name on A (default: --model)")
    parser.add_argument("--name-b", help="model name on B (default: --model)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per level (closed and open)")
    parser.add_argument("--rates", type=runs.floats, help="also an open-loop sweep at these requests/s (comma-separated)")
    parser.add_argument("--connections", type=int, default=256, help="open loop: most connections the client opens")


def _side(args: argparse.Namespace, label: str, url: str, name: str | None,
          requests: list[payloads.InferRequest]) -> dict[str, Any]:
    served = runs.served_as(requests, name)
    print(f"{label} ({url}):", file=sys.stderr)
    side: dict[str, Any] = {"url": url, "model_name": name or args.model, "server": runs.server_info(url)}
    side["closed"] = runs.closed_sweep(url, served, args.concurrency, args.duration, args.warmup, args.timeout,
                                       args.generator_cpu, args.out / f"wrk-{label}")
    if args.rates:
        side["open"] = [r.as_dict(args.items) for r in openloop.run_sweep(
            url, served, args.rates, args.duration, args.connections, args.timeout)]
    return side


def _ratio(b: float, a: float) -> float | None:
    return round(b / a, 2) if a else None


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, str]:
    runs.require_wrk()
    if args.label_a == args.label_b:
        raise SystemExit("bench compare: --label-a and --label-b must differ")
    parameters = {"model": args.model, "binary": args.binary, "items": args.items, "duration_s": args.duration,
                  "timeout_s": args.timeout, "bodies": args.bodies, "generator_cpu": args.generator_cpu,
                  "concurrency": args.concurrency, "warmup_s": args.warmup, "rates": args.rates,
                  "url_a": args.url_a, "url_b": args.url_b, "label_a": args.label_a, "label_b": args.label_b}
    runs.pin_generator(args.generator_cpu)  # the open-loop client; wrk is pinned by taskset as well
    record = runs.record(args, argv, parameters)
    requests = payloads.build_requests(args.model, args.items, args.binary, args.bodies)
    a, b = args.label_a, args.label_b
    sides = {a: _side(args, a, args.url_a, args.name_a, requests), b: _side(args, b, args.url_b, args.name_b, requests)}
    record["results"] = sides
    record["notes"] += runs.CLOSED_NOTES
    closed_a, closed_b = sides[a]["closed"], sides[b]["closed"]
    headers = ["concurrency", f"{a} req/s", f"{b} req/s", f"{b}/{a}", f"{a} p50 ms", f"{b} p50 ms",
               f"{a} p99 ms", f"{b} p99 ms", f"{a} errors", f"{b} errors"]
    rows = [[x["concurrency"], x["req_s"], y["req_s"], _ratio(y["req_s"], x["req_s"]), x["latency_ms"]["p50"],
             y["latency_ms"]["p50"], x["latency_ms"]["p99"], y["latency_ms"]["p99"], x["error_count"], y["error_count"]]
            for x, y in zip(closed_a, closed_b)]
    peak_a = max(level["req_s"] for level in closed_a)
    peak_b = max(level["req_s"] for level in closed_b)
    summary = [f"closed-loop peak: {a} {peak_a:,.0f} req/s, {b} {peak_b:,.0f} req/s ({b}/{a} {_ratio(peak_b, peak_a)})"]
    record["headline"] = {"peak_req_s": {a: peak_a, b: peak_b}, "ratio_b_over_a": _ratio(peak_b, peak_a)}
    sections = []
    if args.rates:
        open_rows = [[x["offered_rate"], x["steady"]["achieved_req_s"], y["steady"]["achieved_req_s"],
                      x["latency_ms"]["p50"], y["latency_ms"]["p50"], x["latency_ms"]["p99"], y["latency_ms"]["p99"],
                      x["error_count"], y["error_count"]]
                     for x, y in zip(sides[a]["open"], sides[b]["open"])]
        sections.append("## Open loop (Poisson arrivals)\n\n" + report.markdown_table(
            ["offered/s", f"{a} achieved/s", f"{b} achieved/s", f"{a} p50 ms", f"{b} p50 ms", f"{a} p99 ms",
             f"{b} p99 ms", f"{a} errors", f"{b} errors"], open_rows))

    def plot(path: Path) -> None:
        count = 3 if args.rates else 2
        fig, axes = report.panels(f"{args.model}: {a} vs {b} ({'binary' if args.binary else 'JSON'}, "
                                  f"{args.items} item(s) per request)", count)
        for label, dashes, color in ((a, "-", "tab:blue"), (b, "--", "tab:orange")):
            closed = sides[label]["closed"]
            report.latency_curves(axes[0], [level["req_s"] for level in closed], [level["latency_ms"] for level in closed],
                                  label=label, keys=("p50", "p99"), linestyle=dashes, color=color)
            axes[1].plot([level["concurrency"] for level in closed], [level["req_s"] for level in closed],
                         "o" + dashes, label=label, color=color)
            if args.rates:
                opened = sides[label]["open"]
                report.latency_curves(axes[2], [r["offered_rate"] for r in opened], [r["latency_ms"] for r in opened],
                                      label=label, keys=("p50", "p99"), linestyle=dashes, color=color)
        axes[0].set_xlabel("throughput (req/s)")
        axes[0].set_title("closed loop: latency vs throughput", fontsize=9)
        report.log_axis(axes[1], "x", 2)
        axes[1].set_xlabel("concurrency (connections)")
        axes[1].set_ylabel("throughput (req/s)")
        axes[1].set_title("closed loop: throughput vs concurrency", fontsize=9)
        if args.rates:
            axes[2].set_xlabel("offered load (requests/s)")
            report.log_axis(axes[2])
            axes[2].set_title("open loop: latency vs offered load", fontsize=9)
        for ax in axes:
            ax.legend(fontsize=7)
        report.save(fig, path)

    return report.write(args.out, "compare", record, headers, rows, summary, plot, sections)
