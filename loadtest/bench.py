"""`batchline bench MODE`: benchmark the engine alone, or a running server.

Each run writes MODE.json, MODE.md and MODE.png into --out, with the machine and the exact
command line, so that every figure can be reproduced and compared (loadtest/report.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from loadtest import (
    batchsize,
    builds,
    capacity,
    compare,
    fanout,
    floor,
    frontends,
    overload,
    payloads,
    precision,
    report,
    runs,
    sharedmem,
)
from server.ladder import doubling

DESCRIPTION = """Benchmarks for Batchline. Modes:

  engine    the engine alone, no server: items/s and latency per batch size; the best is
            "the engine ceiling" that the server is read against
  closed    closed loop with wrk against a running server (--url): a sweep of concurrency levels
            (connections, each sends its next request when its reply arrives)
  open      open loop, Poisson arrivals at a sweep of rates, latency vs offered load
  batching  `closed` against two running servers, batching on (--url-on) and off (--url-off)
  capacity  the highest Poisson rate a server sustains with p99 under --p99-ms, and what its
            queue signals read there: the HPA/KEDA target per replica
  compare   the same sweep against any two KServe v2 servers (--url-a, --url-b), side by side
  batchsize client-side batches (items per request) 1..64: latency, items/s, instance busy share
  precision the engine alone over every built precision variant of a model, side by side
  builds    builds a model in every precision --device runs (cpu, or gpu where one is lent), each
            judged and timed against FP32 there: the precision table
  overload  --factor x the measured capacity, open loop: refusals (429) and their latency,
            accepted latency and throughput (no collapse), deadline errors, the server's memory
  frontends one model through each front end (v2 JSON, v2 binary, gRPC, OpenAI) in one run:
            req/s, items/s, p50/p99 latency and errors side by side (wrk, h2load)
  shm       an image model (3x224x224 FP32) it starts itself: the image in system shared
            memory vs in the body as a binary tensor, in one run
  fanout    one GPU stand-in fed by one server process, by --http-workers N, and by N whole
            servers on one port, in one run: req/s, mean batch size, CPU per request
  floor     the server serving the MLP against a bare app on the same HTTP stack (parse, build
            the array, no model), in turn on one core: the server's share of the floor's rate

Each run writes MODE.json (the record: machine, command line, parameters, every level),
MODE.md (a table) and MODE.png (a plot, with matplotlib) into --out.
The HTTP modes but shm, fanout and floor never start a server: start it yourself, e.g. pinned to CPU 0:
  taskset -c 0 batchline serve --http-port 8000
  batchline bench closed --url http://127.0.0.1:8000 --generator-cpu 1 --out out/closed
"""

ENGINE_HELP = """The engine alone, called directly: no HTTP, no queue. The model folder is read as the
server reads it (its config, its latest version, its artifact). digits and mlp: the server's own engine for
that config (torch or ONNX Runtime), pinned to --threads as `--engine-threads` pins it.
minilm: the texts of the --bodies one-item request bodies `bench closed` sends (32 by default), through
its own ONNX Runtime session (CPUExecutionProvider, --threads intra-op threads) + tokenizers
(truncation at the config's max_length, padding to the longest text of the batch, or with
--length-sorted to neighbours in length; tokenization is timed as part of each batch), since batch
formation is part of what it measures. With --in-flight N, the server's own path instead: each
request tokenized alone as the server admits it, then the server's pipeline and engine for the
batch, on the batches the server's batcher forms when N clients send these texts, each from a text
of its own as `bench closed`'s connections do (the oldest request and those of its length bucket
nearest its length; each batch size a cap): the ceiling a served run at N clients is read against.
Per batch size: 3 warm-up runs, then runs back to back for --duration seconds (at least 5 runs, at
most 100,000); reports items/s, p50/p99 latency per batch, and the best batch size ("the engine
ceiling")."""

CLOSED_HELP = """Closed loop with wrk (Debian package `wrk`): for each --concurrency level C, wrk keeps
C keep-alive connections (C threads, one connection each) each sending its next request as soon
as its reply is back, for --duration seconds (whole seconds: wrk rounds up). A Python client could
not keep up with the server; wrk's C loop does. Reports req/s, items/s, p50/p90/p99 latency and
errors per level. Latencies are timed per request by the Lua script, not taken from wrk's
histogram, which wrk pads with coordinated-omission samples (see loadtest/wrk.py). Before the
sweep, one request is sent and its reply checked (status, output shape); wrk itself counts non-2xx
replies, socket errors and timeouts. Pin wrk away from the server with --generator-cpu (taskset)."""

OPEN_HELP = """Open loop: Poisson arrivals at each --rates value for --duration seconds, sent by an
asyncio raw-socket HTTP/1.1 client (keep-alive pool of up to --connections connections). Latency
is measured from each request's scheduled arrival, so queueing is not hidden. A Python client,
pinned to one CPU, keeps up with rates up to a few thousand requests/s; above that it falls
behind, which the report shows as client send lag (wrk2 is not packaged by Debian)."""

BATCHING_HELP = """Runs `closed` against two servers that you start: --url-on with batching as
configured, --url-off with batching disabled (e.g. a copy of the model repository whose
config.yaml sets max_batch_size: 1 and warmup batch_sizes: [1]). Reports both sweeps side by side
and the throughput ratio per concurrency level. Start both servers pinned to the same CPU set and
run them one at a time if the machine is small (run this mode twice, or stop one while the other
is measured): two servers on one core measure each other."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchline bench", description=DESCRIPTION,
                                     formatter_class=runs.Formatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", choices=sorted(payloads.SPECS), default="digits", help="model to measure")
    common.add_argument("--out", type=Path, required=True, help="folder for MODE.json, MODE.md, MODE.png")
    common.add_argument("--note", default="", help="free text stored in the report (e.g. how the server was pinned)")
    http = argparse.ArgumentParser(add_help=False)
    http.add_argument("--binary", action="store_true", help="Triton binary tensor bodies (and binary outputs) instead of JSON")
    items = argparse.ArgumentParser(add_help=False)
    items.add_argument("--items", type=int, default=1, help="items (batch rows) per request")
    http.add_argument("--timeout", type=float, default=10.0, help="seconds a request may take before it counts as an error")
    http.add_argument("--bodies", type=runs.count, default=payloads.DEFAULT_BODIES,
                      help="different request bodies, sent in turn")
    http.add_argument("--generator-cpu", type=int, metavar="N",
                      help="pin the load generator to CPU N (taskset for wrk, sched_setaffinity for the Python client)")
    wrk = argparse.ArgumentParser(add_help=False)
    wrk.add_argument("--concurrency", type=runs.ints, default=[1, 8, 32, 64], help="comma-separated connection counts")
    wrk.add_argument("--warmup", type=float, default=2.0, help="seconds of load at the highest concurrency before the sweep (0: none)")
    modes = parser.add_subparsers(dest="mode", required=True, metavar="MODE")
    parents = runs.Parents(common=common, http=http, items=items, wrk=wrk)

    engine = modes.add_parser("engine", parents=[common], help="the engine alone, per batch size",
                              description=ENGINE_HELP, formatter_class=runs.Formatter)
    engine.add_argument("--batch-sizes", type=runs.ints, default=doubling(1, 64), help="comma-separated")
    engine.add_argument("--duration", type=float, default=3.0, help="seconds of runs per batch size")
    engine.add_argument("--threads", type=int, default=1, help="intra-op threads (ONNX Runtime) / torch.set_num_threads")
    grouping = engine.add_mutually_exclusive_group()
    grouping.add_argument("--length-sorted", action="store_true",
                          help="minilm: batch texts of neighbouring token length (what a length-aware batcher can do)")
    grouping.add_argument("--in-flight", type=runs.count, default=None, metavar="N",
                          help="minilm: the server's own tokenizer, pipeline and engine on the batches its "
                               "batcher forms from N clients (each batch size a cap)")
    engine.add_argument("--bodies", type=runs.count, default=payloads.DEFAULT_BODIES,
                        help="minilm: the texts of this many one-item request bodies, as `bench closed --bodies` "
                             "sends them")
    engine.add_argument("--model-repository", type=Path, default=payloads.MODELS, help="model repository folder")

    closed = modes.add_parser("closed", parents=[common, http, items, wrk], help="closed-loop concurrency sweep (wrk)",
                              description=CLOSED_HELP, formatter_class=runs.Formatter)
    closed.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    closed.add_argument("--duration", type=float, default=10.0, help="seconds per concurrency level")

    open_ = modes.add_parser("open", parents=[common, http, items], help="open-loop Poisson rate sweep (asyncio)",
                             description=OPEN_HELP, formatter_class=runs.Formatter)
    open_.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    open_.add_argument("--rates", type=runs.floats, default=[100, 250, 500, 1000, 2000], help="comma-separated requests/s")
    open_.add_argument("--connections", type=int, default=256, help="most connections the client opens")
    open_.add_argument("--duration", type=float, default=10.0, help="seconds per rate")

    batching = modes.add_parser("batching", parents=[common, http, items, wrk], help="closed sweep, batching on vs off",
                                description=BATCHING_HELP, formatter_class=runs.Formatter)
    batching.add_argument("--url-on", required=True, help="base URL of the server with batching")
    batching.add_argument("--url-off", required=True, help="base URL of the server without batching")
    batching.add_argument("--duration", type=float, default=10.0, help="seconds per concurrency level")
    for module in (capacity, compare, batchsize, precision, builds, overload, frontends, sharedmem, fanout,
                   floor):
        module.add_parser(modes, parents)
    return parser


# ---- engine -----------------------------------------------------------------------------------

def run_engine(args: argparse.Namespace, argv: list[str]) -> dict[str, str]:
    from loadtest import engine

    parameters = {"model": args.model, "batch_sizes": args.batch_sizes, "duration_s": args.duration,
                  "threads": args.threads, "model_repository": str(args.model_repository),
                  "length_sorted": args.length_sorted, "in_flight": args.in_flight, "bodies": args.bodies}
    record = runs.record(args, argv, parameters)
    results = [r.as_dict() for r in engine.sweep(args.model, args.model_repository, args.batch_sizes,
                                                  args.duration, args.threads, args.length_sorted,
                                                  in_flight=args.in_flight, bodies=args.bodies)]
    best = max(results, key=lambda r: r["items_s"])
    record["results"] = results
    record["headline"] = {"engine_ceiling_items_s": best["items_s"], "best_batch_size": best["batch_size"]}
    headers = ["batch", "runs", "items/s", "p50 ms", "p99 ms"]
    rows = [[r["batch_size"], r["runs"], r["items_s"], r["latency_ms"]["p50"], r["latency_ms"]["p99"]] for r in results]
    if args.model == "minilm":
        headers += ["tokenize p50 ms", "padding share"]
        for row, r in zip(rows, results):
            row += [r.get("tokenize_ms_p50"), r.get("padding_share")]
        record["notes"].append("minilm pads each batch to its longest text: padding share is the part of "
                               "the batch's tokens that are padding, computed but thrown away.")
    if args.in_flight is not None:
        headers[0] = "batch cap"
        headers.append("mean batch")
        for row, r in zip(rows, results):
            row.append(r.get("mean_batch"))
    summary = [(f"engine ceiling ({args.model}, {args.threads} thread(s)): {best['items_s']:,.0f} items/s "
               f"at batch {best['batch_size']}")]

    def plot(path: Path) -> None:
        fig, ax = report.figure(f"{args.model} engine alone, {args.threads} thread(s)")
        sizes = [r["batch_size"] for r in results]
        ax.plot(sizes, [r["items_s"] for r in results], "o-", label="items/s")
        report.log_axis(ax, "x", 2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("items/s")
        twin = ax.twinx()
        twin.plot(sizes, [r["latency_ms"]["p50"] for r in results], "s--", color="tab:orange", label="p50 ms")
        twin.set_ylabel("latency per batch, p50 (ms)")
        fig.legend(loc="upper left")
        report.save(fig, path)

    return report.write(args.out, "engine", record, headers, rows, summary, plot)


# ---- closed / batching ------------------------------------------------------------------------

def _closed_sweep(args: argparse.Namespace, url: str, folder: Path) -> list[dict[str, Any]]:
    requests = payloads.build_requests(args.model, args.items, args.binary, args.bodies)
    return runs.closed_sweep(url, requests, args.concurrency, args.duration, args.warmup, args.timeout,
                             args.generator_cpu, folder)


def _http_parameters(args: argparse.Namespace) -> dict[str, Any]:
    return {"model": args.model, "binary": args.binary, "items": args.items, "duration_s": args.duration,
            "timeout_s": args.timeout, "bodies": args.bodies, "generator_cpu": args.generator_cpu}


def run_closed(args: argparse.Namespace, argv: list[str]) -> dict[str, str]:
    runs.require_wrk()
    parameters = _http_parameters(args) | {"url": args.url, "concurrency": args.concurrency,
                                           "warmup_s": args.warmup}
    record = runs.record(args, argv, parameters)
    levels = _closed_sweep(args, args.url, args.out / "wrk")
    best = max(levels, key=lambda level: level["req_s"])
    record["results"] = levels
    record["headline"] = {"peak_req_s": best["req_s"], "peak_items_s": best["items_s"],
                          "at_concurrency": best["concurrency"]}
    record["notes"] += runs.CLOSED_NOTES
    headers = runs.CLOSED_HEADERS
    rows = [runs.closed_row(level) for level in levels]
    summary = [f"peak {best['req_s']:,.0f} req/s ({best['items_s']:,.0f} items/s) at concurrency {best['concurrency']}"]

    def plot(path: Path) -> None:
        fig, (left, right) = report.panels(
            f"{args.model} closed loop ({'binary' if args.binary else 'JSON'}, {args.items} item(s) per request)", 2)
        report.latency_curves(left, [level["req_s"] for level in levels], [level["latency_ms"] for level in levels])
        left.set_xlabel("throughput (req/s)")
        left.set_title("latency vs throughput", fontsize=9)
        left.legend(fontsize=8)
        right.plot([level["concurrency"] for level in levels], [level["req_s"] for level in levels], "o-")
        report.log_axis(right, "x", 2)
        right.set_xlabel("concurrency (connections)")
        right.set_ylabel("throughput (req/s)")
        right.set_title("throughput vs concurrency", fontsize=9)
        report.save(fig, path)

    return report.write(args.out, "closed", record, headers, rows, summary, plot)


def run_batching(args: argparse.Namespace, argv: list[str]) -> dict[str, str]:
    runs.require_wrk()
    parameters = _http_parameters(args) | {"url_on": args.url_on, "url_off": args.url_off,
                                           "concurrency": args.concurrency, "warmup_s": args.warmup}
    record = runs.record(args, argv, parameters)
    print("batching on:", file=sys.stderr)
    on = _closed_sweep(args, args.url_on, args.out / "wrk-on")
    print("batching off:", file=sys.stderr)
    off = _closed_sweep(args, args.url_off, args.out / "wrk-off")
    record["results"] = {"on": on, "off": off}
    headers = ["concurrency", "on req/s", "off req/s", "on/off", "on p99 ms", "off p99 ms", "on errors", "off errors"]
    rows = [[a["concurrency"], a["req_s"], b["req_s"], round(a["req_s"] / b["req_s"], 2) if b["req_s"] else None,
             a["latency_ms"]["p99"], b["latency_ms"]["p99"], a["error_count"], b["error_count"]]
            for a, b in zip(on, off)]

    def plot(path: Path) -> None:
        fig, ax = report.figure(f"{args.model}: batching on vs off")
        xs = [level["concurrency"] for level in on]
        ax.plot(xs, [level["items_s"] for level in on], "o-", label="on, items/s")
        ax.plot(xs, [level["items_s"] for level in off], "s-", label="off, items/s")
        ax.set_xlabel("concurrency (connections)")
        ax.set_ylabel("items/s")
        ax.legend()
        report.save(fig, path)

    return report.write(args.out, "batching", record, headers, rows, (), plot)


# ---- open ---------------------------------------------------------------------------------------

def run_open(args: argparse.Namespace, argv: list[str]) -> dict[str, str]:
    from loadtest import openloop

    runs.pin_generator(args.generator_cpu)
    parameters = _http_parameters(args) | {"url": args.url, "rates": args.rates,
                                           "max_connections": args.connections,
                                           "client": f"python asyncio ({openloop.event_loop_name()})"}
    record = runs.record(args, argv, parameters)
    requests = payloads.build_requests(args.model, args.items, args.binary, args.bodies)
    runs.preflight(args.url, requests[0], args.timeout)
    results = [r.as_dict(args.items) for r in openloop.run_sweep(
        args.url, requests, args.rates, args.duration, args.connections, args.timeout)]
    record["results"] = results
    for r in results:
        lag = r["client_send_lag_ms"]["p99"]
        if lag is not None and lag > 5:
            record["notes"].append(f"at {r['offered_rate']:g}/s the client's send lag p99 was {lag} ms: "
                                   "the client fell behind; latencies at this rate include its lag")
    record["notes"].append("latency is measured from each request's scheduled (Poisson) arrival; "
                           f"one reply in {openloop.VALIDATE_EVERY} is fully checked, every status is")
    headers = ["offered/s", "achieved req/s", "p50 ms", "p90 ms", "p99 ms", "max ms", "errors", "client lag p99 ms"]
    rows = [[r["offered_rate"], r["achieved_req_s"], r["latency_ms"]["p50"], r["latency_ms"]["p90"],
             r["latency_ms"]["p99"], r["latency_ms"]["max"], r["error_count"], r["client_send_lag_ms"]["p99"]]
            for r in results]

    def plot(path: Path) -> None:
        fig, (left, right) = report.panels(f"{args.model} open loop (Poisson arrivals)", 2)
        offered = [r["offered_rate"] for r in results]
        report.latency_curves(left, offered, [r["latency_ms"] for r in results])
        left.set_xlabel("offered load (requests/s)")
        report.log_axis(left)
        left.set_title("latency vs offered load", fontsize=9)
        left.legend(fontsize=8)
        right.plot(offered, [r["steady"]["achieved_req_s"] for r in results], "o-", label="achieved (steady window)")
        right.plot(offered, offered, ":", color="grey", label="achieved = offered")
        right.set_xlabel("offered load (requests/s)")
        right.set_ylabel("throughput (req/s)")
        right.set_title("throughput vs offered load", fontsize=9)
        right.legend(fontsize=8)
        report.save(fig, path)

    return report.write(args.out, "open", record, headers, rows, (), plot)


MODES = {"engine": run_engine, "closed": run_closed, "open": run_open, "batching": run_batching,
         "capacity": capacity.run, "compare": compare.run, "batchsize": batchsize.run, "precision": precision.run,
         "builds": builds.run, "overload": overload.run,
         "frontends": frontends.run, "shm": sharedmem.run, "fanout": fanout.run, "floor": floor.run}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if getattr(args, "items", 1) < 1:
        raise SystemExit("bench: --items must be >= 1")
    files = MODES[args.mode](args, argv)
    print(Path(files["markdown"]).read_text())
    print("wrote " + ", ".join(files.values()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
