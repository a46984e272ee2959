"""Models the benchmarks build here, from a graph and random weights: no download, no training.
One writer, so each lands in a model folder exactly as the repository lays one out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from server.engines.registry import engine_entry
from server.layout import FIRST_VERSION, config_path, version_dir

OPSET = 17
IR_VERSION = 8  # readable by every onnxruntime the project supports


def onnx_bytes(graph: Any) -> bytes:
    """An ONNX graph (onnx.helper.make_graph) as a checked model file."""
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model.SerializeToString()


def write_onnx_model(root: Path, config: dict[str, Any], model: bytes) -> Path:
    """`root/<config's name>`: its config.yaml and its first version holding `model`."""
    folder = root / config["name"]
    version = version_dir(folder, FIRST_VERSION)
    version.mkdir(parents=True, exist_ok=True)
    (version / engine_entry("onnxruntime").artifact).write_bytes(model)
    config_path(folder).write_text(yaml.safe_dump({"engine": "onnxruntime", **config}, sort_keys=False))
    return folder
