"""A variant that declares `build:` in its config is built when the server loads it, and
served; a build the gate refuses leaves that model unavailable and the others serving."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import yaml

from tests.integration.conftest import MODELS, linked_repository, running_server


def _variant(root: Path, name: str, engine: str = "onnxruntime", **build: object) -> None:
    config = yaml.safe_load((MODELS / "digits" / "config.yaml").read_text())
    config.update(name=name, engine=engine, precision="int8")
    config["build"] = {"source": "digits", "engine": engine, "precision": "int8", **build}
    (root / name).mkdir()
    (root / name / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def test_a_declared_build_runs_at_load_and_serves(tmp_path: Path) -> None:
    root = linked_repository(tmp_path / "models", ("digits",))
    _variant(root, "digits-int8")
    _variant(root, "digits-int8-strict", options={"calibration": "zeros"})  # calibrated on blank images: fails
    _variant(root, "digits-torchao", engine="torch", options={"scheme": "dynamic"})
    with running_server(root, wait_ready=False) as url:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            index = {e["name"]: e for e in httpx.post(f"{url}/v2/repository/index", json={}).json()}
            settled = index["digits-int8-strict"]["state"] == "UNAVAILABLE"
            if settled and all(index[m].get("state") == "READY" for m in ("digits-int8", "digits-torchao")):
                break
            time.sleep(0.5)
        assert index["digits-int8"]["state"] == index["digits-torchao"]["state"] == "READY", index
        assert "quality gate" in index["digits-int8-strict"]["reason"]
        assert (root / "digits-int8" / "1" / "build.json").is_file()
        images = np.load(MODELS / "digits" / "1" / "heldout.npz")["images"][:32]
        body = {"inputs": [{"name": "image", "shape": list(images.shape), "datatype": "FP32", "data": images.ravel().tolist()}]}
        answers = {}
        for model in ("digits", "digits-int8", "digits-torchao"):
            response = httpx.post(f"{url}/v2/models/{model}/infer", json=body)
            assert response.status_code == 200, response.text
            answers[model] = np.array(response.json()["outputs"][0]["data"]).reshape(32, 10).argmax(1)
        assert (answers["digits"] == answers["digits-int8"]).mean() >= 0.95
        assert (answers["digits"] == answers["digits-torchao"]).mean() >= 0.95
