"""`python -m loadtest.suite`: the batching benchmark of record, end to end.

For each model: the engine alone (the ceiling), then the real server with batching on and with
batching off, each pinned to CPU 0 with one engine thread while wrk runs pinned to CPU 1, swept
over the same concurrency levels. Writes suite.json, suite.md and suite.png (served items/s vs the
engine ceiling), plus each run's own reports, into --out. One server at a time: two servers on one
core would measure each other.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from loadtest import localserver, machine, report
from server.layout import config_path, version_dir, version_numbers

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"


def variant_repository(folder: Path, model: str, batching: bool) -> Path:
    """A one-model repository sharing the built version folders; batching off drops the
    dynamic_batching block, so every request runs alone (Triton's default scheduler)."""
    root = folder / ("batching-on" if batching else "batching-off")
    target = root / model
    target.mkdir(parents=True)
    for version in version_numbers(MODELS / model):
        version_dir(target, version).symlink_to(version_dir(MODELS / model, version).resolve(), target_is_directory=True)
    config = yaml.safe_load(config_path(MODELS / model).read_text())
    if not batching:
        config.pop("dynamic_batching", None)
        config.setdefault("warmup", {})["profile"] = False
    config_path(target).write_text(yaml.safe_dump(config, sort_keys=False))
    return root


@contextmanager
def pinned_server(repository: Path, model: str, cpu: int, log: Path) -> Iterator[str]:
    with localserver.running_server(repository, "--model", model, "--engine-threads", "1", "--log-level", "warning",
                                    cpu=cpu, log_path=log) as url:
        yield url


def _bench(*arguments: str) -> dict[str, Any]:
    out = Path(arguments[arguments.index("--out") + 1])
    subprocess.run([sys.executable, "-m", "loadtest.bench", *arguments], cwd=ROOT, check=True)
    return json.loads((out / f"{arguments[0]}.json").read_text())


def _stats(url: str, model: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/v2/models/{model}/stats", timeout=5) as response:
        return json.loads(response.read())["model_stats"][0]


def run_model(model: str, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    out = args.out / model
    concurrency = ",".join(str(c) for c in args.concurrency)
    engine = _bench("engine", "--model", model, "--threads", "1", "--duration", str(args.engine_duration),
                    "--out", str(out / "engine"))
    result: dict[str, Any] = {"engine": engine["headline"], "engine_results": engine["results"]}
    if model == "minilm":  # the ceiling a length-aware batcher could reach on the same texts
        ordered = _bench("engine", "--model", model, "--threads", "1", "--duration", str(args.engine_duration),
                         "--length-sorted", "--out", str(out / "engine-sorted"))
        result["engine_sorted"] = ordered["headline"]
        if ordered["headline"]["engine_ceiling_items_s"] > engine["headline"]["engine_ceiling_items_s"]:
            result["engine"] = ordered["headline"] | {"length_sorted": True}
    for batching in (True, False):
        mode = "on" if batching else "off"
        repository = variant_repository(scratch / model, model, batching)
        with pinned_server(repository, model, args.server_cpu, out / f"server-{mode}.log") as url:
            closed = _bench("closed", "--model", model, "--url", url, "--generator-cpu", str(args.generator_cpu),
                            "--concurrency", concurrency, "--duration", str(args.duration),
                            "--out", str(out / f"closed-{mode}"))
            stats = _stats(url, model)
        result[mode] = {
            "levels": closed["results"],
            "executions": stats["execution_count"],
            "inferences": stats["inference_count"],
            "dispatch_reasons": stats.get("dispatch_reasons", {}),
            "batch_cap": stats.get("batch_cap"),
        }
    return result


def _level(levels: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    return next(level for level in levels if level["concurrency"] == concurrency)


def markdown(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines = ["# Batching benchmark", "", f"Command: `{' '.join(args.argv)}`", ""]
    for model, result in results.items():
        ceiling = result["engine"]["engine_ceiling_items_s"]
        sorted_note = " (texts batched by neighbouring length)" if result["engine"].get("length_sorted") else ""
        lines += [f"## {model}", "",
                  (f"Engine alone (1 thread): {ceiling:,.0f} items/s at batch {result['engine']['best_batch_size']}"
                  f"{sorted_note}: the ceiling."),
                  "",
                  "| clients | on req/s | on p50 ms | on p99 ms | off req/s | off p50 ms | off p99 ms | on/off | on/ceiling |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for c in args.concurrency:
            on, off = _level(result["on"]["levels"], c), _level(result["off"]["levels"], c)
            ratio = on["req_s"] / off["req_s"] if off["req_s"] else float("nan")
            lines.append(
                f"| {c} | {on['req_s']:,.0f} | {on['latency_ms']['p50']:.2f} | {on['latency_ms']['p99']:.2f} "
                f"| {off['req_s']:,.0f} | {off['latency_ms']['p50']:.2f} | {off['latency_ms']['p99']:.2f} "
                f"| {ratio:.2f} | {on['items_s'] / ceiling:.2f} |"
            )
        on = result["on"]
        lines += ["", (f"Batching on: {on['inferences']:,} items in {on['executions']:,} executions "
                      f"(batch cap {on['batch_cap']}); dispatch reasons {on['dispatch_reasons']}."), ""]
    return "\n".join(lines)


def plot(results: dict[str, Any], concurrency: list[int], path: Path) -> None:
    """Served items/s (batching on and off) against concurrency, under each model's engine ceiling."""
    fig, axes = report.panels("served throughput vs the engine ceiling (server on CPU 0, 1 engine thread)", len(results))
    for ax, (model, result) in zip(axes, results.items()):
        for mode, style in (("on", "o-"), ("off", "s--")):
            levels = [_level(result[mode]["levels"], c) for c in concurrency]
            ax.plot(concurrency, [level["items_s"] for level in levels], style, label=f"batching {mode}")
        ceiling = result["engine"]["engine_ceiling_items_s"]
        report.hline(ax, ceiling, f"engine ceiling {ceiling:,.0f} items/s")
        report.log_axis(ax, "x", 2)
        ax.set_xlabel("clients (connections)")
        ax.set_ylabel("items/s")
        served = max(level["items_s"] for mode in ("on", "off") for level in result[mode]["levels"])
        ax.set_ylim(0, 1.1 * max(ceiling, served))
        ax.set_title(model, fontsize=9)
        ax.legend(fontsize=7)
    report.save(fig, path)


def write_report(out: Path, results: dict[str, Any], args: argparse.Namespace) -> None:
    """suite.json (with the machine), suite.png and suite.md (which shows the figure)."""
    record = {"command": args.argv, "machine": machine.machine_record(), "results": results}
    (out / "suite.json").write_text(json.dumps(record, indent=2))
    text = markdown(results, args)
    try:
        import matplotlib

        matplotlib.use("Agg")
        plot(results, args.concurrency, out / "suite.png")
        text += "\n![suite](suite.png)\n"
    except ImportError:
        text += "\nno plot: matplotlib is not installed\n"
    (out / "suite.md").write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.suite", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default="digits,minilm", help="comma-separated")
    parser.add_argument("--concurrency", default="1,8,32,64", help="comma-separated client counts")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per concurrency level")
    parser.add_argument("--engine-duration", type=float, default=3.0, help="seconds per engine batch size")
    parser.add_argument("--server-cpu", type=int, default=0)
    parser.add_argument("--generator-cpu", type=int, default=1)
    args = parser.parse_args(argv)
    args.argv = ["python", "-m", "loadtest.suite", *(sys.argv[1:] if argv is None else argv)]
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if shutil.which("wrk") is None or shutil.which("taskset") is None:
        parser.error("needs wrk and taskset (apt-get install -y wrk util-linux)")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for model in args.models.split(","):
            results[model] = run_model(model, args, Path(scratch))
    write_report(args.out, results, args)
    print((args.out / "suite.md").read_text())
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
