"""`bench shm`: the image model it builds answers through both ways alike, and a short run of the
mode against the server it starts writes its report. It checks the tool, not the server's speed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort

from loadtest import sharedmem
from tests.integration.conftest import require_tool
from tests.loadtest.conftest import assert_figure, bench


def test_the_image_model_takes_an_image_and_scores_a_thousand_classes(tmp_path: Path) -> None:
    folder = sharedmem.write_image_model(tmp_path)
    session = ort.InferenceSession(str(folder / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    scores = session.run(None, {"image": np.ones((2, *sharedmem.SHAPE), np.float32)})[0]
    assert scores.shape == (2, sharedmem.CLASSES) and np.isfinite(scores).all()


def test_the_two_requests_carry_the_same_image_two_ways() -> None:
    image = np.arange(np.prod(sharedmem.SHAPE), dtype=np.float32).reshape(1, *sharedmem.SHAPE)
    prepared = sharedmem.requests(image)
    binary = prepared["binary"]
    length = int(binary.headers[sharedmem.HEADER_LENGTH])
    assert np.array_equal(np.frombuffer(binary.body[length:], np.float32).reshape(image.shape), image)
    shm = json.loads(prepared["shm"].body)
    assert shm["inputs"][0]["parameters"] == {"shared_memory_region": sharedmem.REGION,
                                              "shared_memory_byte_size": image.nbytes}
    assert len(prepared["shm"].body) < 400  # the image is not in it


def test_a_short_run_measures_both_ways(tmp_path: Path) -> None:
    require_tool("wrk", "wrk")
    out = tmp_path / "shm"
    bench("shm", "--out", str(out), "--concurrency", "1", "--duration", "1", "--warmup", "0", timeout=300)
    record = json.loads((out / "shm.json").read_text())
    assert [(level["way"], level["concurrency"]) for level in record["results"]] == [("binary", 1), ("shm", 1)]
    for level in record["results"]:
        assert level["req_s"] > 0 and level["error_count"] == 0, level
    assert "system_shared_memory" in record["server"]["extensions"]
    assert "shm/binary" in assert_figure(out, "shm")
