"""How long an instance takes to merge a batch's requests into the engine's input, by batch size:
into a new array each batch, and into the instance's reused buffer (server/workers/pipeline.py).

The requests are images of 3x224x224 FP32 (602,112 bytes, one a request); the engine answers at
once, so what is timed is the pipeline's own work for a batch, merging most: what the server's
statistics count as a batch's compute input. Both ways run in one process, in turn, each batch
size --repeats times; the report is the median per batch and the ratio.

    taskset -c 0 python -m loadtest.merging --batch-sizes 8,16,32,64,124 --repeats 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.machine import machine_record
from loadtest.report import markdown_table
from server.config import ModelConfig
from server.engines.base import Engine, EngineDescription
from server.engines.signature import EngineSignature, TensorSignature
from server.workers.pipeline import REUSE_MIN_BYTES, ModelPipeline, paddable_inputs

SHAPE = (3, 224, 224)
HEADERS = ("batch", "MiB", "new array ms", "reused buffer ms", "new / reused")


class Answers(Engine):
    """Answers one score a row at once: the merge is the work."""

    def __init__(self) -> None:  # no artifact to load
        pass

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"scores": np.zeros((len(inputs["image"]), 1), np.float32)}

    def describe(self) -> EngineDescription:
        return EngineDescription("answers", "cpu", "fp32")

    def signature(self) -> EngineSignature:
        return EngineSignature(inputs=(), outputs=(TensorSignature("scores", "FP32", (None, 1)),))


def pipeline(max_batch: int, reuse_min_bytes: int) -> ModelPipeline:
    config = ModelConfig.model_validate({
        "name": "image224", "engine": "onnxruntime", "max_batch_size": max_batch, "dynamic_batching": {},
        "inputs": [{"name": "image", "datatype": "FP32", "dims": list(SHAPE)}],
        "outputs": [{"name": "scores", "datatype": "FP32", "dims": [1]}],
    })
    return ModelPipeline(config, Answers(), paddable_inputs(config, {}), reuse_min_bytes=reuse_min_bytes)


def timed(size: int, reuse_min_bytes: int, repeats: int, requests: list[dict[str, np.ndarray]]) -> float:
    """The median milliseconds of a batch of `size` requests, merging into a reused buffer from
    `reuse_min_bytes` up."""
    runner = pipeline(max(size, 2), reuse_min_bytes)
    for _ in range(3):  # first runs: the buffer made, the allocator's pools settled
        runner.run_batch(requests[:size])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.run_batch(requests[:size])
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    requests = [{"image": rng.random((1, *SHAPE), dtype=np.float32)} for _ in range(max(sizes))]
    rows = []
    for size in sizes:
        fresh = timed(size, sys.maxsize, repeats, requests)
        reused = timed(size, 0, repeats, requests)
        rows.append({"batch": size, "mib": round(size * requests[0]["image"].nbytes / 2**20, 1),
                     "new_array_ms": round(fresh, 2), "reused_buffer_ms": round(reused, 2),
                     "ratio": round(fresh / reused, 2)})
        print(f"batch {size}: new array {fresh:.2f} ms, reused buffer {reused:.2f} ms", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.merging", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="8,16,32,64,124", help="comma-separated")
    parser.add_argument("--repeats", type=int, default=30, help="batches timed per size and way")
    parser.add_argument("--out", type=Path, help="folder for merging.json and merging.md")
    args = parser.parse_args(argv)
    rows = measure([int(n) for n in args.batch_sizes.split(",")], args.repeats)
    table = markdown_table(HEADERS, [(r["batch"], r["mib"], r["new_array_ms"], r["reused_buffer_ms"], r["ratio"])
                                     for r in rows])
    print(f"\n{table}\nshipped: merges of {REUSE_MIN_BYTES / 2**20:g} MiB or more go into the reused buffer")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        record = {"command_line": " ".join(["python -m loadtest.merging", *(argv if argv is not None else sys.argv[1:])]),
                  "machine": machine_record(), "reuse_min_bytes": REUSE_MIN_BYTES, "shape": list(SHAPE),
                  "repeats": args.repeats, "rows": rows}
        (args.out / "merging.json").write_text(json.dumps(record, indent=2))
        (args.out / "merging.md").write_text(f"# Merging a batch of images\n\n`{record['command_line']}`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
