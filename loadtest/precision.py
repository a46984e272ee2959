"""`bench precision`: the engine alone over every built precision variant of a model, side by side.

Whether an INT8 or FP16 build pays off is a property of the engine on this machine: so the same
engine-alone sweep (loadtest/engine.py) runs on the FP32 model and on each variant found in the
repository (loadtest/variants.py), and, with --url, the same closed loop against each variant the
server serves. Quality is the build's own gate (`batchline build`), not measured here.
"""

from __future__ import annotations

import argparse
import sys
import urllib.request
from pathlib import Path
from typing import Any

from loadtest import engine, payloads, report, runs, variants
from server.quantize.bench import DEFAULT_BATCHES

HELP = """Finds --model and its variants in --model-repository (folders whose config.yaml has
`build: {source: MODEL, ...}`, as `batchline build` writes them, e.g. minilm-onnxruntime-int8), and runs
the engine-alone sweep of `engine` (--batch-sizes, --engine-duration s each, --threads; --rounds times,
interleaved, best round kept) on each built one: its highest version folder, its config's artifact and
precision (a variant is labelled by its build precision, the engine's compute dtype in brackets when it
differs, e.g. torch int8 weights computing in fp32). Variants without a version folder, or
on an engine this machine cannot run alone (e.g. tensorrt without a GPU), are listed as skipped. With
--url, also the closed-loop sweep of `closed` against each variant the server reports ready
(GET /v2/models/{variant}/ready), same bodies, same --concurrency. Reports the best items/s of
each and its ratio to FP32 (the model itself). With no variant built yet, it reports FP32 alone and
says so."""


def add_parser(modes: Any, parents: runs.Parents) -> None:
    parser = modes.add_parser("precision", parents=[parents.common, parents.http, parents.wrk],
                              help="engine alone (and optionally closed loop) over a model's precision variants",
                              description=HELP, formatter_class=runs.Formatter)
    parser.add_argument("--model-repository", type=Path, default=payloads.MODELS, help="model repository folder")
    parser.add_argument("--batch-sizes", type=runs.ints, default=list(DEFAULT_BATCHES),
                        help="engine sweep, comma-separated (default: the sizes a build report times)")
    parser.add_argument("--engine-duration", type=float, default=3.0, help="seconds of runs per batch size")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (ONNX Runtime) / torch threads")
    parser.add_argument("--rounds", type=int, default=1,
                        help="engine sweeps per variant, interleaved across variants; the best round per batch size "
                             "is kept (a noisy neighbour then has to slow every round of a variant to bias it)")
    parser.add_argument("--url", help="also a closed-loop sweep against each variant this server serves")
    parser.add_argument("--duration", type=float, default=10.0, help="closed loop: seconds per concurrency level")


def _served(url: str, name: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v2/models/{name}/ready", timeout=5) as reply:
            return reply.status == 200
    except OSError:
        return False


def _check(args: argparse.Namespace, variant: variants.Variant) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": variant.name, "engine": variant.engine, "precision": variant.precision,
                             "engine_precision": variant.engine_precision, "source": variant.source,
                             "build": variant.build, "folder": str(variant.folder)}
    if not variant.built:
        entry["skipped"] = "no version folder (not built, or every build was rejected)"
    elif (args.model, variant.engine) not in engine.LOADERS:
        entry["skipped"] = f"no engine-alone loader for {args.model} on {variant.engine} on this machine"
    return entry


def _engine_round(args: argparse.Namespace, variant: variants.Variant, entry: dict[str, Any], round_: int) -> None:
    """One engine-alone sweep of `variant`; per batch size the best round is kept."""
    print(f"{variant.name} ({variant.engine}, {variant.precision}): engine alone, round {round_ + 1}", file=sys.stderr)
    try:
        results = [r.as_dict() for r in engine.sweep(args.model, args.model_repository, args.batch_sizes,
                                                      args.engine_duration, args.threads, folder=variant.folder,
                                                      bodies=args.bodies)]
    except Exception as exc:  # noqa: BLE001 - a broken artifact is a finding about that variant, not the end of the run
        entry["skipped"] = f"the engine failed: {type(exc).__name__}: {exc}"
        return
    entry.setdefault("rounds", []).append(results)
    best = {r["batch_size"]: r for r in entry.get("engine_results", [])}
    for r in results:
        if r["batch_size"] not in best or r["items_s"] > best[r["batch_size"]]["items_s"]:
            best[r["batch_size"]] = r
    entry["engine_results"] = [best[b] for b in sorted(best)]
    top = max(entry["engine_results"], key=lambda r: r["items_s"])
    entry |= {"engine_ceiling_items_s": top["items_s"], "best_batch_size": top["batch_size"]}


def _closed(args: argparse.Namespace, entry: dict[str, Any]) -> None:
    name = entry["name"]
    if not _served(args.url, name):
        entry["closed_skipped"] = f"{args.url} does not serve {name} (not ready)"
        return
    requests = runs.served_as(payloads.build_requests(args.model, 1, args.binary, args.bodies), name)
    entry["closed"] = runs.closed_sweep(args.url, requests, args.concurrency, args.duration, args.warmup,
                                        args.timeout, args.generator_cpu, args.out / f"wrk-{name}")


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, str]:
    if args.url:
        runs.require_wrk()
    found = variants.find(args.model_repository, args.model)
    if args.rounds < 1:
        raise SystemExit("bench precision: --rounds must be >= 1")
    parameters = {"model": args.model, "model_repository": str(args.model_repository), "batch_sizes": args.batch_sizes,
                  "engine_duration_s": args.engine_duration, "threads": args.threads, "rounds": args.rounds,
                  "url": args.url,
                  "concurrency": args.concurrency if args.url else None, "duration_s": args.duration if args.url else None}
    record = runs.record(args, argv, parameters)
    entries = [_check(args, v) for v in found]
    for round_ in range(args.rounds):  # interleaved, every other round in reverse order
        order = list(zip(found, entries))
        for variant, entry in order if round_ % 2 == 0 else reversed(order):
            if not entry.get("skipped"):
                _engine_round(args, variant, entry, round_)
    if args.url:
        for entry in entries:
            if entry.get("engine_results"):
                _closed(args, entry)
    record["results"] = entries
    reference = entries[0].get("engine_ceiling_items_s")
    if len(found) == 1:
        record["notes"].append(f"no precision variant of {args.model} in {args.model_repository} yet "
                               f"(`batchline build` writes them): {entries[0]['precision'].upper()} alone")
    for entry in entries:
        if entry.get("skipped"):
            record["notes"].append(f"{entry['name']} skipped: {entry['skipped']}")
        if entry.get("closed_skipped"):
            record["notes"].append(f"{entry['name']} closed loop skipped: {entry['closed_skipped']}")
    sizes = args.batch_sizes
    headers = ["variant", "engine", "precision (engine)", *[f"items/s @{b}" for b in sizes], "best items/s", "vs fp32"]
    closed_peak = {e["name"]: max(level["req_s"] for level in e["closed"]) for e in entries if e.get("closed")}
    if closed_peak:
        headers.append("closed peak req/s")
    rows = []
    for entry in entries:
        by_size = {r["batch_size"]: r["items_s"] for r in entry.get("engine_results", [])}
        ceiling = entry.get("engine_ceiling_items_s")
        precision = entry["precision"] + ("" if entry["engine_precision"] == entry["precision"]
                                          else f" ({entry['engine_precision']})")
        row = [entry["name"], entry["engine"], precision, *[by_size.get(b) for b in sizes], ceiling,
               round(ceiling / reference, 2) if ceiling and reference else None]
        if closed_peak:
            row.append(closed_peak.get(entry["name"]))
        rows.append(row)
    measured = [e for e in entries if e.get("engine_results")]
    record["headline"] = {"variants": len(found) - 1,
                          "best": max(measured, key=lambda e: e["engine_ceiling_items_s"])["name"] if measured else None}
    summary = [f"{len(found) - 1} variant(s) of {args.model} besides {entries[0]['precision'].upper()}"
               + (f"; fastest engine alone: {record['headline']['best']}" if measured else "")]

    def plot(path: Path) -> None:
        fig, ax = report.figure(f"{args.model}: engine alone per precision variant ({args.threads} thread(s))")
        for entry in measured:
            results = entry["engine_results"]
            ax.plot([r["batch_size"] for r in results], [r["items_s"] for r in results], "o-",
                    label=f"{entry['name']} ({entry['precision']})")
        report.log_axis(ax, "x", 2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("items/s")
        ax.legend(fontsize=8)
        report.save(fig, path)

    return report.write(args.out, "precision", record, headers, rows, summary, plot)
