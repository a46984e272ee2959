"""TensorRT's pure logic, checked without TensorRT: profiles, cache key, INT8 rule, lazy import."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import ClassVar

import pytest

from server.config import ModelConfig
from server.engines.profiles import optimization_profiles
from server.engines.spec import EngineIO
from server.errors import EngineError
from server.quantize import tensorrt
from server.quantize.errors import BuildError

IMAGE = {
    "name": "digits", "engine": "onnxruntime", "max_batch_size": 64, "batch_buckets": [1, 8, 64],
    "inputs": [{"name": "image", "datatype": "FP32", "dims": [1, 8, 8]}],
    "outputs": [{"name": "probabilities", "datatype": "FP32", "dims": [10]}],
}
TEXT = {
    "name": "minilm", "engine": "onnxruntime", "max_batch_size": 32,
    "inputs": [{"name": "text", "datatype": "BYTES", "dims": [1]}],
    "outputs": [{"name": "embedding", "datatype": "FP32", "dims": [384]}],
    "preprocess": {"tokenize": {"input": "text", "max_length": 256, "sequence_buckets": [16, 64, 256]}},
}


def io_of(config: dict) -> EngineIO:
    return EngineIO.from_config(ModelConfig.model_validate(config))


def test_one_profile_per_batch_bucket() -> None:
    profiles = optimization_profiles(io_of(IMAGE))
    assert [p.batch for p in profiles] == [1, 8, 64]
    assert profiles[1].shapes["image"] == ((2, 1, 8, 8), (8, 1, 8, 8), (8, 1, 8, 8))
    assert profiles[2].shapes["image"][0][0] == 9


def test_text_profiles_cover_the_sequence_window() -> None:
    profiles = optimization_profiles(io_of(TEXT))
    assert [p.batch for p in profiles] == [1, 2, 4, 8, 16, 32]  # the batch ladder without buckets
    assert set(profiles[0].shapes) == {"input_ids", "attention_mask", "token_type_ids"}
    assert profiles[-1].shapes["input_ids"] == ((17, 1), (32, 64), (32, 256))


def test_unbounded_variable_dim_is_refused() -> None:
    config = dict(IMAGE, inputs=[{"name": "image", "datatype": "FP32", "dims": [1, -1, 8]}])
    with pytest.raises(EngineError, match="no known bound"):
        optimization_profiles(io_of(config))


def test_engine_cache_key_depends_on_gpu_and_version() -> None:
    profiles = optimization_profiles(io_of(IMAGE))
    base = {"gpu_name": "NVIDIA H100", "compute_capability": (9, 0), "tensorrt_version": "10.3.0",
                "source_digest": "abc", "precision": "fp16", "profiles": profiles}
    key = tensorrt.engine_cache_key(**base)
    assert key == tensorrt.engine_cache_key(**base)
    for change in ({"gpu_name": "NVIDIA L4"}, {"compute_capability": (8, 9)}, {"tensorrt_version": "10.4.0"},
                   {"precision": "int8"}, {"source_digest": "abd"}, {"profiles": profiles[:1]}):
        assert tensorrt.engine_cache_key(**{**base, **change}) != key


def test_int8_needs_explicit_qdq() -> None:
    tensorrt.check_int8_graph({"Conv", "QuantizeLinear", "DequantizeLinear"})
    with pytest.raises(BuildError, match="explicitly quantized"):
        tensorrt.check_int8_graph({"Conv", "MatMul"})
    assert tensorrt.precision_flags("int8") == ["INT8", "FP16"]


def test_build_engine_says_tensorrt_is_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import fails as if not installed
    with pytest.raises(BuildError, match="TensorRT is not installed on this machine"):
        tensorrt.build_engine(tmp_path / "m.onnx", tmp_path / "m.plan", ModelConfig.model_validate(IMAGE), "fp16")


def fake_tensorrt(calls: list[tuple]) -> tuple[type, type]:
    """A fake `tensorrt` and `torch` that record the builder's calls; the plan built is b"PLAN"."""
    class Fake:
        __version__ = "10.0-fake"

        class Logger:
            WARNING = 1

            def __init__(self, level): ...

        class MemoryPoolType:
            WORKSPACE = "ws"

        class BuilderFlag:
            FP16 = "FP16"
            INT8 = "INT8"
            BF16 = "BF16"

        class OnnxParser:
            num_errors = 0

            def __init__(self, network, logger): ...

            def parse_from_file(self, path):
                return True

        class Builder:
            def __init__(self, logger): ...

            def create_network(self, flags):
                return object()

            def create_builder_config(self):
                class Config:
                    def set_memory_pool_limit(self, pool, size):
                        calls.append(("pool", size))

                    def set_flag(self, flag):
                        calls.append(("flag", flag))

                    def add_optimization_profile(self, profile):
                        calls.append(("profile", dict(profile.shapes)))

                    def create_timing_cache(self, data):
                        calls.append(("timing cache read", bytes(data)))
                        return "timing"

                    def set_timing_cache(self, cache, ignore_mismatch):
                        calls.append(("timing cache set", cache, ignore_mismatch))
                        return True

                    def get_timing_cache(self):
                        class Timing:
                            def serialize(self):
                                return b"TIMINGS"
                        return Timing()
                return Config()

            def create_optimization_profile(self):
                class Profile:
                    shapes: ClassVar[dict] = {}

                    def __init__(self):
                        self.shapes = {}

                    def set_shape(self, name, low, opt, high):
                        self.shapes[name] = (low, opt, high)
                return Profile()

            def build_serialized_network(self, network, config):
                calls.append(("build",))
                return b"PLAN"

    class FakeTorch:
        class cuda:
            @staticmethod
            def get_device_properties(index):
                class P:
                    name, major, minor = "Fake GPU", 9, 0
                return P()

    return Fake, FakeTorch


def test_build_engine_with_a_fake_tensorrt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The builder calls TensorRT's API in order: profiles per bucket, precision flags, a plan."""
    calls: list[tuple] = []
    Fake, FakeTorch = fake_tensorrt(calls)
    monkeypatch.setitem(sys.modules, "tensorrt", Fake)
    monkeypatch.setitem(sys.modules, "torch", FakeTorch)
    onnx_path = tmp_path / "m.onnx"
    onnx_path.write_bytes(b"graph")
    cache = tmp_path / "cache"
    config = ModelConfig.model_validate(IMAGE)
    result = tensorrt.build_engine(onnx_path, tmp_path / "m.plan", config, "fp16", workspace_mb=16, cache=cache)
    assert (tmp_path / "m.plan").read_bytes() == b"PLAN" and not result["engine_cache_hit"]
    assert ("flag", "FP16") in calls and ("pool", 16 << 20) in calls
    assert [c for c in calls if c[0] == "profile"][1][1]["image"] == ((2, 1, 8, 8), (8, 1, 8, 8), (8, 1, 8, 8))
    assert len(result["cache_key"]) == 64 and len(result["profiles"]) == 3
    assert ("timing cache read", b"") in calls and ("timing cache set", "timing", False) in calls
    timing = cache / tensorrt.timing_cache_name("Fake GPU", (9, 0), "10.0-fake")
    assert timing.read_bytes() == b"TIMINGS" and timing.name == "timing-fake-gpu-sm90-trt10.0-fake.cache"
    assert (cache / "engines" / f"{result['cache_key']}.plan").read_bytes() == b"PLAN"

    calls.clear()  # the same graph, precision and profiles on the same GPU: the engine cache has it
    again = tensorrt.build_engine(onnx_path, tmp_path / "again.plan", config, "fp16", cache=cache)
    assert again["engine_cache_hit"] and again["cache_key"] == result["cache_key"]
    assert (tmp_path / "again.plan").read_bytes() == b"PLAN" and ("build",) not in calls

    calls.clear()  # another precision: built, reading the timings the first build left
    other = tensorrt.build_engine(onnx_path, tmp_path / "int8.plan", config, "int8", cache=cache)
    assert not other["engine_cache_hit"] and ("timing cache read", b"TIMINGS") in calls


def test_a_cached_plan_is_reused_only_when_it_matches_its_digest(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    """A plan is code TensorRT deserializes: a damaged or swapped cache entry, or one without its
    digest, is built again, never copied into a version."""
    import subprocess

    calls: list[tuple] = []
    Fake, FakeTorch = fake_tensorrt(calls)
    monkeypatch.setitem(sys.modules, "tensorrt", Fake)
    monkeypatch.setitem(sys.modules, "torch", FakeTorch)
    onnx_path, cache = tmp_path / "m.onnx", tmp_path / "cache"
    onnx_path.write_bytes(b"graph")
    config = ModelConfig.model_validate(IMAGE)
    key = tensorrt.build_engine(onnx_path, tmp_path / "first.plan", config, "fp16", cache=cache)["cache_key"]
    cached = cache / "engines" / f"{key}.plan"
    digest = tensorrt.plan_digest_path(cached)
    subprocess.run(["sha256sum", "-c", digest.name], cwd=digest.parent, check=True, capture_output=True)

    for damage in (lambda: cached.write_bytes(b"PLAN, swapped"), lambda: digest.unlink()):
        damage()
        calls.clear()
        result = tensorrt.build_engine(onnx_path, tmp_path / "again.plan", config, "fp16", cache=cache)
        assert not result["engine_cache_hit"] and ("build",) in calls  # built again, not reused
        assert (tmp_path / "again.plan").read_bytes() == b"PLAN"
        assert cached.read_bytes() == b"PLAN" and digest.is_file()  # and the cache entry repaired

    calls.clear()
    assert tensorrt.build_engine(onnx_path, tmp_path / "third.plan", config, "fp16", cache=cache)["engine_cache_hit"]
    assert ("build",) not in calls


def test_the_tensorrt_cache_root_is_configurable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BATCHLINE_TENSORRT_CACHE", str(tmp_path))
    assert tensorrt.cache_root() == tmp_path
    monkeypatch.delenv("BATCHLINE_TENSORRT_CACHE")
    assert tensorrt.cache_root() == Path.home() / ".cache" / "batchline" / "tensorrt"


def test_ort_gets_one_profile_spanning_the_buckets() -> None:
    from server.engines.profiles import provider_shapes

    shapes = provider_shapes(io_of(TEXT))
    assert shapes["trt_profile_min_shapes"] == "input_ids:1x1,attention_mask:1x1,token_type_ids:1x1"
    assert shapes["trt_profile_opt_shapes"] == "input_ids:32x64,attention_mask:32x64,token_type_ids:32x64"
    assert shapes["trt_profile_max_shapes"] == "input_ids:32x256,attention_mask:32x256,token_type_ids:32x256"


def _context(repository: Path, tmp_path: Path, precision: str, **options: object):  # type: ignore[no-untyped-def]
    from server.config import load_model_config
    from server.quantize.builders import BuildContext
    from server.quantize.data import load_eval_data
    from server.quantize.progress import untracked

    source = repository / "digits"
    defaults = tensorrt.defaults(load_model_config(source / "config.yaml"), None)  # type: ignore[arg-type]
    (tmp_path / "stage").mkdir(parents=True)
    return BuildContext(
        source_config=load_model_config(source / "config.yaml"), source_version_dir=source / "1",
        source_artifact=source / "1" / "model.pt2", engine="tensorrt", precision=precision, device="gpu",
        stage=tmp_path / "stage", work=tmp_path, options={**defaults, **options},
        data=load_eval_data(source, source / "1", load_model_config(source / "config.yaml")), progress=lambda _: None, track=untracked,
    )


def test_int8_plans_start_from_a_calibrated_symmetric_qdq_graph(repository: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The builder quantizes the FP32 source itself, then hands the Q/DQ graph to TensorRT."""
    import onnx
    from onnx import numpy_helper

    handed: dict = {}

    def fake_build_engine(graph: Path, plan: Path, config: ModelConfig, precision: str, **_: object) -> dict:
        model = onnx.load(str(graph))
        handed["ops"] = {n.op_type for n in model.graph.node}
        points = {n.input[2] for n in model.graph.node if n.op_type == "QuantizeLinear" and len(n.input) > 2}
        handed["zero_points"] = [numpy_helper.to_array(t) for t in model.graph.initializer if t.name in points]
        handed["precision"] = precision
        plan.write_bytes(b"PLAN")
        return {"cache_key": "k" * 64, "profiles": [{}], "gpu": "Fake", "compute_capability": [9, 0],
                "tensorrt": "10", "engine_cache_hit": False}

    monkeypatch.setattr(tensorrt, "build_engine", fake_build_engine)
    output = tensorrt.build(_context(repository, tmp_path, "int8"))
    assert {"QuantizeLinear", "DequantizeLinear", "Conv"} <= handed["ops"] and handed["precision"] == "int8"
    assert handed["zero_points"] and all((z == 0).all() for z in handed["zero_points"])  # TensorRT's rule
    assert output.engine == "tensorrt" and "Q/DQ" in output.method
    with pytest.raises(BuildError, match="INT8 builds only"):
        tensorrt.build(_context(repository, tmp_path / "fp16", "fp16", calibrate_method="entropy"))


def test_int8_plans_of_a_text_model_are_refused_before_any_work() -> None:
    from types import SimpleNamespace

    from server.quantize.data import EmbeddingData
    from server.quantize.onnx_builds import static_qdq_graph

    context = SimpleNamespace(data=EmbeddingData(sentences=["a"], triplets=[], fingerprint="f"))
    with pytest.raises(BuildError, match="calibrates on numeric inputs"):
        static_qdq_graph(context, [])  # type: ignore[arg-type]
