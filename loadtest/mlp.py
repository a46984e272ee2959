"""The per-request cost benchmark's model: a 256-float MLP (256 -> 1024 -> 1024 -> 10, ReLU),
ONNX Runtime on one thread, max batch 64, a 2 ms batching window. Its compute per item is small
next to what a request costs the server (parsing, queueing, encoding), so the server's own cost
per request is what its throughput shows. Weights are random (seeded): only the work matters.

    python -m loadtest.mlp FOLDER      # writes FOLDER/mlp (config.yaml, 1/model.onnx)
    taskset -c 0 batchline serve --model-repository FOLDER --engine-threads 1
    batchline bench closed --model mlp --concurrency 1,8,32,64 --generator-cpu 1 --out out/mlp
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np

from loadtest.localmodels import onnx_bytes, write_onnx_model

NAME = "mlp"
INPUT = "x"
WIDTH = 256
HIDDEN = 1024
CLASSES = 10
MAX_BATCH = 64
WINDOW_US = 2000


def mlp_onnx(seed: int = 0) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    sizes = [WIDTH, HIDDEN, HIDDEN, CLASSES]
    nodes, initializers, current = [], [], INPUT
    for layer, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        weight, bias, out = f"W{layer}", f"b{layer}", f"h{layer}"
        initializers += [
            numpy_helper.from_array(rng.normal(0, fan_in ** -0.5, (fan_in, fan_out)).astype(np.float32), weight),
            numpy_helper.from_array(np.zeros(fan_out, np.float32), bias),
        ]
        nodes.append(helper.make_node("Gemm", [current, weight, bias], [out]))
        current = out
        if layer < len(sizes) - 2:
            nodes.append(helper.make_node("Relu", [out], [f"r{layer}"]))
            current = f"r{layer}"
    nodes.append(helper.make_node("Identity", [current], ["scores"]))
    graph = helper.make_graph(nodes, NAME, [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, ["batch", WIDTH])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", CLASSES])],
                              initializer=initializers)
    return onnx_bytes(graph)


def write_mlp_model(root: Path) -> Path:
    """`root/mlp`: its config and version 1."""
    config = {
        "name": NAME, "max_batch_size": MAX_BATCH,
        "inputs": [{"name": INPUT, "datatype": "FP32", "dims": [WIDTH]}],
        "outputs": [{"name": "scores", "datatype": "FP32", "dims": [CLASSES]}],
        "dynamic_batching": {"max_queue_delay_microseconds": WINDOW_US},
        "onnxruntime": {"intra_op_num_threads": 1, "inter_op_num_threads": 1},
        "warmup": {"batch_sizes": [1, MAX_BATCH]},
    }
    return write_onnx_model(root, config, mlp_onnx())


def items(count: int, offset: int) -> np.ndarray:
    """`count` inputs [count, 256], the same for the same offset."""
    rng = np.random.default_rng(offset)
    return rng.normal(0, 1, (count, WIDTH)).astype(np.float32)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m loadtest.mlp FOLDER  (writes FOLDER/mlp, a model repository entry)", file=sys.stderr)
        return 2
    print(write_mlp_model(Path(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
