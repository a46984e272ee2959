"""Real builds of the default models on the CPU: published when they keep FP32's quality,
refused when they do not, reused when nothing changed. Each build is made once per session."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
import yaml

from server.cli import main as cli_main
from server.config import load_model_config
from server.errors import EngineError
from server.quantize.api import build
from server.quantize.ensure import ensure_built
from server.quantize.errors import BuildError
from server.quantize.reporting import report
from tests.unit.quantize.broken import break_calibration


def quiet(message: str) -> None:
    """Progress sink: tests do not print."""



@pytest.fixture(scope="session")
def digits_int8(shared_repository: Path):
    return build(shared_repository, "digits", "onnxruntime", "int8", progress=quiet,
                 bench_seconds=0.1, bench_batches=[1, 8])


@pytest.fixture(scope="session")
def minilm_int8(shared_repository: Path):
    return build(shared_repository, "minilm", "onnxruntime", "int8", progress=quiet,
                 bench_seconds=0.1, bench_batches=[1, 8])


def op_types(path: Path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path)).graph.node}


def test_digits_int8_is_static_qdq_and_published(digits_int8, shared_repository: Path) -> None:
    assert digits_int8.servable and digits_int8.version == 1 and not digits_int8.cache_hit
    folder = shared_repository / "digits-onnxruntime-int8"
    version = folder / "1"
    assert {"model.onnx", "build.json", "build.md", "build.png"} <= {p.name for p in version.iterdir()}
    assert {"QuantizeLinear", "DequantizeLinear"} <= op_types(version / "model.onnx")
    config = load_model_config(folder / "config.yaml")
    assert (config.engine, config.precision, config.build.source) == ("onnxruntime", "int8", "digits")
    quality = digits_int8.quality
    assert quality["passed"] and quality["metrics"]["accuracy"] >= 0.99 * quality["reference"]["accuracy"]
    assert quality["samples"] == 360
    bench = digits_int8.benchmark
    assert [b["batch"] for b in bench["buckets"]] == [1, 8] and bench["peak_rss_mb"] > 0
    assert bench["reference"]["buckets"] and bench["fp32_same_engine"]["buckets"]
    assert json.loads((version / "build.json").read_text())["cache_key"] == digits_int8.cache_key


def test_minilm_int8_keeps_embeddings(minilm_int8, shared_repository: Path) -> None:
    assert minilm_int8.servable
    metrics = minilm_int8.quality["metrics"]
    assert metrics["mean_cosine"] >= 0.99 and metrics["neighbour_agreement"] >= 0.94
    assert metrics["triplet_order_agreement"] == 1.0
    version = shared_repository / "minilm-onnxruntime-int8" / "1"
    assert (version / "tokenizer.json").is_file()
    assert minilm_int8.artifact["size_bytes"] < minilm_int8.source["size_bytes"] / 3
    assert "DynamicQuantizeLinear" in op_types(version / "model.onnx")
    assert not (Path.cwd() / "sym_shape_infer_temp.onnx").exists()  # ORT's failure dump stays in scratch
    assert not list(Path.cwd().glob("*-*-*-*-*.data"))


def test_second_identical_build_is_a_cache_hit(digits_int8, shared_repository: Path) -> None:
    again = build(shared_repository, "digits", "onnxruntime", "int8", progress=quiet)
    assert again.cache_hit and again.version == 1 and again.cache_key == digits_int8.cache_key
    assert sorted(p.name for p in (shared_repository / "digits-onnxruntime-int8").iterdir() if p.name.isdigit()) == ["1"]


def test_report_reprints_the_build(digits_int8, shared_repository: Path) -> None:
    text = report(shared_repository, "digits-onnxruntime-int8")
    assert "Quality vs FP32" in text and "| accuracy |" in text and "Speed" in text and "build.png" in text


@pytest.mark.parametrize(
    "model, engine, precision, options",
    [("digits", "onnxruntime", "fp16", {}), ("digits", "torch", "fp16", {}), ("digits", "torch", "bf16", {}),
     ("digits", "torch", "int8", {"scheme": "dynamic"}), ("digits", "torch", "int8", {"scheme": "weight_only"}),
     ("digits", "torch", "int8", {"scheme": "static"}), ("minilm", "onnxruntime", "fp16", {}),
     ("minilm", "onnxruntime", "fp32", {})],
)
def test_every_cpu_precision_builds_and_passes(shared_repository: Path, model: str, engine: str, precision: str,
                                               options: dict[str, str]) -> None:
    name = "-".join([model, engine, precision, *options.values()])
    result = build(shared_repository, model, engine, precision, name=name, options=options, progress=quiet,
                   benchmark=False)
    assert result.servable and result.quality["passed"], result.quality
    config = load_model_config(shared_repository / result.variant / "config.yaml")
    assert config.engine == engine and config.build.precision == precision


def test_torchao_schemes_quantize_the_linear_weights(shared_repository: Path) -> None:
    import torch

    from server.engines.torch import load_program

    sizes = {}
    for scheme in ("dynamic", "weight_only"):
        result = build(shared_repository, "digits", "torch", "int8", name=f"digits-torchao-{scheme}",
                       options={"scheme": scheme}, progress=quiet, benchmark=False)
        assert result.servable and "torchao" in result.method
        program = load_program(shared_repository / result.variant / "1" / "model.pt2")
        dtypes = {t.dtype for t in program.state_dict.values()} | {
            t.dtype for p in program.state_dict.values() for t in _inner(p)}
        assert torch.int8 in dtypes, dtypes
        sizes[scheme] = result.artifact["size_bytes"]
    assert max(sizes.values()) < result.source["size_bytes"]  # INT8 weights: a smaller program


def _inner(tensor: object) -> list:
    """The plain tensors inside a torchao tensor subclass (qdata, scale), or none."""
    names = getattr(tensor, "__tensor_flatten__", lambda: ([], None))()[0]
    return [getattr(tensor, name) for name in names]


def test_torch_int8_options_are_checked(repository: Path) -> None:
    with pytest.raises(BuildError, match="unknown build options"):
        build(repository, "digits", "torch", "int8", options={"calibration": "zeros"}, progress=quiet)
    with pytest.raises(BuildError, match="scheme must be one of"):
        build(repository, "digits", "torch", "int8", options={"scheme": "int4"}, progress=quiet)


def test_torch_static_int8_with_broken_calibration_fails_its_gate(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    break_calibration(monkeypatch, "zeros")
    broken = build(repository, "digits", "torch", "int8", options={"scheme": "static"},
                   progress=quiet, benchmark=False)
    assert not broken.servable and not broken.quality["passed"]


def test_broken_calibration_fails_and_the_model_stays_on_its_good_version(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = build(repository, "digits", "onnxruntime", "int8", progress=quiet, benchmark=False)
    assert good.servable and good.version == 1
    break_calibration(monkeypatch, "zeros")
    broken = build(repository, "digits", "onnxruntime", "int8", progress=quiet, benchmark=False)
    assert not broken.servable and broken.version is None
    assert not broken.quality["passed"] and broken.quality["metrics"]["accuracy"] < 0.9
    folder = repository / "digits-onnxruntime-int8"
    assert sorted(p.name for p in folder.iterdir() if p.name.isdigit()) == ["1"]
    assert (folder / "rejected" / broken.cache_key[:16] / "build.json").is_file()
    assert load_model_config(folder / "config.yaml").build.options == {}  # still the good build's config


def test_a_first_build_that_fails_leaves_no_model(repository: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    break_calibration(monkeypatch, "noise")
    broken = build(repository, "digits", "onnxruntime", "int8", name="garbage", progress=quiet, benchmark=False)
    assert not broken.servable
    assert not (repository / "garbage" / "config.yaml").exists()  # the server will not list it


def test_gate_not_enforced_publishes_with_the_failure_reported(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from server.config import BuildGate

    break_calibration(monkeypatch, "zeros")
    result = build(repository, "digits", "onnxruntime", "int8", gate=BuildGate(enforce=False), progress=quiet,
                   benchmark=False)
    assert result.servable and result.version == 1 and not result.quality["passed"]
    assert any("GATE FAILED" in note or "gate FAILED" in note for note in result.notes)


def test_force_rebuilds_as_a_new_version(repository: Path) -> None:
    first = build(repository, "digits", "torch", "bf16", progress=quiet, benchmark=False)
    forced = build(repository, "digits", "torch", "bf16", force=True, progress=quiet, benchmark=False)
    assert (first.version, forced.version) == (1, 2) and not forced.cache_hit


def test_unsupported_builds_say_what_is_supported(repository: Path) -> None:
    with pytest.raises(BuildError, match="supported: "):
        build(repository, "minilm", "onnxruntime", "bf16", progress=quiet)
    with pytest.raises(BuildError, match="starts from a torch model"):
        build(repository, "minilm", "torch", "int8", progress=quiet)
    with pytest.raises(BuildError, match="not in the repository"):
        build(repository, "nope", "onnxruntime", "int8", progress=quiet)
    with pytest.raises(BuildError, match="unknown build options"):
        build(repository, "digits", "onnxruntime", "int8", options={"per_chanel": True}, progress=quiet)


def test_tensorrt_fails_clearly_without_tensorrt(repository: Path) -> None:
    with pytest.raises(BuildError, match="TensorRT is not installed on this machine"):
        build(repository, "digits", "tensorrt", "fp16", progress=quiet, benchmark=False)
    assert not (repository / "digits-tensorrt-fp16").exists()


def _declare(repository: Path, name: str, **build_block) -> None:
    raw = yaml.safe_load((repository / "digits" / "config.yaml").read_text())
    raw.update(name=name, engine="onnxruntime", precision="int8", build={"source": "digits", "engine": "onnxruntime",
                                                                         "precision": "int8", **build_block})
    raw["dynamic_batching"] = {"max_queue_delay_microseconds": 500}  # hand-tuned: must survive the build
    (repository / name).mkdir()
    (repository / name / "config.yaml").write_text(yaml.safe_dump(raw))


def test_ensure_built_builds_once_then_reuses(repository: Path) -> None:
    _declare(repository, "digits-fast")
    config = load_model_config(repository / "digits-fast" / "config.yaml")
    assert ensure_built(repository, "digits-fast", config) == 1
    stamp = (repository / "digits-fast" / "1" / "build.json").stat().st_mtime_ns
    assert ensure_built(repository, "digits-fast", config) == 1
    assert (repository / "digits-fast" / "1" / "build.json").stat().st_mtime_ns == stamp
    kept = load_model_config(repository / "digits-fast" / "config.yaml")
    assert kept.dynamic_batching.max_queue_delay_microseconds == 500
    assert ensure_built(repository, "digits", load_model_config(repository / "digits" / "config.yaml")) is None


def test_ensure_built_refuses_a_build_that_fails_its_gate(repository: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    break_calibration(monkeypatch, "zeros")
    _declare(repository, "digits-bad")
    with pytest.raises(EngineError, match="failed its quality gate"):
        ensure_built(repository, "digits-bad", load_model_config(repository / "digits-bad" / "config.yaml"))


def test_cli_exit_codes(
    digits_int8, shared_repository: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = ["--model-repository", str(shared_repository)]
    assert cli_main(["build", "digits", "--engine", "onnxruntime", "--precision", "int8", *repo]) == 0
    assert "cache hit" in capsys.readouterr().out
    assert cli_main(["build", "digits", "--engine", "onnxruntime", "--precision", "int8", "--report", *repo]) == 0
    assert "Quality vs FP32" in capsys.readouterr().out
    assert cli_main(["build", "minilm", "--engine", "onnxruntime", "--precision", "bf16", *repo]) == 2
    break_calibration(monkeypatch, "zeros")
    assert cli_main(["build", "digits", "--engine", "onnxruntime", "--precision", "int8", "--name", "cli-broken",
                     "--no-benchmark", *repo]) == 1


def test_a_torch_rebuild_keeps_its_sources_batch_range_whatever_its_other_dims_allow() -> None:
    """The batch dim's own bound, not the tightest of every dynamic dim (a sequence capped at
    16 must not cap the batch at 16); a static source gets the builders' default."""
    import torch

    from server.quantize.torch_builds import MAX_BATCH, _batch_limit

    class Sum(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum(-1)

    example = (torch.ones(4, 8),)
    batch, sequence = torch.export.Dim("batch", min=1, max=1024), torch.export.Dim("sequence", min=2, max=16)
    assert _batch_limit(torch.export.export(Sum(), example, dynamic_shapes=({0: batch, 1: sequence},))) == 1024
    assert _batch_limit(torch.export.export(Sum(), example, dynamic_shapes=({0: torch.export.Dim("b", max=64)},))) == 64
    assert _batch_limit(torch.export.export(Sum(), example)) == MAX_BATCH


async def test_int8_builds_of_a_model_that_does_not_batch_and_of_one_with_a_sequence_dim(tmp_path: Path) -> None:
    """Calibration fed items as batches to a model with no batch dim (both engines failed), and
    the torch rebuild fixed every dim but the batch at the evaluation data's: a sequence dim
    the source left variable became 6, and the build failed its signature check."""
    import numpy as np
    import torch
    from onnx import TensorProto, helper

    from server.model_import import import_model
    from server.repository import ModelRepository
    from tests.unit.onnx_models import save
    from tests.unit.torch_models import Linear, SequenceMean

    torch.manual_seed(0)
    models, rng = tmp_path / "models", np.random.default_rng(0)
    torch.export.save(torch.export.export(Linear(4, 3), (torch.randn(2, 4),)), tmp_path / "fixed.pt2")
    dims = {0: torch.export.Dim("b", max=1024), 1: torch.export.Dim("length", max=512)}
    torch.export.save(torch.export.export(SequenceMean(4, 3), (torch.randn(2, 6, 4),), dynamic_shapes=(dims,)),
                      tmp_path / "sequence.pt2")
    weights = helper.make_tensor("w", TensorProto.FLOAT, [4, 3], rng.standard_normal(12).astype(np.float32).tolist())
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    save(helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "fixed", [x], [y], [weights]),
         tmp_path / "onnx")
    for name, artifact, items in (("fixed", tmp_path / "fixed.pt2", (100, 2, 4)),
                                  ("onnxfixed", tmp_path / "onnx" / "model.onnx", (100, 2, 4)),
                                  ("sequence", tmp_path / "sequence.pt2", (100, 6, 4))):
        folder = import_model(artifact, models, name)
        np.savez(folder / "eval" / "inputs.npz", x=rng.standard_normal(items))  # float64, as numpy makes data
    for name, engine in (("fixed", "torch"), ("onnxfixed", "onnxruntime"), ("sequence", "torch")):
        result = build(models, name, engine, "int8", progress=quiet, benchmark=False)
        assert result.servable, result.markdown()
    served = ModelRepository(models)
    await served.load("sequence-torch-int8")
    try:
        nine = np.ones((2, 9, 4), np.float32)  # a length the evaluation data never had
        output = served.get("sequence-torch-int8").config.outputs[0].name
        assert (await served.get("sequence-torch-int8").start_request({"x": ("FP32", nine)}))[output].shape == (2, 3)
    finally:
        await served.unload_all()
