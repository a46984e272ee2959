"""ONNX Runtime on CUDA, on the CPU: the CUDA libraries preloaded for GPU instances only, the
CUDA provider's options, and I/O binding on GPU sessions (a fake session records the calls;
the binding calls themselves are checked against the real ORT on the CPU)."""

from __future__ import annotations

import builtins
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pydantic
import pytest
from onnx import TensorProto, helper

from server.config import ModelConfig
from server.devices import Device
from server.engines import onnxruntime as engine_module
from server.engines.onnxruntime import (
    OnnxRuntimeEngine,
    preload_cuda_libraries,
    requested_providers,
    run_bound,
)
from server.engines.spec import EngineSpec
from server.errors import EngineError
from tests.unit.engines.test_engines import ort_spec

ort = engine_module.ort
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


def config(**overrides) -> ModelConfig:
    """x in; `thrice` and `twice` out, declared in that order."""
    return ModelConfig.model_validate({
        "name": "scale",
        "engine": "onnxruntime",
        "max_batch_size": 4,
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [2]}],
        "outputs": [{"name": "thrice", "datatype": "FP32", "dims": [2]},
                    {"name": "twice", "datatype": "FP32", "dims": [2]}],
        **overrides,
    })


@dataclass
class Node:
    """What the engine reads of an ort.NodeArg."""

    name: str
    type: str = "tensor(float)"
    shape: tuple = ("batch", 2)


def scale(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"thrice": feed["x"] * 3, "twice": feed["x"] * 2}


SCALE_NODES = ([Node("x")], [Node("thrice"), Node("twice")])


class FakeBinding:
    """ORT's IOBinding as the engine uses it, recording each call into the session's log."""

    def __init__(self, session: FakeSession) -> None:
        self._session = session
        self.inputs: dict[str, np.ndarray] = {}
        self.outputs: list[str] = []
        self.results: dict[str, np.ndarray] = {}

    def bind_cpu_input(self, name: str, arr_on_cpu: np.ndarray) -> None:
        self._session.calls.append(("bind_cpu_input", name))
        self.inputs[name] = arr_on_cpu

    def bind_output(self, name: str, device_type: str = "cpu", device_id: int = 0) -> None:
        self._session.calls.append(("bind_output", name, device_type, device_id))
        self.outputs.append(name)

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        self._session.calls.append(("copy_outputs_to_cpu",))
        return [self.results[name] for name in self.outputs]  # in the order they were bound, as ORT does


class FakeSession:
    """An InferenceSession that takes the providers `available` lets it, and computes its
    outputs with `compute`; `calls` logs the session and binding calls in order."""

    def __init__(self, calls: list, providers: list, available: set[str], inputs: list[Node],
                 outputs: list[Node], compute: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]) -> None:
        self.calls = calls
        self.requested = providers
        names = [p[0] if isinstance(p, tuple) else p for p in providers]
        self._taken = [n for n in names if n in available]
        self._inputs, self._outputs, self._compute = inputs, outputs, compute
        calls.append(("session", tuple(names)))

    def get_providers(self) -> list[str]:
        return self._taken

    def get_inputs(self) -> list[Node]:
        return self._inputs

    def get_outputs(self) -> list[Node]:
        return self._outputs

    def run(self, output_names: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.calls.append(("run",))
        results = self._compute(feed)
        return [results[name] for name in output_names]

    def io_binding(self) -> FakeBinding:
        self.calls.append(("io_binding",))
        return FakeBinding(self)

    def run_with_iobinding(self, binding: FakeBinding) -> None:
        self.calls.append(("run_with_iobinding",))
        binding.results = self._compute(binding.inputs)


@pytest.fixture(autouse=True)
def fresh_preload(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every test starts as a fresh process would (nothing preloaded yet), with ORT's
    preload_dlls replaced by a recorder: the list it returns logs its calls."""
    preloads: list = []
    preload_cuda_libraries.cache_clear()
    monkeypatch.setattr(ort, "preload_dlls", lambda *a, **k: preloads.append("preload_dlls"), raising=False)
    yield preloads
    preload_cuda_libraries.cache_clear()


@pytest.fixture
def version_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A version folder whose model.onnx the fake session never reads."""
    monkeypatch.setenv("BATCHLINE_TENSORRT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.onnx").write_bytes(b"a graph the fake never reads")
    return tmp_path / "1"


@pytest.fixture
def fake_sessions(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list]:
    """Install FakeSession as ort.InferenceSession; returns the call log the sessions share."""

    def install(available: set[str], nodes: tuple[list[Node], list[Node]] = SCALE_NODES,
                compute: Callable = scale, calls: list | None = None) -> list:
        log = [] if calls is None else calls
        inputs, outputs = nodes

        def session(path: str, options: object, providers: list) -> FakeSession:
            return FakeSession(log, providers, available, inputs, outputs, compute)

        monkeypatch.setattr(ort, "InferenceSession", session)
        return log

    return install


def batch(rows: int) -> np.ndarray:
    return np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)


# CUDA provider options


def test_the_cuda_provider_searches_cudnn_algorithms_by_heuristic_unless_configured(tmp_path: Path) -> None:
    artifact = tmp_path / "model.onnx"
    assert requested_providers(ort_spec(config(), artifact), Device("GPU", 1)) == [
        (CUDA, {"device_id": 1, "cudnn_conv_algo_search": "HEURISTIC"}), CPU]
    exhaustive = config(onnxruntime={"execution_providers": [CUDA], "cudnn_conv_algo_search": "EXHAUSTIVE"})
    assert requested_providers(ort_spec(exhaustive, artifact), Device("GPU", 0))[0] == (
        CUDA, {"device_id": 0, "cudnn_conv_algo_search": "EXHAUSTIVE"})
    assert requested_providers(ort_spec(exhaustive, artifact), Device("CPU")) == [CPU]


def test_the_tensorrt_provider_gets_no_cudnn_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHLINE_TENSORRT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "model.onnx").write_bytes(b"graph")
    trt = config(onnxruntime={"execution_providers": ["TensorrtExecutionProvider", CUDA],
                              "tensorrt": {"engine_cache": False, "timing_cache": False}})
    providers = requested_providers(ort_spec(trt, tmp_path / "model.onnx"), Device("GPU", 0))
    (_, trt_options), (_, cuda_options), _ = providers
    assert "cudnn_conv_algo_search" not in trt_options
    assert cuda_options["cudnn_conv_algo_search"] == "HEURISTIC"


def test_an_unknown_cudnn_search_mode_is_refused_naming_the_field() -> None:
    with pytest.raises(pydantic.ValidationError, match="cudnn_conv_algo_search"):
        config(onnxruntime={"cudnn_conv_algo_search": "fastest"})


# CUDA libraries preloaded


def test_gpu_instances_preload_the_cuda_libraries_once_before_their_session(
    version_dir: Path, fake_sessions: Callable, fresh_preload: list
) -> None:
    calls = fake_sessions({CUDA, CPU}, calls=fresh_preload)  # one log: the preload, then the session
    OnnxRuntimeEngine(EngineSpec.from_config(config(), version_dir), Device("GPU", 0))
    OnnxRuntimeEngine(EngineSpec.from_config(config(), version_dir), Device("GPU", 1))
    assert calls == ["preload_dlls", ("session", (CUDA, CPU)), ("session", (CUDA, CPU))]


def test_cpu_instances_never_preload(version_dir: Path, fake_sessions: Callable, fresh_preload: list) -> None:
    gpu_listed = config(onnxruntime={"execution_providers": [CUDA, CPU]})
    calls = fake_sessions({CUDA, CPU}, calls=fresh_preload)
    OnnxRuntimeEngine(EngineSpec.from_config(gpu_listed, version_dir), Device("CPU"))
    assert calls == [("session", (CPU,))]


@pytest.fixture
def imports(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], list[str]]:
    """An ORT without preload_dlls (before 1.21), and `import torch` intercepted: recorded,
    answered by a stand-in module, or refused as if torch were not installed."""
    monkeypatch.delattr(ort, "preload_dlls")
    real_import = builtins.__import__

    def install(torch_installed: bool) -> list[str]:
        seen: list[str] = []

        def fake_import(name: str, *args, **kwargs):
            if name == "torch":
                seen.append(name)
                if not torch_installed:
                    raise ImportError("No module named 'torch'")
                return types.ModuleType("torch")
            return real_import(name, *args, **kwargs)

        monkeypatch.setattr(builtins, "__import__", fake_import)
        return seen

    return install


def test_without_preload_dlls_gpu_instances_import_torch_and_cpu_ones_do_not(
    version_dir: Path, fake_sessions: Callable, imports: Callable
) -> None:
    fake_sessions({CUDA, CPU})
    seen = imports(torch_installed=True)
    OnnxRuntimeEngine(EngineSpec.from_config(config(), version_dir), Device("CPU"))
    assert seen == []
    OnnxRuntimeEngine(EngineSpec.from_config(config(), version_dir), Device("GPU", 0))
    OnnxRuntimeEngine(EngineSpec.from_config(config(), version_dir), Device("GPU", 0))
    assert seen == ["torch"]
    assert preload_cuda_libraries() == "torch"


def test_nothing_to_preload_with_is_logged_and_the_session_decides(
    version_dir: Path, fake_sessions: Callable, imports: Callable, caplog: pytest.LogCaptureFixture
) -> None:
    fake_sessions({CPU})  # a CPU build of onnxruntime: CUDA does not take
    imports(torch_installed=False)
    with (caplog.at_level(logging.WARNING, logger="server.engines.onnxruntime"),
          pytest.raises(EngineError, match="asked for CUDAExecutionProvider but the session runs on")):
        OnnxRuntimeEngine(EngineSpec.from_config(config(), version_dir), Device("GPU", 0))
    assert "CUDA libraries not preloaded for ONNX Runtime: No module named 'torch'" in caplog.text
    assert preload_cuda_libraries() == "none"


def test_what_preload_dlls_failed_to_load_reaches_the_log(
    monkeypatch: pytest.MonkeyPatch, fresh_preload: list, caplog: pytest.LogCaptureFixture
) -> None:
    """ORT's preload_dlls prints the libraries it could not load and returns: the log gets it."""
    monkeypatch.setattr(ort, "preload_dlls", lambda *a, **k: print("Failed to load libcublasLt.so.13"), raising=False)
    with caplog.at_level(logging.WARNING, logger="server.engines.onnxruntime"):
        assert preload_cuda_libraries() == "preload_dlls"
    assert "preload of the CUDA libraries said: Failed to load libcublasLt.so.13" in caplog.text


# I/O binding


def test_gpu_sessions_bind_inputs_from_the_host_and_outputs_on_their_device(
    version_dir: Path, fake_sessions: Callable
) -> None:
    calls = fake_sessions({CUDA, CPU})
    engine = OnnxRuntimeEngine(EngineSpec.from_config(config(), version_dir), Device("GPU", 1))
    calls.clear()
    for rows in (1, 4):  # every bucket a warm-up runs: a fresh binding for each shape
        x = batch(rows)
        out = engine.run({"x": x})
        assert list(out) == ["thrice", "twice"]
        np.testing.assert_array_equal(out["thrice"], x * 3)
        np.testing.assert_array_equal(out["twice"], x * 2)
    one_batch = [("io_binding",), ("bind_cpu_input", "x"), ("bind_output", "thrice", "cuda", 1),
                 ("bind_output", "twice", "cuda", 1), ("run_with_iobinding",), ("copy_outputs_to_cpu",)]
    assert calls == one_batch * 2


def test_outputs_come_back_by_name_whatever_order_the_graph_declares(
    version_dir: Path, fake_sessions: Callable
) -> None:
    reversed_nodes = ([Node("x")], [Node("twice"), Node("thrice")])
    fake_sessions({CUDA, CPU}, nodes=reversed_nodes)
    engine = OnnxRuntimeEngine(EngineSpec.from_config(config(), version_dir), Device("GPU", 0))
    out = engine.run({"x": batch(2)})
    np.testing.assert_array_equal(out["twice"], batch(2) * 2)
    np.testing.assert_array_equal(out["thrice"], batch(2) * 3)


def test_cpu_sessions_keep_the_plain_run(version_dir: Path, fake_sessions: Callable) -> None:
    calls = fake_sessions({CUDA, CPU})  # onnxruntime-gpu on a CPU instance
    engine = OnnxRuntimeEngine(EngineSpec.from_config(config(), version_dir), Device("CPU"))
    out = engine.run({"x": batch(3)})
    np.testing.assert_array_equal(out["thrice"], batch(3) * 3)
    assert calls == [("session", (CPU,)), ("run",)]


def echo(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"out": feed["text"]}


@pytest.mark.parametrize(("input_type", "output_type"), [
    ("tensor(string)", "tensor(string)"),  # string in and out
    ("tensor(float)", "tensor(string)"),  # a string output only
    ("tensor(string)", "tensor(float)"),  # a string input only
    ("tensor(float)", "seq(map(int64,tensor(float)))"),  # not a tensor (a classifier's ZipMap)
])
def test_graphs_with_tensors_that_cannot_live_on_the_device_keep_the_plain_run(
    version_dir: Path, fake_sessions: Callable, input_type: str, output_type: str
) -> None:
    calls = fake_sessions({CUDA, CPU}, nodes=([Node("text", input_type)], [Node("out", output_type)]), compute=echo)
    engine = OnnxRuntimeEngine(EngineSpec.from_config(config(), version_dir), Device("GPU", 0))
    sent = np.array([[b"a"], [b"bc"]], dtype=object) if input_type == "tensor(string)" else batch(2)
    out = engine.run({"text": sent})["out"]
    assert calls[-1] == ("run",) and ("io_binding",) not in calls
    if input_type == output_type == "tensor(string)":  # the plain path's conversions still apply
        assert out.ravel().tolist() == [b"a", b"bc"]


def test_a_failed_bound_run_is_an_engine_error(version_dir: Path, fake_sessions: Callable) -> None:
    def fail(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise RuntimeError("CUDA failure 700: an illegal memory access")

    fake_sessions({CUDA, CPU}, compute=fail)
    engine = OnnxRuntimeEngine(EngineSpec.from_config(config(), version_dir), Device("GPU", 0))
    with pytest.raises(EngineError, match="ONNX Runtime failed: CUDA failure 700"):
        engine.run({"x": batch(1)})


def test_the_binding_calls_are_the_real_onnxruntime_api(tmp_path: Path) -> None:
    """run_bound against a real CPU session, bound on the CPU: the calls the fake records
    exist in ORT, and the outputs match the plain run's, in the order asked for."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 2]) for n in ("twice", "thrice")]
    three = helper.make_tensor("three", TensorProto.FLOAT, [], [3.0])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["twice"]),
                               helper.make_node("Mul", ["x", "three"], ["thrice"])], "scale", [x], outs, [three])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, tmp_path / "model.onnx")
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=[CPU])
    strided = np.arange(16, dtype=np.float32).reshape(4, 4)[:, ::2]  # [4, 2], not contiguous
    assert not strided.flags.c_contiguous
    for sent in (batch(3), strided):
        thrice, twice = run_bound(session, {"x": sent}, ["thrice", "twice"], ("cpu", 0))
        expected_twice, expected_thrice = session.run(["twice", "thrice"], {"x": np.ascontiguousarray(sent)})
        np.testing.assert_array_equal(thrice, expected_thrice)
        np.testing.assert_array_equal(twice, expected_twice)
        np.testing.assert_array_equal(twice, sent * 2)
