"""`bench capacity`: the highest request rate one replica sustains with p99 under a target, and
what the server's queue signals read there, i.e. the number an autoscaler should hold it to.

Closed-loop peaks say nothing about latency at a given traffic, and autoscaling needs a rate
(or a signal) per replica. So: open-loop Poisson steps (loadtest/openloop.py, the same arrival
draws at every rate), a search that brackets the capacity by growing (or shrinking) the rate
geometrically and then bisects the bracket, each step bounded in time, and the server's own
signals (loadtest/signals.py) over each step. `search` is pure (it takes the measurement as a
function), so it is tested on a simulated queue as well as on loadtest/fakeserver.py.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest import openloop, payloads, report, runs, signals

HELP = """Finds the highest Poisson request rate the server at --url sustains for --model with p99
latency <= --p99-ms. A rate is *sustained* when, over the step's steady window (after the first
--settle share of the step, while the queue fills), p99 <= the target, the server completed at
least (1 - --rate-tolerance) of the requests that arrived in the window (completions against
arrivals in the same window), and not one request failed. Steps: one unrecorded warm-up at
--start-rate, then --start-rate times --growth until a rate fails (or divided by --growth until
one passes), then bisection (geometric mean) of [highest sustained, lowest failing] until their
ratio is within 1 + --precision; at most --max-steps steps. Each step lasts --step-duration s plus
its drain (at most --timeout + 1 s); a step stops early once more than 1% of its requests are
over the target (p99 cannot pass any more) or one fails. Every step uses the same arrival draws
(--seed) scaled to its rate, so steps differ by rate, not by luck.

The server's signals are read before and after each step: /metrics when the server exports it
(batchline_queue_duration_seconds, batchline_compute_duration_seconds, batchline_queue_depth
sampled every --scrape-interval s, batchline_instance_busy_seconds_total), else the statistics
extension (GET /v2/models/{m}/stats: inference_stats.queue and .compute_infer). Then one more
step at --margin x capacity (unless --no-margin-step) reads them where the replica should be
held, and the report gives the HPA/KEDA targets per replica: request rate, mean queue depth,
queue-to-compute ratio and busy share, with PromQL. The p99 is measured by a Python client on
the scheduled arrival times: pin it away from the server (--generator-cpu), and lengthen
--step-duration when a step holds fewer than ~2,000 replies (the report says so)."""

SAMPLES_FOR_A_P99 = 2000


@dataclass
class Step:
    """One bounded measurement at one offered rate."""

    index: int
    purpose: str  # bracket | bisect | margin
    rate: float
    sustained: bool
    reason: str
    run: dict[str, Any] = field(default_factory=dict)  # openloop.RateResult.as_dict
    signals: dict[str, Any] = field(default_factory=dict)  # signals.window


@dataclass
class Search:
    capacity: float | None  # highest sustained rate measured; None: not even --min-rate
    failed_above: float | None  # lowest failing rate measured above it
    steps: list[Step]
    stopped: str


Measure = Callable[[float, str], Step]  # (rate, purpose) -> its step


def judge(run: dict[str, Any], p99_ms: float, rate_tolerance: float) -> tuple[bool, str]:
    """Sustained or not, and why, from one step's open-loop record."""
    steady = run["steady"]
    if run.get("aborted"):
        return False, str(run["aborted"])
    if run["error_count"]:
        return False, f"{run['error_count']} failed request(s), first: {run['first_error']}"
    if not steady["replies"]:
        return False, "no replies in the steady window"
    p99 = steady["latency_ms"]["p99"]
    if p99 > p99_ms:
        return False, f"p99 {p99:.1f} ms > {p99_ms:g} ms"
    share = steady["achieved_share"]
    if share is not None and share < 1 - rate_tolerance:
        return False, f"completed {share:.1%} of arrivals (< {1 - rate_tolerance:.0%}): falling behind"
    return True, f"p99 {p99:.1f} ms, completed {share:.1%} of arrivals"


def _round(rate: float) -> float:
    return float(f"{rate:.4g}")


def search(measure: Measure, start: float, min_rate: float, max_rate: float, growth: float = 2.0,
           precision: float = 0.05, max_steps: int = 14) -> Search:
    """Bracket, then bisect: the highest sustained rate, within `precision` of the lowest failing."""
    steps: list[Step] = []
    tried: set[float] = set()
    lo: float | None = None
    hi: float | None = None

    def step(rate: float, purpose: str) -> bool:
        rate = _round(rate)
        tried.add(rate)
        result = measure(rate, purpose)
        steps.append(result)
        return result.sustained

    rate = min(max(start, min_rate), max_rate)
    if step(rate, "bracket"):
        lo = _round(rate)
        while hi is None and len(steps) < max_steps:
            if lo >= max_rate:
                return Search(lo, None, steps, f"sustained --max-rate {max_rate:g}/s: the capacity is at least that")
            rate = min(lo * growth, max_rate)
            if step(rate, "bracket"):
                lo = _round(rate)
            else:
                hi = _round(rate)
    else:
        hi = _round(rate)
        while lo is None and len(steps) < max_steps:
            rate = hi / growth
            if rate < min_rate:
                return Search(None, hi, steps, f"not sustained even at {hi:g}/s (--min-rate {min_rate:g})")
            if step(rate, "bracket"):
                lo = _round(rate)
            else:
                hi = _round(rate)
    if lo is None or hi is None:
        return Search(lo, hi, steps, f"--max-steps {max_steps} reached while bracketing")
    while hi / lo - 1 > precision:
        if len(steps) >= max_steps:
            return Search(lo, hi, steps, f"--max-steps {max_steps} reached: bracket [{lo:g}, {hi:g}]/s")
        rate = _round(math.sqrt(lo * hi))
        if rate in tried or not lo < rate < hi:
            break
        if step(rate, "bisect"):
            lo = rate
        else:
            hi = rate
    return Search(lo, hi, steps, f"bracket [{lo:g}, {hi:g}]/s within {precision:.0%}")


@dataclass
class ServerProbe:
    """Measures steps against a server: open-loop load, its signals around it."""

    url: str
    model: str
    requests: list[payloads.InferRequest]
    p99_ms: float
    step_duration_s: float
    settle: float = 0.1
    rate_tolerance: float = 0.03
    connections: int = 256
    timeout_s: float = 10.0
    seed: int = 0
    pause_s: float = 1.0
    scrape_interval_s: float = 0.5
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr)
    count: int = 0

    def __call__(self, rate: float, purpose: str) -> Step:
        run, window = self.load(rate, abort=True)
        sustained, reason = judge(run, self.p99_ms, self.rate_tolerance)
        self.count += 1
        step = Step(self.count, purpose, rate, sustained, reason, run, window)
        steady = run["steady"]
        self.log(f"  step {self.count} ({purpose}) {rate:g}/s: {'SUSTAINED' if sustained else 'not sustained'} "
                 f"({reason}); p99 {steady['latency_ms']['p99']} ms, queue depth {window.get('queue_depth_mean')}")
        return step

    def load(self, rate: float, abort: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        """One open-loop step at `rate` and the server's signals over it."""
        before = signals.snapshot(self.url, self.model)
        sampler = signals.GaugeSampler(self.url, self.model, interval_s=self.scrape_interval_s)
        sample = self.scrape_interval_s > 0 and before.metrics is not None
        if sample:
            sampler.__enter__()
        try:
            result = openloop.run(openloop.run_rate(
                self.url, self.requests, rate, self.step_duration_s, self.connections, self.timeout_s,
                seed=self.seed, steady_from_s=self.settle * self.step_duration_s,
                abort_above_s=self.p99_ms / 1000 if abort else None, abort_on_error=abort))
        finally:
            if sample:
                sampler.__exit__()
        after = signals.snapshot(self.url, self.model)
        window = signals.window(before, after, self.model, sampler.summary() if sample else None)
        if self.pause_s > 0:
            time.sleep(self.pause_s)  # let a backlog the client hung up on clear before the next step
        return result.as_dict(self.requests[0].items), window


# ---- the recommendation ---------------------------------------------------------------------------

def recommend(found: Search, margin_step: Step | None, margin: float, model: str, items: int) -> dict[str, Any]:
    """Targets per replica: measured at margin x capacity when that step ran (the signals are not
    linear in load: near capacity the queue grows fast), else margin x their value at capacity."""
    if found.capacity is None:
        return {}
    at_capacity = next(s for s in reversed(found.steps) if s.sustained and s.rate == found.capacity)
    cap = at_capacity.signals
    held = margin_step.signals if margin_step else None
    rows = []
    for key, label in (("queue_depth_mean", "mean queue depth (requests waiting)"),
                       ("queue_per_compute", "queue-to-compute ratio"),
                       ("busy_fraction", "instance busy share")):
        value = cap.get(key)
        measured = held.get(key) if held else None
        scaled = round(value * margin, 4) if value is not None else None
        rows.append({"signal": key, "label": label, "at_capacity": value, "margin_x_capacity_value": scaled,
                     "at_margin_rate": measured, "target": measured if held else scaled})
    target_rate = round(found.capacity * margin, 1)
    price = (cap.get("metrics") or {}).get("price_per_hour")
    out: dict[str, Any] = {
        "capacity_req_s": found.capacity,
        "capacity_items_s": round(found.capacity * items, 1),
        "margin": margin,
        "target_req_s_per_replica": target_rate,
        "signals": rows,
        "signal_source": cap.get("source"),
        "targets_from": "measured at margin x capacity" if held else "margin x the value at capacity",
        "promql": promql(model),
    }
    if price:
        out["price_per_hour"] = price
        out["usd_per_million_requests_at_target"] = round(price / (target_rate * 3600) * 1e6, 4)
    return out


def promql(model: str) -> dict[str, str]:
    selector = f'{{model="{model}"}}'
    queue = f"sum(rate(batchline_queue_duration_seconds_sum{selector}[1m]))"
    return {
        "target_req_s_per_replica": f'sum(rate(batchline_requests_total{{model="{model}",outcome="success"}}[1m]))',
        "queue_depth_mean": queue,
        "queue_per_compute": f"{queue} / sum(rate(batchline_compute_duration_seconds_sum{selector}[1m]))",
        "busy_fraction": (f"sum(rate(batchline_instance_busy_seconds_total{selector}[1m])) / "
                          f"count(batchline_instance_busy_seconds_total{selector})"),
    }


def recommendation_markdown(rec: dict[str, Any], p99_ms: float) -> str:
    if not rec:
        return "## Autoscaling target\n\nNo capacity found: nothing to recommend."
    margin = rec["margin"]
    lines = ["## Autoscaling target (per replica)", "",
             (f"Capacity {rec['capacity_req_s']:g} req/s ({rec['capacity_items_s']:g} items/s) at p99 <= {p99_ms:g} ms; "
             f"held at {margin:g}x: **{rec['target_req_s_per_replica']:g} req/s per replica**. Signal targets: "
             f"{rec['targets_from']} (signals from {rec['signal_source'] or 'nowhere: the server exports neither'})."), ""]
    rows = [["request rate (req/s)", rec["capacity_req_s"], round(rec["capacity_req_s"] * margin, 1),
             None, rec["target_req_s_per_replica"]]]
    rows += [[r["label"], r["at_capacity"], r["margin_x_capacity_value"], r["at_margin_rate"], r["target"]]
             for r in rec["signals"]]
    lines.append(report.markdown_table(
        ["signal", "at capacity", f"{margin:g} x that", f"measured at {margin:g} x capacity", "target"], rows))
    if rec.get("usd_per_million_requests_at_target") is not None:
        lines += ["", (f"Device price {rec['price_per_hour']:g}/h: {rec['usd_per_million_requests_at_target']:g} "
                      "per million requests at the target rate.")]
    depth = next((r["target"] for r in rec["signals"] if r["signal"] == "queue_depth_mean"), None)
    ratio = next((r["target"] for r in rec["signals"] if r["signal"] == "queue_per_compute"), None)
    query = rec["promql"]
    lines += ["", ("PromQL (KEDA `prometheus` trigger; `AverageValue` thresholds are per replica, KEDA divides "
                  "the query's total by the replica count; a ratio does not add up, so it is a `Value`):"), "",
              "```yaml", "triggers:"]
    lines += _trigger(query["target_req_s_per_replica"], rec["target_req_s_per_replica"], "AverageValue")
    if depth is not None:
        lines += _trigger(query["queue_depth_mean"], depth, "AverageValue")
    if ratio is not None:
        lines += _trigger(query["queue_per_compute"], ratio, "Value")
    lines += ["```"]
    if depth is not None and depth < 0.05:
        lines += ["", (f"The mean queue depth barely moves below capacity here ({depth:g} at the target): "
                      "a poor trigger on its own for this model; scale on the request rate.")]
    return "\n".join(lines)


def _trigger(query: str, threshold: float, metric_type: str) -> list[str]:
    return ["  - type: prometheus", f"    metricType: {metric_type}", "    metadata:",
            "      serverAddress: http://prometheus.monitoring:9090",
            f"      query: '{query}'", f'      threshold: "{threshold:g}"']


# ---- the command line -----------------------------------------------------------------------------

def add_parser(modes: Any, parents: runs.Parents) -> None:
    parser = modes.add_parser("capacity", parents=[parents.common, parents.http, parents.items],
                              help="highest sustained Poisson rate at p99 <= target; HPA/KEDA targets",
                              description=HELP, formatter_class=runs.Formatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--p99-ms", type=runs.positive, default=100.0, help="p99 latency target (ms)")
    parser.add_argument("--start-rate", type=runs.positive, default=50.0, help="first rate (requests/s)")
    parser.add_argument("--min-rate", type=runs.positive, default=1.0, help="give up below this rate")
    parser.add_argument("--max-rate", type=runs.positive, default=20000.0, help="never offer more than this")
    parser.add_argument("--growth", type=float, default=2.0, help="rate factor while bracketing (> 1)")
    parser.add_argument("--precision", type=runs.positive, default=0.05,
                        help="stop when lowest failing / highest sustained - 1 is at most this")
    parser.add_argument("--max-steps", type=int, default=14, help="most search steps (not counting warm-up and margin)")
    parser.add_argument("--step-duration", type=runs.positive, default=10.0, help="seconds of arrivals per step")
    parser.add_argument("--settle", type=float, default=0.1, help="share of each step before its steady window")
    parser.add_argument("--rate-tolerance", type=float, default=0.03,
                        help="sustained needs completions >= (1 - this) x arrivals in the steady window")
    parser.add_argument("--margin", type=float, default=0.8, help="safety margin: hold replicas at this x capacity")
    parser.add_argument("--margin-step", action=argparse.BooleanOptionalAction, default=True,
                        help="one more step at margin x capacity to read the signals there "
                             "(without: targets are margin x the signals at capacity)")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds at --start-rate before the search (0: none)")
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between steps")
    parser.add_argument("--connections", type=int, default=256, help="most connections the client opens")
    parser.add_argument("--seed", type=int, default=0, help="arrival draws (the same for every step)")
    parser.add_argument("--scrape-interval", type=float, default=0.5,
                        help="seconds between reads of batchline_queue_depth during a step (0: none)")


def _validate(args: argparse.Namespace) -> None:
    problems = []
    if args.growth <= 1:
        problems.append("--growth must be > 1")
    if not 0 < args.margin <= 1:
        problems.append("--margin must be in (0, 1]")
    if not 0 <= args.settle < 0.9:
        problems.append("--settle must be in [0, 0.9)")
    if not 0 <= args.rate_tolerance < 1:
        problems.append("--rate-tolerance must be in [0, 1)")
    if args.min_rate > args.max_rate:
        problems.append("--min-rate must not exceed --max-rate")
    if args.max_steps < 1:
        problems.append("--max-steps must be >= 1")
    if problems:
        raise SystemExit("bench capacity: " + "; ".join(problems))


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, str]:
    _validate(args)
    runs.pin_generator(args.generator_cpu)
    parameters = {
        "url": args.url, "model": args.model, "binary": args.binary, "items": args.items, "bodies": args.bodies,
        "p99_ms": args.p99_ms, "start_rate": args.start_rate, "min_rate": args.min_rate, "max_rate": args.max_rate,
        "growth": args.growth, "precision": args.precision, "max_steps": args.max_steps,
        "step_duration_s": args.step_duration, "settle": args.settle, "rate_tolerance": args.rate_tolerance,
        "margin": args.margin, "margin_step": args.margin_step, "warmup_s": args.warmup, "timeout_s": args.timeout,
        "connections": args.connections, "seed": args.seed, "generator_cpu": args.generator_cpu,
        "client": f"python asyncio ({openloop.event_loop_name()})",
    }
    record = runs.record(args, argv, parameters)
    record["server"] = runs.server_info(args.url)
    requests = payloads.build_requests(args.model, args.items, args.binary, args.bodies)
    runs.preflight(args.url, requests[0], args.timeout)
    probe = ServerProbe(args.url, args.model, requests, args.p99_ms, args.step_duration, args.settle,
                        args.rate_tolerance, args.connections, args.timeout, args.seed, args.pause, args.scrape_interval)
    if args.warmup > 0:
        print(f"  warm-up: {args.warmup:g} s at {args.start_rate:g}/s", file=sys.stderr)
        openloop.run(openloop.run_rate(args.url, requests, args.start_rate, args.warmup, args.connections,
                                       args.timeout, seed=args.seed + 1))
    found = search(probe, args.start_rate, args.min_rate, args.max_rate, args.growth, args.precision, args.max_steps)
    margin_step = None
    if found.capacity is not None and args.margin_step and args.margin < 1:
        rate = _round(found.capacity * args.margin)
        run_record, window = probe.load(rate, abort=False)
        sustained, reason = judge(run_record, args.p99_ms, args.rate_tolerance)
        margin_step = Step(probe.count + 1, "margin", rate, sustained, reason, run_record, window)
        print(f"  margin step {rate:g}/s: {reason}; queue depth {window.get('queue_depth_mean')}", file=sys.stderr)
    rec = recommend(found, margin_step, args.margin, args.model, args.items)
    record["results"] = {"steps": [asdict(s) for s in found.steps],
                         "margin_step": asdict(margin_step) if margin_step else None}
    record["headline"] = {"capacity_req_s": found.capacity, "failed_above_req_s": found.failed_above,
                          "p99_target_ms": args.p99_ms, "stopped": found.stopped, "recommendation": rec}
    record["notes"] += _notes(found, margin_step, args)
    steps = [*found.steps, *([margin_step] if margin_step else [])]
    headers = ["step", "purpose", "offered/s", "achieved/s", "p50 ms", "p99 ms", "errors", "queue depth",
               "queue/compute", "busy", "client lag p99 ms", "verdict"]
    rows = [[s.index, s.purpose, s.rate, s.run["steady"]["achieved_req_s"], s.run["steady"]["latency_ms"]["p50"],
             s.run["steady"]["latency_ms"]["p99"], s.run["error_count"], s.signals.get("queue_depth_mean"),
             s.signals.get("queue_per_compute"), s.signals.get("busy_fraction"), s.run["client_send_lag_ms"]["p99"],
             ("sustained" if s.sustained else "no") + f": {s.reason}"] for s in steps]
    if found.capacity is None:
        summary = [f"capacity at p99 <= {args.p99_ms:g} ms: none found ({found.stopped})"]
    else:
        summary = [f"capacity at p99 <= {args.p99_ms:g} ms: {found.capacity:g} req/s "
                   f"({found.capacity * args.items:g} items/s) per replica"
                   + (f"; {found.failed_above:g} req/s was not sustained" if found.failed_above else "")
                   + f" ({found.stopped})",
                   f"hold each replica at {rec['target_req_s_per_replica']:g} req/s ({args.margin:g}x)"]

    def plot(path: Path) -> None:
        plot_capacity(path, steps, found, args.p99_ms, args.model, margin_step)

    return report.write(args.out, "capacity", record, headers, rows, summary, plot,
                        sections=[recommendation_markdown(rec, args.p99_ms)])


def _notes(found: Search, margin_step: Step | None, args: argparse.Namespace) -> list[str]:
    notes = [
        (f"sustained: over each step's steady window (after the first {args.settle:.0%}), p99 <= {args.p99_ms:g} ms, "
         f"completions >= {1 - args.rate_tolerance:.0%} of arrivals, no failed request; latency is timed from each "
         "request's scheduled arrival, so client lag and waiting for a connection count"),
        ("queue depth: mean requests waiting over the step (Little's law: queue-seconds / seconds); queue/compute: "
         "queue-seconds per compute-second (/metrics compute is per batch: waiting requests per busy instance; the "
         "statistics extension's is per request); busy: share of the step each instance ran batches (/metrics only)"),
    ]
    steps = [*found.steps, *([margin_step] if margin_step else [])]
    few = [s.index for s in steps if s.sustained and s.run["steady"]["replies"] < SAMPLES_FOR_A_P99]
    if few:
        notes.append(f"steps {few} hold fewer than {SAMPLES_FOR_A_P99:,} replies: their p99 is noisy; "
                     "a longer --step-duration narrows it")
    lagging = [s.index for s in steps if (s.run["client_send_lag_ms"]["p99"] or 0) > max(5.0, args.p99_ms / 10)]
    if lagging:
        notes.append(f"steps {lagging}: the client's own send lag p99 was over {max(5.0, args.p99_ms / 10):g} ms; "
                     "the capacity may be the client's, not the server's (pin it: --generator-cpu)")
    inverted = _inversions(steps)
    if inverted:
        notes.append("p99 was not monotone in the rate (" + "; ".join(inverted) + "): stalls or a noisy neighbour, "
                     "not queueing, set those steps; the capacity is uncertain, re-run on a quiet machine or with "
                     "longer steps")
    if margin_step and not margin_step.sustained:
        notes.append(f"the margin step at {margin_step.rate:g}/s was not sustained ({margin_step.reason}): "
                     "the capacity is unstable run to run; re-run with longer steps")
    return notes


def _inversions(steps: list[Step], factor: float = 1.5) -> list[str]:
    """Pairs where a lower rate read a p99 over `factor` x that of a higher one (both complete)."""
    measured = sorted((s for s in steps if not s.run.get("aborted") and s.run["steady"]["latency_ms"]["p99"]),
                      key=lambda s: s.rate)
    found = []
    for low, high in itertools.pairwise(measured):
        low_p99, high_p99 = low.run["steady"]["latency_ms"]["p99"], high.run["steady"]["latency_ms"]["p99"]
        if low_p99 > factor * high_p99:
            found.append(f"{low.rate:g}/s: {low_p99:g} ms > {high.rate:g}/s: {high_p99:g} ms")
    return found


def plot_capacity(path: Path, steps: list[Step], found: Search, p99_ms: float, model: str,
                  margin_step: Step | None) -> None:
    fig, (left, right) = report.panels(f"{model}: capacity at p99 <= {p99_ms:g} ms (open loop, Poisson)", 2)
    ordered = sorted(steps, key=lambda s: s.rate)
    rates = [s.rate for s in ordered]
    report.latency_curves(left, rates, [s.run["steady"]["latency_ms"] for s in ordered])
    failed = [s for s in ordered if not s.sustained]
    if failed:
        left.plot([s.rate for s in failed], [s.run["steady"]["latency_ms"]["p99"] or p99_ms for s in failed],
                  "x", color="black", markersize=9, label="not sustained")
    report.hline(left, p99_ms, f"p99 target {p99_ms:g} ms")
    for ax in (left, right):
        if found.capacity is not None:
            report.vline(ax, found.capacity, f"capacity {found.capacity:g}/s")
        if margin_step is not None:
            report.vline(ax, margin_step.rate, f"target {margin_step.rate:g}/s", color="tab:blue", linestyle=":")
    report.log_axis(left)
    left.set_xlabel("offered load (requests/s)")
    left.set_title("latency (steady window) vs offered load", fontsize=9)
    left.legend(fontsize=7)
    depth = [(s.rate, s.signals.get("queue_depth_mean")) for s in ordered if s.signals.get("queue_depth_mean") is not None]
    ratio = [(s.rate, s.signals.get("queue_per_compute")) for s in ordered if s.signals.get("queue_per_compute") is not None]
    if depth:
        right.plot([d[0] for d in depth], [d[1] for d in depth], "o-", label="mean queue depth")
    if ratio:
        right.plot([r[0] for r in ratio], [r[1] for r in ratio], "s--", label="queue/compute")
    right.set_xlabel("offered load (requests/s)")
    right.set_ylabel("server signal")
    right.set_yscale("symlog", linthresh=0.01)
    right.set_title("queue signals vs offered load", fontsize=9)
    right.legend(fontsize=7)
    report.save(fig, path)
