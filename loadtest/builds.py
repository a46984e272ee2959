"""`bench builds`: the precision table of a machine, every build of a model judged and timed there.

One command makes the table docs/benchmarks.md asks for on each machine: on a GPU machine
(`--device gpu`) every FP16 / BF16 / INT8 build of the model that runs on a GPU, TensorRT plans
included, each judged against FP32 and timed against FP32 on GPU 0; on a CPU machine the CPU
builds. The builds go into a scratch repository that links the model's built version (the real
repository is never written), through `server.quantize.api.build`, so each row is the figures of one
build report: quality against FP32 and speed against FP32 measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from loadtest import payloads, report, runs
from server.layout import EVAL_DIR, config_path, is_version_folder
from server.quantize.bench import DEFAULT_BATCHES

# (engine, precision, options) per device; a model's build that does not apply (e.g. static
# calibration for a text model) is reported as refused with the builder's reason.
BUILDS: dict[str, list[tuple[str, str, dict[str, Any]]]] = {
    "cpu": [
        ("onnxruntime", "fp32", {}), ("onnxruntime", "fp16", {}), ("onnxruntime", "int8", {}),
        ("torch", "bf16", {}), ("torch", "int8", {"scheme": "dynamic"}),
        ("torch", "int8", {"scheme": "weight_only"}), ("torch", "int8", {"scheme": "static"}),
    ],
    "gpu": [
        ("onnxruntime", "fp32", {}), ("onnxruntime", "fp16", {}), ("onnxruntime", "int8", {}),
        ("torch", "fp16", {}), ("torch", "bf16", {}), ("torch", "int8", {"scheme": "weight_only"}),
        ("tensorrt", "fp16", {}), ("tensorrt", "bf16", {}), ("tensorrt", "int8", {}),
    ],
}

HELP = """Builds --model in every precision of --device's list into a scratch repository (the model's
version 1 and eval/ linked from --model-repository, never written), each judged against FP32 on the
model's held-out data and timed engine-alone against FP32 on the same device (--bench-seconds per batch
size, one thread), and tabulates the build reports: the gate's figures, size, and the speedup over FP32
per batch size. Builds that cannot be made here (no TensorRT, a torch build of an ONNX model) are listed
with the reason. --device gpu needs a visible GPU; run it where one is lent."""


def add_parser(modes: Any, parents: runs.Parents) -> None:
    parser = modes.add_parser("builds", parents=[parents.common], help="every precision build of a model, tabulated",
                              description=HELP, formatter_class=runs.Formatter)
    parser.add_argument("--model-repository", type=Path, default=payloads.MODELS, help="model repository folder")
    parser.add_argument("--device", choices=sorted(BUILDS), default="cpu", help="where builds are judged and timed")
    parser.add_argument("--bench-seconds", type=float, default=1.0, help="timed seconds per batch size")
    parser.add_argument("--batch-sizes", type=runs.ints, default=list(DEFAULT_BATCHES),
                        help="comma-separated (default: the sizes a build report times)")
    parser.add_argument("--only", type=lambda text: [t for t in text.split(",") if t], default=None,
                        help="comma-separated builds of the list to make, named without the model, "
                             "e.g. onnxruntime-int8,torch-int8-weight_only (default: all)")


def scratch_repository(source: Path, model: str) -> Path:
    """A temporary repository holding `model`, linked from `source` (see link_model)."""
    root = Path(tempfile.mkdtemp(prefix="batchline-builds-"))
    link_model(source, root, model)
    return root


def link_model(source: Path, root: Path, model: str) -> None:
    """`model` of repository `source` into repository `root`: its config copied (free to edit),
    its version folders and eval/ linked, so builds into `root` never write `source`."""
    (root / model).mkdir(parents=True)
    shutil.copyfile(config_path(source / model), config_path(root / model))
    for part in (source / model).iterdir():
        if part.name == EVAL_DIR or is_version_folder(part):
            (root / model / part.name).symlink_to(part.resolve())


def build_name(engine: str, precision: str, options: dict[str, Any]) -> str:
    return "-".join([engine, precision, *(str(v) for v in options.values())])


def chosen(device: str, only: list[str] | None) -> list[tuple[str, str, dict[str, Any]]]:
    """The device's builds, or those of them `only` names; an unknown name is an error."""
    builds = BUILDS[device]
    if only is None:
        return builds
    names = {build_name(*b): b for b in builds}
    unknown = sorted(set(only) - set(names))
    if unknown:
        raise SystemExit(f"bench builds: --only {unknown} not in the {device} list {sorted(names)}")
    return [names[name] for name in only]


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, str]:
    from server.errors import BatchlineError
    from server.quantize.api import build
    from server.quantize.progress import bars
    from server.quantize.references import References

    todo = chosen(args.device, args.only)
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # as `batchline` does: CUDA and NVML agree
    repository = scratch_repository(args.model_repository, args.model)
    parameters = {"model": args.model, "model_repository": str(args.model_repository), "device": args.device,
                  "bench_seconds": args.bench_seconds, "batch_sizes": args.batch_sizes,
                  "builds": [build_name(*b) for b in todo]}
    record = runs.record(args, argv, parameters)
    entries: list[dict[str, Any]] = []
    references = References()  # FP32 evaluated and timed once for every build of the model
    try:
        for engine, precision, options in todo:
            name = f"{args.model}-{build_name(engine, precision, options)}"
            print(f"{name}: building", file=sys.stderr, flush=True)
            try:
                built = build(repository, args.model, engine, precision, name=name, options=options,
                              device=args.device, bench_seconds=args.bench_seconds, bench_batches=args.batch_sizes,
                              progress=lambda m: print(m, file=sys.stderr, flush=True), track=bars(sys.stderr),
                              references=references)
            except BatchlineError as exc:
                entries.append({"name": name, "engine": engine, "precision": precision, "refused": exc.message})
                continue
            except Exception as exc:  # noqa: BLE001 - a library's own failure is a row of the table, not the end
                entries.append({"name": name, "engine": engine, "precision": precision,
                                "refused": f"failed: {type(exc).__name__}: {exc}"})
                continue
            entries.append({"name": name, "engine": engine, "precision": precision, "report": built.to_dict()})
    finally:
        shutil.rmtree(repository, ignore_errors=True)
    record["results"] = entries
    for entry in entries:
        if "refused" in entry:
            record["notes"].append(f"{entry['name']}: not built: {entry['refused']}")
    quality = quality_names(entries)
    headers = ["build", "gate", *quality, "size MB", *[f"speedup @{b}" for b in args.batch_sizes], "GPU MB"]
    rows = [table_row(entry, quality, args.batch_sizes) for entry in entries if "report" in entry]
    made = [e for e in entries if "report" in e]
    summary = [(f"{len(made)} of {len(entries)} builds of {args.model} made on the {args.device.upper()}; "
                "speedup is FP32's latency over the build's, both timed in the same run")]

    def plot(path: Path) -> None:
        fig, ax = report.figure(f"{args.model}: builds vs FP32 on the {args.device.upper()} (engine alone, 1 thread)")
        width = 0.8 / max(len(args.batch_sizes), 1)
        for i, batch in enumerate(args.batch_sizes):
            column = headers.index(f"speedup @{batch}")
            ax.bar([k + i * width for k in range(len(rows))], [row[column] or 0 for row in rows], width,
                   label=f"batch {batch}")
        ax.axhline(1.0, color="grey", linestyle=":")
        ax.set_xticks([k + width * (len(args.batch_sizes) - 1) / 2 for k in range(len(rows))])
        ax.set_xticklabels([row[0].removeprefix(f"{args.model}-") for row in rows], rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("speedup over FP32")
        ax.legend(fontsize=8)
        report.save(fig, path)

    return report.write(args.out, "builds", record, headers, rows, summary, plot)


def quality_names(entries: list[dict[str, Any]]) -> list[str]:
    """The gate's figures the reports carry, in the order of the first report."""
    for entry in entries:
        if "report" in entry:
            return list(entry["report"]["quality"]["metrics"])
    return []


def table_row(entry: dict[str, Any], quality: list[str], batches: list[int]) -> list[Any]:
    """One build's row, read from its report as `batchline build --report` reads it."""
    from server.quantize.reporting import BuildReport

    built = BuildReport.from_dict(entry["report"])
    measured = built.speedups()
    speedups = [round(measured[b], 2) if b in measured else None for b in batches]
    figures = [built.quality["metrics"].get(name) for name in quality]
    size = round(built.artifact["size_bytes"] / 1e6, 2)
    return [entry["name"], "pass" if built.gate_passed else "FAIL", *figures, size, *speedups,
            (built.benchmark or {}).get("gpu_memory_mb")]
