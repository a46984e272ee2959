"""A tiny ONNX model built by the tests themselves: no artifact to ship, loads in milliseconds.

`spin` echoes its input (y = x) after spinning a small matrix product max(x) times, so a
request chooses its own cost: x = 0 is free, x = 50_000 keeps an instance busy for seconds.
The echo lets a test tell which request an output belongs to.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import yaml

SIDE = 128  # one iteration is a 128x128 matrix product: tens of microseconds on one core


def spin_onnx() -> bytes:
    """y = x, after max(x) iterations of s = tanh(s @ W) that y depends on (so nothing prunes them)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weights = (np.random.default_rng(0).standard_normal((SIDE, SIDE)) / np.sqrt(SIDE)).astype(np.float32)
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["s_in", "W"], ["product"]),
            helper.make_node("Tanh", ["product"], ["s_out"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "spin_body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("s_in", TensorProto.FLOAT, [SIDE, SIDE]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("s_out", TensorProto.FLOAT, [SIDE, SIDE]),
        ],
    )
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMax", ["x"], ["most"], keepdims=0),
            helper.make_node("Cast", ["most"], ["trips"], to=TensorProto.INT64),
            helper.make_node("Loop", ["trips", "always", "s0"], ["s_final"], body=body),
            helper.make_node("ReduceMean", ["s_final"], ["mean"], keepdims=0),
            helper.make_node("Mul", ["mean", "zero"], ["nothing"]),
            helper.make_node("Add", ["x", "nothing"], ["y"]),
        ],
        "spin",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1])],
        initializer=[
            numpy_helper.from_array(weights, "W"),
            numpy_helper.from_array(np.eye(SIDE, dtype=np.float32), "s0"),
            numpy_helper.from_array(np.array(True), "always"),
            numpy_helper.from_array(np.array(0, dtype=np.float32), "zero"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # readable by every onnxruntime the project supports
    onnx.checker.check_model(model)
    return model.SerializeToString()


def spin_config(name: str, **overrides: Any) -> dict[str, Any]:
    """A config.yaml document for `spin`; top-level keys in `overrides` replace the defaults."""
    config: dict[str, Any] = {
        "name": name,
        "engine": "onnxruntime",
        "max_batch_size": 8,
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [1]}],
        "dynamic_batching": {"max_queue_delay_microseconds": 0},
        "onnxruntime": {"intra_op_num_threads": 1, "inter_op_num_threads": 1},
        "warmup": {"batch_sizes": [1]},
    }
    config.update(overrides)
    return config


def write_spin_model(root: Path, name: str, **overrides: Any) -> Path:
    """`root/name/config.yaml` and `root/name/1/model.onnx`; the model's folder."""
    folder = root / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "1" / "model.onnx").write_bytes(spin_onnx())
    (folder / "config.yaml").write_text(yaml.safe_dump(spin_config(name, **overrides), sort_keys=False))
    return folder
