"""A user's own models, made here and never seen by the repository: an ONNX classifier and a
torch.export program, each imported with `batchline import`, given evaluation data in its
eval/ folder, built to INT8 and FP16 with `batchline build` (judged by the gate its data
calls for: accuracy with labels, relative error without), and served to tritonclient. A build
whose calibration is broken fails its gate and is never published. A third model records a
sample of the requests it serves (record_traffic) and is built from that recording."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.http as triton
import yaml
from sklearn.datasets import load_digits

from tests.integration.conftest import running_server
from tests.unit.quantize.broken import break_calibration

ROOT = Path(__file__).resolve().parents[2]


class Classifier(torch.nn.Module):
    """64 pixels -> 10 class probabilities: a small MLP, trained below in a second."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(64, 64)
        self.out = torch.nn.Linear(64, 10)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.out(torch.relu(self.hidden(pixels))), dim=-1)


def trained() -> tuple[Classifier, np.ndarray, np.ndarray]:
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    inputs, targets = torch.from_numpy(x[:1400]), torch.from_numpy(y[:1400])
    for _ in range(150):
        optimizer.zero_grad()
        loss = torch.nn.functional.nll_loss(torch.log(model(inputs) + 1e-9), targets)
        loss.backward()
        optimizer.step()
    return model.eval(), x[1400:], y[1400:]  # held out from training: the user's evaluation data


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)


def build(repository: Path, model: str, engine: str, precision: str, *options: str) -> dict:
    run = cli("build", model, "--engine", engine, "--precision", precision, "--model-repository", str(repository),
              "--bench-seconds", "0.2", "--json", *(f"--option={o}" for o in options))
    assert run.returncode in (0, 1), run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, np.ndarray, np.ndarray]]:
    """A repository with `mlp` (ONNX, eval data with labels) and `program` (torch.export, eval
    data without labels), both imported through the CLI."""
    folder = tmp_path_factory.mktemp("own")
    repository = folder / "models"
    model, x, y = trained()
    sample = torch.from_numpy(x[:8])
    batch = torch.export.Dim("batch", min=1, max=1024)
    torch.onnx.export(model, (sample,), str(folder / "mlp.onnx"), input_names=["pixels"], output_names=["probs"],
                      dynamic_shapes={"pixels": {0: batch}}, dynamo=True, external_data=False)
    program = torch.export.export(model, (sample,), dynamic_shapes={"pixels": {0: batch}})
    torch.export.save(program, folder / "program.pt2")
    for artifact, name in (("mlp.onnx", "mlp"), ("program.pt2", "program"), ("program.pt2", "recorder")):
        run = cli("import", str(folder / artifact), "--name", name, "--model-repository", str(repository))
        assert run.returncode == 0, run.stderr
    assert (repository / "mlp" / "eval").is_dir()  # import makes it, for the data builds are judged on
    np.savez(repository / "mlp" / "eval" / "inputs.npz", pixels=x)
    np.save(repository / "mlp" / "eval" / "labels.npy", y)
    names = _input_names(repository / "program")
    np.savez(repository / "program" / "eval" / "inputs.npz", **{names[0]: x})
    yield repository, x, y


def _input_names(model_dir: Path) -> list[str]:
    from server.config import load_model_config

    return [t.name for t in load_model_config(model_dir / "config.yaml").inputs]


def test_an_imported_onnx_classifier_builds_int8_and_fp16_gated_on_its_labels(own: tuple[Path, np.ndarray, np.ndarray]) -> None:
    repository, _, _ = own
    for precision in ("int8", "fp16"):
        report = build(repository, "mlp", "onnxruntime", precision)
        quality = report["quality"]
        assert quality["kind"] == "classification" and "eval/inputs.npz" in quality["data"], quality
        assert quality["passed"] and report["servable"] and report["version"] == 1, quality
        assert quality["metrics"]["accuracy"] >= 0.99 * quality["reference"]["accuracy"]
        assert quality["samples"] == 397 - 198  # the items the calibration split left for evaluation
    int8 = json.loads((repository / "mlp-onnxruntime-int8" / "1" / "build.json").read_text())
    assert "static" in int8["method"] or "QDQ" in int8["method"], int8["method"]  # calibrated on eval/ items


def test_a_broken_calibration_fails_the_gate_and_is_never_published(
    own: tuple[Path, np.ndarray, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    from server.quantize.api import build as build_here

    repository, _, _ = own
    break_calibration(monkeypatch, "noise")
    report = build_here(repository, "mlp", "onnxruntime", "int8", name="mlp-broken", benchmark=False,
                        progress=lambda _: None)
    assert not report.quality["passed"] and not report.servable and report.version is None
    assert "rejected" in report.location and not (repository / "mlp-broken" / "config.yaml").exists()


def test_a_torch_program_without_labels_is_judged_by_relative_error(own: tuple[Path, np.ndarray, np.ndarray]) -> None:
    repository, _, _ = own
    for precision, options in (("fp16", ()), ("int8", ("scheme=weight_only",))):
        report = build(repository, "program", "torch", precision, *options)
        quality = report["quality"]
        assert quality["kind"] == "tensor", quality
        assert [c["metric"] for c in quality["checks"]] == ["mean_relative_error"]
        assert quality["passed"] and report["servable"], quality
        assert 0 < quality["metrics"]["mean_relative_error"] <= 0.02


def test_the_builds_serve_to_tritonclient_with_the_originals_answers(own: tuple[Path, np.ndarray, np.ndarray]) -> None:
    repository, x, y = own
    served = ["mlp", "mlp-onnxruntime-int8", "mlp-onnxruntime-fp16", "program", "program-torch-fp16"]
    with running_server(repository, *[a for m in served for a in ("--model", m)], "--grpc-port", "0") as url:
        client = triton.InferenceServerClient(url.removeprefix("http://"))
        answers = {}
        for model in served:
            config = client.get_model_config(model)
            parts = []
            for start in range(0, len(x), config["max_batch_size"]):  # 32, as the import wrote it
                chunk = x[start : start + config["max_batch_size"]]
                pixels = triton.InferInput(config["input"][0]["name"], list(chunk.shape), "FP32")
                pixels.set_data_from_numpy(chunk)
                parts.append(client.infer(model, [pixels]).as_numpy(config["output"][0]["name"]))
            answers[model] = np.concatenate(parts)
    fp32 = answers["mlp"].argmax(1)
    assert (fp32 == y).mean() > 0.85  # the user's model is a real classifier
    for model in served[1:]:
        assert (answers[model].argmax(1) == fp32).mean() >= 0.98, model


def infer_all(client: triton.InferenceServerClient, model: str, x: np.ndarray) -> np.ndarray:
    config = client.get_model_config(model)
    parts = []
    for start in range(0, len(x), config["max_batch_size"]):
        chunk = x[start : start + config["max_batch_size"]]
        pixels = triton.InferInput(config["input"][0]["name"], list(chunk.shape), "FP32")
        pixels.set_data_from_numpy(chunk)
        parts.append(client.infer(model, [pixels]).as_numpy(config["output"][0]["name"]))
    return np.concatenate(parts)


def test_a_model_recording_its_traffic_is_built_from_what_it_served(own: tuple[Path, np.ndarray, np.ndarray]) -> None:
    repository, x, _ = own
    path = repository / "recorder" / "config.yaml"
    config = yaml.safe_load(path.read_text())
    # a rate no sequence of requests reaches, however fast the server answers: every request is considered
    config["record_traffic"] = {"max_items": 300, "max_per_second": 1e6, "write_every_seconds": 3600}
    path.write_text(yaml.safe_dump(config))
    with running_server(repository, "--model", "recorder", "--grpc-port", "0") as url:
        infer_all(triton.InferenceServerClient(url.removeprefix("http://")), "recorder", x)
    # written when the model was unloaded at shutdown: the 8 first items of each 32-item request
    with np.load(repository / "recorder" / "eval" / "recorded.npz") as recorded:
        name = config["inputs"][0]["name"]
        assert recorded.files == [name] and recorded[name].shape == (8 * 13, 64)  # 13 requests, 397 items
    report = build(repository, "recorder", "torch", "fp16")
    assert report["servable"] and "recorded.npz" in report["quality"]["data"], report["quality"]
    assert report["quality"]["kind"] == "tensor" and report["quality"]["passed"]
