"""Small ONNX graphs written on the fly, for tests that need a real artifact and its config."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import yaml
from onnx import TensorProto, helper, numpy_helper

BATCH = "batch"  # a symbolic dim: ONNX Runtime reports it as variable


def save(graph: onnx.GraphProto, version_dir: Path) -> Path:
    """Write `graph` as `version_dir/model.onnx` (opset 17, an IR version ORT reads)."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    version_dir.mkdir(parents=True, exist_ok=True)
    onnx.save(model, version_dir / "model.onnx")
    return version_dir


def doubling(version_dir: Path, width: int = 2) -> Path:
    """y = x + x, FP32 [batch, width] in and out."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, width])
    return save(
        helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "double", [x], [y]), version_dir
    )


def summed_over_the_batch(version_dir: Path, width: int = 2) -> Path:
    """y = the sum of x's rows, one row whatever the batch: a model that ignores the batch
    (its signature says [batch, width] out, as an export's symbolic dims may)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, width])
    axes = numpy_helper.from_array(np.array([0], dtype=np.int64), "axes")
    node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=1)
    return save(helper.make_graph([node], "sum", [x], [y], initializer=[axes]), version_dir)


def parse_and_double(version_dir: Path) -> Path:
    """Numbers sent as text: string `text` [batch, 1] is cast to float and doubled (`doubled`,
    FP32), and the result cast back to text (`doubled_text`, a string output)."""
    text = helper.make_tensor_value_info("text", TensorProto.STRING, [BATCH, 1])
    doubled = helper.make_tensor_value_info("doubled", TensorProto.FLOAT, [BATCH, 1])
    doubled_text = helper.make_tensor_value_info("doubled_text", TensorProto.STRING, [BATCH, 1])
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    nodes = [
        helper.make_node("Cast", ["text"], ["value"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["value", "two"], ["doubled"]),
        helper.make_node("Cast", ["doubled"], ["doubled_text"], to=TensorProto.STRING),
    ]
    graph = helper.make_graph(nodes, "parse_and_double", [text], [doubled, doubled_text], [two])
    return save(graph, version_dir)


def format_numbers(version_dir: Path) -> Path:
    """FP32 `x` [batch, 1] written as text: string output `text` [batch, 1]."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, 1])
    text = helper.make_tensor_value_info("text", TensorProto.STRING, [BATCH, 1])
    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["text"], to=TensorProto.STRING)], "format", [x], [text]
    )
    return save(graph, version_dir)


def unstated_rank(version_dir: Path) -> Path:
    """y = Squeeze(x, axes) with the axes an input: ONNX Runtime cannot tell y's rank before a run."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, 2])
    axes = helper.make_tensor_value_info("axes", TensorProto.INT64, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("Squeeze", ["x", "axes"], ["y"])], "squeeze", [x, axes], [y])
    return save(graph, version_dir)


def slow_classifier(version_dir: Path, width: int = 1024, layers: int = 160) -> Path:
    """digits' signature (`image` FP32 [batch, 1, 8, 8] -> `probabilities` [batch, 10]) with a
    deep stack of one shared `width` x `width` MatMul + Tanh: a model whose cost is compute, tens
    of milliseconds a batch on one thread, while its file stays a few MiB."""
    rng = np.random.default_rng(0)
    image = helper.make_tensor_value_info("image", TensorProto.FLOAT, [BATCH, 1, 8, 8])
    probabilities = helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, [BATCH, 10])
    weights = [
        numpy_helper.from_array(np.array([-1, 64], dtype=np.int64), "flat"),
        numpy_helper.from_array((rng.standard_normal((64, width)) / 8).astype(np.float32), "w_in"),
        numpy_helper.from_array((rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32), "w"),
        numpy_helper.from_array((rng.standard_normal((width, 10)) / np.sqrt(width)).astype(np.float32), "w_out"),
    ]
    nodes = [helper.make_node("Reshape", ["image", "flat"], ["h"]), helper.make_node("MatMul", ["h", "w_in"], ["m0"]),
             helper.make_node("Tanh", ["m0"], ["t0"])]
    for layer in range(1, layers + 1):
        nodes += [helper.make_node("MatMul", [f"t{layer - 1}", "w"], [f"m{layer}"]),
                  helper.make_node("Tanh", [f"m{layer}"], [f"t{layer}"])]
    nodes += [helper.make_node("MatMul", [f"t{layers}", "w_out"], ["logits"]),
              helper.make_node("Softmax", ["logits"], ["probabilities"], axis=-1)]
    return save(helper.make_graph(nodes, "slow_classifier", [image], [probabilities], weights), version_dir)


SLOW_CLASSIFIER_CONFIG: dict[str, Any] = {
    "engine": "onnxruntime",
    "max_batch_size": 4,
    "inputs": [{"name": "image", "datatype": "FP32", "dims": [1, 8, 8]}],
    "outputs": [{"name": "probabilities", "datatype": "FP32", "dims": [10]}],
}


PARSE_AND_DOUBLE_CONFIG: dict[str, Any] = {
    "engine": "onnxruntime",
    "max_batch_size": 8,
    "inputs": [{"name": "text", "datatype": "BYTES", "dims": [1]}],
    "outputs": [
        {"name": "doubled", "datatype": "FP32", "dims": [1]},
        {"name": "doubled_text", "datatype": "BYTES", "dims": [1]},
    ],
    "dynamic_batching": {},
    "warmup": {"inputs": {"text": "1.5"}},
}

FORMAT_NUMBERS_CONFIG: dict[str, Any] = {
    "engine": "onnxruntime",
    "max_batch_size": 8,
    "inputs": [{"name": "x", "datatype": "FP32", "dims": [1]}],
    "outputs": [{"name": "text", "datatype": "BYTES", "dims": [1]}],
}

DOUBLING_CONFIG: dict[str, Any] = {
    "engine": "onnxruntime",
    "max_batch_size": 4,
    "inputs": [{"name": "x", "datatype": "FP32", "dims": [2]}],
    "outputs": [{"name": "y", "datatype": "FP32", "dims": [2]}],
}


def write_model(root: Path, name: str, config: dict[str, Any], graph_writer: Callable[[Path], Path]) -> Path:
    """A repository entry: `root/name/config.yaml` and version 1 written by `graph_writer`."""
    folder = root / name
    graph_writer(folder / "1")
    (folder / "config.yaml").write_text(yaml.safe_dump({"name": name, **config}, sort_keys=False))
    return folder
