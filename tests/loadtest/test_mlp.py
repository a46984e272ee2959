"""The per-request cost benchmark's MLP: the model it writes, the requests sent to it, and the
engine-alone sweep over it. It checks the tool, not anyone's speed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort

from loadtest import engine, mlp, payloads
from server.config import load_model_config


def test_the_model_maps_256_floats_to_10_scores_in_batches_up_to_64(tmp_path: Path) -> None:
    folder = mlp.write_mlp_model(tmp_path)
    config = load_model_config(folder / "config.yaml")
    assert (config.max_batch_size, config.dynamic_batching.max_queue_delay_microseconds) == (64, 2000)
    session = ort.InferenceSession(str(folder / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    scores = session.run(None, {"x": mlp.items(64, 0)})[0]
    assert scores.shape == (64, 10) and np.isfinite(scores).all() and scores.std() > 0


def test_requests_carry_the_same_items_for_the_same_offset() -> None:
    request = payloads.build_request("mlp", items=2, offset=5)
    tensor = json.loads(request.body)["inputs"][0]
    assert (tensor["name"], tensor["datatype"], tensor["shape"]) == ("x", "FP32", [2, 256])
    np.testing.assert_array_equal(np.array(tensor["data"], np.float32).reshape(2, 256), mlp.items(2, 5))
    assert payloads.build_request("mlp", offset=6).body != request.body


def test_the_engine_alone_runs_the_servers_engine_over_it(tmp_path: Path) -> None:
    mlp.write_mlp_model(tmp_path)
    results = engine.sweep("mlp", tmp_path, [1, 4], duration_s=0.05, threads=1)
    assert [r.batch_size for r in results] == [1, 4] and all(r.runs >= 5 for r in results)
