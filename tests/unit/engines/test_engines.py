"""Engines: provider selection and verification, GPU guards, and precision casting, on the CPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from server.config import ModelConfig, OnnxRuntimeOptions
from server.devices import Device, visible_gpu_count
from server.engines import create_engine
from server.engines.onnxruntime import check_providers, requested_providers
from server.engines.spec import EngineIO, EngineSpec
from server.errors import EngineError
from tests.integration.conftest import require_built_models

MODELS = Path(__file__).resolve().parents[3] / "models"


def config(**overrides) -> ModelConfig:
    document = {
        "name": "double",
        "engine": "onnxruntime",
        "max_batch_size": 4,
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [2]}],
        **overrides,
    }
    return ModelConfig.model_validate(document)


def ort_spec(cfg: ModelConfig, artifact: Path) -> EngineSpec[OnnxRuntimeOptions]:
    """What the ONNX Runtime engine is given for `cfg`, its artifact at `artifact` (only hashed,
    for the TensorRT provider's cache folder)."""
    return EngineSpec(artifact, EngineIO.from_config(cfg), cfg.precision, cfg.onnxruntime)


@pytest.fixture
def doubling_model(tmp_path: Path) -> Path:
    """A one-node ONNX graph y = x + x, written to version folder 1."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "double", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    (tmp_path / "1").mkdir()
    onnx.save(model, tmp_path / "1" / "model.onnx")
    return tmp_path / "1"


def test_cpu_instances_never_ask_for_gpu_providers(tmp_path: Path) -> None:
    cfg = config(onnxruntime={"execution_providers": ["CUDAExecutionProvider", "CPUExecutionProvider"]})
    assert requested_providers(ort_spec(cfg, tmp_path / "m.onnx"), Device("CPU")) == ["CPUExecutionProvider"]


def test_gpu_instances_pin_their_device_and_keep_a_cpu_fallback(artifact: Path) -> None:
    assert requested_providers(ort_spec(config(), artifact), Device("GPU", 1)) == [
        ("CUDAExecutionProvider", {"device_id": 1, "cudnn_conv_algo_search": "HEURISTIC"}),
        "CPUExecutionProvider",
    ]
    trt = config(onnxruntime={"execution_providers": ["TensorrtExecutionProvider", "CUDAExecutionProvider"]})
    providers = requested_providers(ort_spec(trt, artifact), Device("GPU", 0))
    assert [p[0] if isinstance(p, tuple) else p for p in providers] == [
        "TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert providers[0][1]["device_id"] == 0 and providers[1] == (
        "CUDAExecutionProvider", {"device_id": 0, "cudnn_conv_algo_search": "HEURISTIC"})


@pytest.fixture
def artifact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A model file, with the TensorRT cache redirected into the test's folder."""
    monkeypatch.setenv("BATCHLINE_TENSORRT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.onnx"
    path.write_bytes(b"graph v1")
    return path


def trt_options(cfg: ModelConfig, artifact: Path, device: Device | None = None) -> dict:
    (name, options), *_ = requested_providers(ort_spec(cfg, artifact), device or Device("GPU", 1))
    assert name == "TensorrtExecutionProvider"
    return options


def test_the_tensorrt_provider_gets_one_spanning_profile_and_a_keyed_cache(artifact: Path) -> None:
    trt = config(batch_buckets=[1, 4], onnxruntime={
        "execution_providers": ["TensorrtExecutionProvider"], "tensorrt": {"fp16": True, "workspace_mb": 512}})
    options = trt_options(trt, artifact)
    assert options["device_id"] == 1 and options["trt_fp16_enable"] and not options["trt_int8_enable"]
    assert options["trt_max_workspace_size"] == 512 << 20
    # ORT runs on profile 0 only: one profile from the smallest bucket to the largest, tuned there
    assert (options["trt_profile_min_shapes"], options["trt_profile_opt_shapes"],
            options["trt_profile_max_shapes"]) == ("x:1x2", "x:4x2", "x:4x2")
    folder = Path(options["trt_engine_cache_path"])
    assert folder.is_dir() and folder.parent == artifact.parent / "cache" / "ort"  # made: ORT makes one level only
    assert options["trt_timing_cache_path"] == str(folder)
    assert trt_options(trt, artifact)["trt_engine_cache_path"] == str(folder)  # stable
    artifact.write_bytes(b"graph v2")  # new weights under the same file name: a fresh folder
    assert trt_options(trt, artifact)["trt_engine_cache_path"] != str(folder)
    fp32 = trt.model_copy(update={"onnxruntime": trt.onnxruntime.model_copy(
        update={"tensorrt": trt.onnxruntime.tensorrt.model_copy(update={"fp16": False})})})
    assert trt_options(fp32, artifact)["trt_engine_cache_path"] != trt_options(trt, artifact)["trt_engine_cache_path"]


def test_the_tensorrt_provider_without_profiles_or_caches(artifact: Path) -> None:
    derived = config(onnxruntime={"execution_providers": ["TensorrtExecutionProvider"],
                                  "tensorrt": {"explicit_profiles": False, "engine_cache": False,
                                               "timing_cache": False}})
    options = trt_options(derived, artifact, Device("GPU", 0))
    assert "trt_profile_min_shapes" not in options and "trt_engine_cache_path" not in options
    assert not (artifact.parent / "cache").exists()
    assert requested_providers(ort_spec(derived, artifact), Device("CPU")) == ["CPUExecutionProvider"]


def test_a_session_that_fell_back_to_the_cpu_is_refused() -> None:
    with pytest.raises(EngineError, match="asked for CUDAExecutionProvider but the session runs on CPUExecutionProvider"):
        check_providers([("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"], ["CPUExecutionProvider"])
    check_providers(["CPUExecutionProvider"], ["CPUExecutionProvider"])


def test_onnxruntime_runs_on_the_cpu(doubling_model: Path) -> None:
    engine = create_engine(config(), doubling_model, Device("CPU"))
    out = engine.run({"x": np.array([[1.0, 2.0]], dtype=np.float32)})
    assert out["y"].tolist() == [[2.0, 4.0]]
    assert engine.describe().providers == ["CPUExecutionProvider"]


def test_a_gpu_instance_runs_on_the_gpu_or_fails_at_load_with_the_reason(doubling_model: Path) -> None:
    """Whichever machine this is: with onnxruntime's CUDA build and a GPU, a GPU instance runs
    there; otherwise it is refused at load (a CPU build names the provider it lacks; a CUDA
    build without a GPU fails or falls back to the CPU, which is refused too), never served on
    the CPU in silence."""
    import onnxruntime

    cuda_build = "CUDAExecutionProvider" in onnxruntime.get_available_providers()
    if cuda_build and visible_gpu_count():
        engine = create_engine(config(), doubling_model, Device("GPU", 0))
        assert engine.describe().providers[0] == "CUDAExecutionProvider"
        assert engine.run({"x": np.array([[1.0, 2.0]], dtype=np.float32)})["y"].tolist() == [[2.0, 4.0]]
        return
    with pytest.raises(EngineError) as refused:
        create_engine(config(), doubling_model, Device("GPU", 0))
    if not cuda_build:
        assert "CUDAExecutionProvider" in str(refused.value)  # it names the provider it lacks


def test_a_bf16_graph_on_the_cpu_says_why_it_cannot_load(tmp_path: Path) -> None:
    """ONNX Runtime's own words ("Could not find an implementation for Add(14)") name neither
    the datatype nor the provider."""
    x = helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["batch", 2])
    y = helper.make_tensor_value_info("y", TensorProto.BFLOAT16, ["batch", 2])
    model = helper.make_model(helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "double", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    (tmp_path / "1").mkdir()
    onnx.save(model, tmp_path / "1" / "model.onnx")
    bf16 = config(inputs=[{"name": "x", "datatype": "BF16", "dims": [2]}],
                  outputs=[{"name": "y", "datatype": "BF16", "dims": [2]}])
    with pytest.raises(EngineError, match=r"Could not find an implementation for Add.*no kernel of "
                       r"CPUExecutionProvider runs that operator.*lacks most BF16.*export the model in FP32"):
        create_engine(bf16, tmp_path / "1", Device("CPU"))


def test_config_and_graph_must_agree_on_tensor_names(doubling_model: Path) -> None:
    wrong = config(inputs=[{"name": "z", "datatype": "FP32", "dims": [2]}])
    with pytest.raises(EngineError, match="input 'z': the model has no input 'z' .*the model takes input 'x'"):
        create_engine(wrong, doubling_model, Device("CPU"))
    missing = config(outputs=[{"name": "y", "datatype": "FP32", "dims": [2], "engine_name": "nope"}])
    with pytest.raises(EngineError, match=r"output 'y' \(engine name 'nope'\): the model has no output 'nope'"):
        create_engine(missing, doubling_model, Device("CPU"))


def test_a_missing_artifact_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="model.onnx is missing"):
        create_engine(config(), tmp_path, Device("CPU"))


DIGITS = MODELS / "digits" / "1"


@pytest.fixture
def digits() -> Path:
    """The built digits model: missing, the test fails (never skips); `make test` builds it."""
    require_built_models(("digits",))
    return DIGITS


def digits_config(**overrides) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "name": "digits",
            "engine": "torch",
            "max_batch_size": 8,
            "inputs": [{"name": "image", "datatype": "FP32", "dims": [1, 8, 8]}],
            "outputs": [{"name": "probabilities", "datatype": "FP32", "dims": [10]}],
            **overrides,
        }
    )


def test_torch_on_a_gpu_runs_there_or_fails_at_load_without_cuda(digits: Path) -> None:
    """Without CUDA a GPU instance is refused at load; with it, it answers as the CPU does."""
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(EngineError, match="no CUDA device"):
            create_engine(digits_config(), digits, Device("GPU", 0))
        return
    images = np.load(digits / "heldout.npz")["images"][:8]
    on_gpu = create_engine(digits_config(), digits, Device("GPU", 0)).run({"image": images})["probabilities"]
    on_cpu = create_engine(digits_config(), digits, Device("CPU")).run({"image": images})["probabilities"]
    np.testing.assert_allclose(on_gpu, on_cpu, atol=1e-4)


def test_torch_refuses_int8_without_a_build() -> None:
    with pytest.raises(EngineError, match="fp32, fp16 or bf16"):
        create_engine(digits_config(precision="int8"), DIGITS, Device("CPU"))


def test_torch_bf16_casts_the_program_and_answers_in_fp32(digits: Path) -> None:
    images = np.load(digits / "heldout.npz")["images"][:8]
    fp32 = create_engine(digits_config(), digits, Device("CPU")).run({"image": images})["probabilities"]
    bf16_engine = create_engine(digits_config(precision="bf16"), digits, Device("CPU"))
    bf16 = bf16_engine.run({"image": images})["probabilities"]
    assert bf16.dtype == np.float32 and bf16_engine.describe().precision == "bf16"
    assert (bf16.argmax(1) == fp32.argmax(1)).mean() >= 0.85
    assert np.abs(bf16 - fp32).max() < 0.1


def test_compile_needs_a_fixed_ladder() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="batch_buckets"):
        digits_config(torch={"compile": True})


def test_compiled_program_answers_as_eager_on_every_bucket(digits: Path) -> None:
    from server.workers.pipeline import ModelPipeline

    cfg = digits_config(torch={"compile": True, "num_threads": 1}, batch_buckets=[1, 4, 8])
    engine = create_engine(cfg, digits, Device("CPU"))
    assert engine.describe().providers[0].endswith("compiled")
    eager = create_engine(digits_config(), digits, Device("CPU"))
    images = np.load(digits / "heldout.npz")["images"]
    pipeline = ModelPipeline(cfg, engine, {})
    for size in (1, 3, 8):  # 3 is padded to the bucket of 4 by the pipeline
        got = pipeline.run_batch([{"image": images[:size]}]).outputs[0]["probabilities"]
        np.testing.assert_allclose(got, eager.run({"image": images[:size]})["probabilities"], atol=1e-5)
