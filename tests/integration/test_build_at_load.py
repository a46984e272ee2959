"""A variant that declares `build:` in its config is built when the server loads it, and
served; a build the gate refuses leaves that model unavailable and the others serving."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from tests.integration.conftest import MODELS, linked_repository, running_server


def _variant(root: Path, name: str, engine: str = "onnxruntime", precision: str = "int8", **build: object) -> None:
    config = yaml.safe_load((MODELS / "digits" / "config.yaml").read_text())
    config.update(name=name, engine=engine, precision=precision)
    config["build"] = {"source": "digits", "engine": engine, "precision": precision, **build}
    (root / name).mkdir()
    (root / name / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def test_a_declared_build_runs_at_load_and_serves(tmp_path: Path) -> None:
    root = linked_repository(tmp_path / "models", ("digits",))
    _variant(root, "digits-int8")
    # a gate no INT8 build can pass: outputs within a billionth of FP32's
    _variant(root, "digits-int8-strict", gate={"kind": "tensor", "max_mean_relative_error": 1e-9})
    _variant(root, "digits-torchao", engine="torch", options={"scheme": "dynamic"})
    with running_server(root, wait_ready=False) as url:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            index = {e["name"]: e for e in httpx.post(f"{url}/v2/repository/index", json={}).json()}
            settled = index["digits-int8-strict"]["state"] == "UNAVAILABLE"
            # digits too: its batch profile waits for the builds (it would time them, not itself)
            if settled and all(index[m].get("state") == "READY" for m in ("digits", "digits-int8", "digits-torchao")):
                break
            time.sleep(0.5)
        assert index["digits"]["state"] == index["digits-int8"]["state"] == index["digits-torchao"]["state"] == "READY", index
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
        parameters = httpx.get(f"{url}/v2/models/digits-torchao/config").json()["parameters"]
        assert (parameters["precision"]["string_value"], parameters["build_precision"]["string_value"]) == ("fp32", "int8")


def test_an_fp16_io_build_serves_fp16_to_tritonclient(tmp_path: Path) -> None:
    """keep_io_types: false makes the variant's image and probabilities FP16 on the wire."""
    import tritonclient.http as triton
    from tritonclient.utils import InferenceServerException

    root = linked_repository(tmp_path / "models", ("digits",))
    _variant(root, "digits-fp16-io", precision="fp16", options={"keep_io_types": False})
    with running_server(root) as url:
        client = triton.InferenceServerClient(url.removeprefix("http://"))
        metadata = client.get_model_metadata("digits-fp16-io")
        assert [t["datatype"] for t in metadata["inputs"] + metadata["outputs"]] == ["FP16", "FP16"]
        images = np.load(MODELS / "digits" / "1" / "heldout.npz")["images"][:16].astype(np.float16)
        request = triton.InferInput("image", list(images.shape), "FP16")
        request.set_data_from_numpy(images, binary_data=True)
        answer = client.infer("digits-fp16-io", [request]).as_numpy("probabilities")
        assert answer.dtype == np.float16 and answer.shape == (16, 10)
        reference = client.infer("digits", [_fp32(triton, images)]).as_numpy("probabilities")
        assert (answer.argmax(1) == reference.argmax(1)).all()
        with pytest.raises(InferenceServerException, match="FP16"):  # FP32 to an FP16 input: a 400
            client.infer("digits-fp16-io", [_fp32(triton, images)])


def _fp32(triton, images: np.ndarray):  # type: ignore[no-untyped-def]
    request = triton.InferInput("image", list(images.shape), "FP32")
    request.set_data_from_numpy(images.astype(np.float32), binary_data=True)
    return request
