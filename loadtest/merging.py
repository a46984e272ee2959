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
import statistics
import sys
import time

import numpy as np

from server.config import ModelConfig
from server.engines.base import Engine, EngineDescription
from server.engines.signature import EngineSignature, TensorSignature
from server.workers import pipeline as pipeline_module
from server.workers.pipeline import ModelPipeline, paddable_inputs

SHAPE = (3, 224, 224)


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


def pipeline(max_batch: int) -> ModelPipeline:
    config = ModelConfig.model_validate({
        "name": "image224", "engine": "onnxruntime", "max_batch_size": max_batch, "dynamic_batching": {},
        "inputs": [{"name": "image", "datatype": "FP32", "dims": list(SHAPE)}],
        "outputs": [{"name": "scores", "datatype": "FP32", "dims": [1]}],
    })
    return ModelPipeline(config, Answers(), paddable_inputs(config, {}))


def timed(size: int, reuse_min_bytes: int, repeats: int, requests: list[dict[str, np.ndarray]]) -> float:
    """The median milliseconds of a batch of `size` requests, merging into a reused buffer from
    `reuse_min_bytes` up."""
    shipped, pipeline_module.REUSE_MIN_BYTES = pipeline_module.REUSE_MIN_BYTES, reuse_min_bytes
    try:
        runner = pipeline(max(size, 2))
        for _ in range(3):  # first runs: the buffer made, the allocator's pools settled
            runner.run_batch(requests[:size])
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            runner.run_batch(requests[:size])
            times.append(time.perf_counter() - start)
    finally:
        pipeline_module.REUSE_MIN_BYTES = shipped
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.merging", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="8,16,32,64,124", help="comma-separated")
    parser.add_argument("--repeats", type=int, default=30, help="batches timed per size and way")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.batch_sizes.split(",")]
    rng = np.random.default_rng(0)
    requests = [{"image": rng.random((1, *SHAPE), dtype=np.float32)} for _ in range(max(sizes))]
    shipped = pipeline_module.REUSE_MIN_BYTES
    print("| batch | MiB | new array ms | reused buffer ms | new / reused |")
    print("|---:|---:|---:|---:|---:|")
    for size in sizes:
        fresh = timed(size, sys.maxsize, args.repeats, requests)
        reused = timed(size, 0, args.repeats, requests)
        mib = size * requests[0]["image"].nbytes / 2**20
        print(f"| {size} | {mib:.1f} | {fresh:.2f} | {reused:.2f} | {fresh / reused:.2f} |", flush=True)
    print(f"\nshipped: batches of {shipped / 2**20:g} MiB or more merge into the reused buffer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
