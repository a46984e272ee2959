"""The torch engine on CUDA, tested on the CPU: torch's CUDA entry points are replaced by fakes
that record each call in order (streams, pinned buffers, copies, waits) and run the work on the
CPU, so the results must equal the CPU engine's bit for bit. What a fake cannot show (that the
copies really overlap on a GPU) is left to a machine with one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError

import server.devices
import server.engines.torch as torch_engine
import server.model
from server.config import ModelConfig
from server.devices import Device
from server.engines import create_engine
from server.engines.torch import COMPILE_LOCK, compile_options, load_program, program_module
from server.model import ModelVersion
from server.workers.pipeline import ModelPipeline
from tests.integration.conftest import require_built_models
from tests.unit.engines.test_engines import DIGITS, digits_config

Event = tuple[Any, ...]


@pytest.fixture
def digits() -> Path:
    """The built digits model: missing, the test fails (never skips); `make test` builds it."""
    require_built_models(("digits",))
    return DIGITS


class _FakeStream:
    """torch.cuda.Stream: records its creation and every wait on it."""

    def __init__(self, events: list[Event], device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self._events = events
        events.append(("stream", str(self.device)))

    def synchronize(self) -> None:
        self._events.append(("wait", self))


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> list[Event]:
    """Fake CUDA: the calls the engine makes are recorded, in order, and run on the CPU."""
    events: list[Event] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("synchronize", str(device))))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream(events, device))

    @contextlib.contextmanager
    def stream(s: _FakeStream) -> Iterator[None]:
        events.append(("enter", s))
        yield
        events.append(("exit", s))

    monkeypatch.setattr(torch.cuda, "stream", stream)

    def move(program: torch.export.ExportedProgram, device: torch.device) -> torch.export.ExportedProgram:
        events.append(("move", str(device)))
        module = program.module
        monkeypatch.setattr(program, "module", lambda: events.append(("module",)) or module())
        return program  # stays on the CPU, where the fake device's work runs

    monkeypatch.setattr(torch_engine, "move_to_device_pass", move)

    empty = torch.empty

    def pinned_empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        if pin_memory:
            events.append(("pinned", tuple(args[0])))
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", pinned_empty)
    to, copy_, numpy = torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.numpy

    def fake_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        target = args[0] if args else kwargs.get("device", kwargs.get("dtype"))
        if isinstance(target, (torch.device, str)) and str(target).startswith("cuda"):
            events.append(("to", str(target), kwargs.get("non_blocking", False)))
            return to(self, "cpu")
        if isinstance(target, torch.dtype) and target != self.dtype:
            events.append(("cast", target))
        return to(self, *args, **kwargs)

    def fake_copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        events.append(("copy", non_blocking))
        return copy_(self, src, non_blocking)

    def fake_numpy(self: torch.Tensor, *args: Any, **kwargs: Any) -> np.ndarray:
        events.append(("numpy",))
        return numpy(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    monkeypatch.setattr(torch.Tensor, "copy_", fake_copy)
    monkeypatch.setattr(torch.Tensor, "numpy", fake_numpy)
    return events


class _Forward(torch.nn.Module):
    """Records each call of the program among the CUDA events, whether the compile lock was held."""

    def __init__(self, inner: Any, events: list[Event]) -> None:
        super().__init__()
        self.inner = inner
        self.events = events

    def forward(self, *args: torch.Tensor) -> Any:
        self.events.append(("forward", COMPILE_LOCK.locked()))
        return self.inner(*args)


class TwoOutputs(torch.nn.Module):
    """y = 2x + c (c a constant lifted into the graph), z = the sum of each row of x."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        constant = torch.tensor([1.0, 2.0, 3.0, 4.0])
        return x * 2 + constant, x.sum(1, keepdim=True)


@pytest.fixture
def two_outputs(tmp_path: Path) -> Path:
    """An exported program with two outputs and a lifted constant, in version folder 1."""
    x = torch.randn(3, 4)
    program = torch.export.export(TwoOutputs(), (x,), dynamic_shapes={"x": {0: torch.export.Dim("batch")}})
    (tmp_path / "1").mkdir()
    torch.export.save(program, tmp_path / "1" / "model.pt2")
    return tmp_path / "1"


def two_config(**overrides: Any) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "name": "two",
            "engine": "torch",
            "max_batch_size": 8,
            "inputs": [{"name": "x", "datatype": "FP32", "dims": [4]}],
            "outputs": [{"name": "y", "datatype": "FP32", "dims": [4]}, {"name": "z", "datatype": "FP32", "dims": [1]}],
            **overrides,
        }
    )


def kinds(events: list[Event]) -> list[str]:
    return [e[0] for e in events]


def images(count: int) -> np.ndarray:
    array = np.load(DIGITS / "heldout.npz")["images"]
    array = np.ascontiguousarray(array[:count])
    array.flags.writeable = False  # as request buffers arrive
    return array


# a. the program reaches the device through torch.export's device pass


def test_a_gpu_instance_moves_the_program_with_the_device_pass_then_takes_its_module(
    digits: Path, cuda: list[Event]
) -> None:
    create_engine(digits_config(), digits, Device("GPU", 1))
    # the weights are in place before the instance's own stream (which waits for no other) reads them
    assert [e for e in cuda if e[0] in ("move", "module", "synchronize", "stream")] == [
        ("move", "cuda:1"), ("module",), ("synchronize", "cuda:1"), ("stream", "cuda:1")]


def test_a_cpu_instance_takes_the_module_as_it_is(digits: Path, cuda: list[Event]) -> None:
    """On the CPU: no pass, no stream, no pinned memory, no copies, no waits; the answers are the
    program's own."""
    engine = create_engine(digits_config(), digits, Device("CPU"))
    got = engine.run({"image": images(8)})["probabilities"]
    assert [k for k in kinds(cuda) if k != "numpy"] == []
    with torch.inference_mode():
        expected = load_program(digits / "model.pt2").module()(torch.from_numpy(images(8).copy()))
    np.testing.assert_array_equal(got, expected.numpy())


def test_the_device_pass_moves_what_module_to_leaves_behind(two_outputs: Path) -> None:
    """Run for real on the meta device: `module().to()` leaves the lifted constant on the CPU
    (on a GPU, the first batch would fail on a device mismatch); the pass moves it."""
    left = load_program(two_outputs / "model.pt2").module().to("meta")
    assert {str(t.device) for t in vars(left).values() if isinstance(t, torch.Tensor)} == {"cpu"}
    moved = program_module(load_program(two_outputs / "model.pt2"), torch.device("meta"))
    constants = [t for t in vars(moved).values() if isinstance(t, torch.Tensor)]
    assert constants and {str(t.device) for t in constants} == {"meta"}


# b, c. one stream per instance; a batch enqueued on it, staged in pinned memory, waited for once


def test_a_batch_is_staged_pinned_copied_without_blocking_and_waited_for_once(
    two_outputs: Path, cuda: list[Event]
) -> None:
    engine = create_engine(two_config(), two_outputs, Device("GPU", 0))
    engine._module = _Forward(engine._module, cuda)
    stream = engine._stream
    cuda.clear()
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    x.flags.writeable = False
    outputs = engine.run({"x": x})
    assert cuda == [
        ("pinned", (3, 4)), ("numpy",),  # staged on the host before anything is enqueued
        ("enter", stream),
        ("to", "cuda:0", True),
        ("forward", False),
        ("pinned", (3, 4)), ("copy", True),  # each output copied back without blocking ...
        ("pinned", (3, 1)), ("copy", True),
        ("exit", stream),
        ("wait", stream),  # ... and one wait for the whole batch
        ("numpy",), ("numpy",),  # outputs read only after it
    ]
    np.testing.assert_array_equal(outputs["y"], x * 2 + np.array([1, 2, 3, 4], dtype=np.float32))
    np.testing.assert_array_equal(outputs["z"], x.sum(1, keepdims=True))


def test_every_instance_has_a_stream_of_its_own_on_its_gpu(digits: Path, cuda: list[Event]) -> None:
    engines = [create_engine(digits_config(), digits, Device("GPU", i)) for i in (0, 0, 1)]
    streams = [e._stream for e in engines]
    assert len({id(s) for s in streams}) == 3
    assert [str(s.device) for s in streams] == ["cuda:0", "cuda:0", "cuda:1"]
    for engine in engines:
        cuda.clear()
        engine.run({"image": images(2)})
        assert [e[1] for e in cuda if e[0] in ("enter", "wait")] == [engine._stream] * 2


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_the_gpu_path_answers_as_the_cpu_does(digits: Path, cuda: list[Event], precision: str) -> None:
    """d. Same numbers: on the device, floating inputs are cast after the copy, and half-precision
    outputs widened to FP32 before theirs."""
    on_cpu = create_engine(digits_config(precision=precision), digits, Device("CPU"))
    on_gpu = create_engine(digits_config(precision=precision), digits, Device("GPU", 0))
    cuda.clear()
    got = [on_gpu.run({"image": images(size)})["probabilities"] for size in (1, 5, 8)]
    cast = [] if precision == "fp32" else [("cast", torch.float16 if precision == "fp16" else torch.bfloat16)]
    assert [e[:2] for e in cuda if e[0] in ("to", "cast")] == [("to", "cuda:0"), *cast] * 3
    for size, answer in zip((1, 5, 8), got):
        assert answer.dtype == np.float32
        np.testing.assert_array_equal(answer, on_cpu.run({"image": images(size)})["probabilities"])


def test_half_precision_casts_the_programs_constants_too(two_outputs: Path) -> None:
    """A constant left in FP32 would promote the BF16 activations it meets back to FP32 (and on a
    GPU fail a matmul of mixed types)."""
    engine = create_engine(two_config(precision="bf16"), two_outputs, Device("CPU"))
    tensors = [t for t in vars(engine._module).values() if isinstance(t, torch.Tensor)]
    assert tensors and all(t.dtype == torch.bfloat16 for t in tensors)
    x = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)
    expected = (torch.from_numpy(x).bfloat16() * 2 + torch.tensor([1.0, 2.0, 3.0, 4.0]).bfloat16()).float()
    np.testing.assert_array_equal(engine.run({"x": x})["y"], expected.numpy())


def test_a_failure_on_the_device_is_an_engine_error_that_keeps_its_cause(
    two_outputs: Path, cuda: list[Event]
) -> None:
    """Out of memory keeps its type down the chain: the instance halves the batch on it."""
    from server.errors import EngineError
    from server.workers.faults import is_out_of_memory

    engine = create_engine(two_config(), two_outputs, Device("GPU", 0))

    def out_of_memory(*_: torch.Tensor) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    engine._module = out_of_memory
    with pytest.raises(EngineError, match="torch failed") as caught:
        engine.run({"x": np.zeros((2, 4), dtype=np.float32)})
    assert is_out_of_memory(caught.value)


# e. torch.compile per bucket: modes, one compile at a time, each one timed and logged


@pytest.mark.parametrize(
    ("mode", "options"),
    [
        ("default", {}),
        ("reduce-overhead", {"triton.cudagraphs": True, "triton.cudagraph_trees": False}),
        ("max-autotune", {
            "max_autotune": True, "coordinate_descent_tuning": True,
            "triton.cudagraphs": True, "triton.cudagraph_trees": False,
        }),
        ("max-autotune-no-cudagraphs", {"max_autotune": True, "coordinate_descent_tuning": True}),
    ],
)
def test_compile_modes_record_cuda_graphs_without_trees(mode: str, options: dict[str, bool]) -> None:
    """torch's options for the mode (as torch 2.13 gives them), and CUDA graphs, where it records
    them, without trees."""
    assert compile_options(mode) == options


def test_compile_mode_needs_compile() -> None:
    with pytest.raises(ValidationError, match="compile_mode 'reduce-overhead' needs compile: true"):
        digits_config(torch={"compile_mode": "reduce-overhead"})
    config = digits_config(torch={"compile": True, "compile_mode": "reduce-overhead"}, batch_buckets=[8])
    assert config.torch.compile_mode == "reduce-overhead"


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """torch.compile replaced by a record of its arguments; the module runs eagerly."""
    calls: list[dict[str, Any]] = []

    def compile(module: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        calls.append(kwargs)
        return module

    monkeypatch.setattr(torch, "compile", compile)
    return calls


def test_reduce_overhead_reaches_torch_compile(digits: Path, compiled: list[dict[str, Any]]) -> None:
    config = digits_config(torch={"compile": True, "compile_mode": "reduce-overhead"}, batch_buckets=[4, 8])
    engine = create_engine(config, digits, Device("CPU"))
    assert compiled == [{"dynamic": False, "options": {"triton.cudagraphs": True, "triton.cudagraph_trees": False}}]
    assert engine.describe().providers[0].endswith("compiled reduce-overhead")
    create_engine(digits_config(torch={"compile": True}, batch_buckets=[8]), digits, Device("CPU"))
    assert compiled[1] == {"dynamic": False, "options": None}  # default: torch.compile as before


def test_each_bucket_compiles_once_under_the_lock_and_is_logged(
    digits: Path, compiled: list[dict[str, Any]], cuda: list[Event], caplog: pytest.LogCaptureFixture
) -> None:
    config = digits_config(torch={"compile": True}, batch_buckets=[4, 8])
    engine = create_engine(config, digits, Device("GPU", 0))
    engine._module = _Forward(engine._module, cuda)
    pipeline = ModelPipeline(config, engine, {})
    cuda.clear()
    with caplog.at_level(logging.INFO, logger="server.engines.torch"):
        for size in (3, 4, 2, 8, 5):  # buckets 4, 4, 4, 8, 8
            pipeline.run_batch([{"image": images(size)}])
    assert [e[1] for e in cuda if e[0] == "forward"] == [True, False, False, True, False]
    # a first run waits for its compile to finish on the device before the lock goes
    first = kinds(cuda)[: kinds(cuda).index("exit")]
    assert first[first.index("forward") + 1] == "wait"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiled")]
    assert [line.rsplit(" in ", 1)[0] for line in lines] == ["compiled digits batch 4", "compiled digits batch 8"]
    assert all(line.endswith(" s") for line in lines)


class _Traced(torch.nn.Module):
    """Records the thread of each call of the program, and whether the compile lock was held."""

    def __init__(self, inner: Any, calls: list[tuple[str, bool]]) -> None:
        super().__init__()
        self.inner = inner
        self.calls = calls

    def forward(self, *args: torch.Tensor) -> Any:
        self.calls.append((threading.current_thread().name, COMPILE_LOCK.locked()))
        return self.inner(*args)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_warm_up_compiles_on_the_instances_thread_so_its_batches_never_do(
    digits: Path, compiled: list[dict[str, Any]], cuda: list[Event], caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch, mode: str,
) -> None:
    """torch keeps recorded CUDA graphs per thread: warm-up runs on the thread that serves the
    instance's batches, so each bucket is compiled (its graph recorded) once, at load, and no
    batch waits for the compile lock. On any other thread, the first batch would record again."""
    monkeypatch.setattr(server.devices, "visible_gpu_count", lambda: 1)
    calls: list[tuple[str, bool]] = []
    create = server.model.create_engine

    def traced(*args: Any) -> Any:
        engine = create(*args)
        engine._module = _Traced(engine._module, calls)
        return engine

    monkeypatch.setattr(server.model, "create_engine", traced)
    config = digits_config(
        torch={"compile": True, "compile_mode": mode}, batch_buckets=[8], instance_group=[{"kind": "GPU", "count": 1}]
    )
    version = ModelVersion(config, 1, digits)
    try:
        with caplog.at_level(logging.INFO, logger="server.engines.torch"):
            version._build()
            (instance,) = version.instances
            assert instance.pipeline.engine.compiles_per_shape
            warm_up = len(calls)
            for size in (3, 8, 1):
                asyncio.run(instance.run([{"image": images(size)}]))
    finally:
        version._close_instances()
    assert warm_up == 2  # batch sizes 1 and 8, both in the bucket of 8
    assert calls == [("digits-1-0", True)] + [("digits-1-0", False)] * 4
    lines = [r.getMessage().rsplit(" in ", 1)[0] for r in caplog.records if r.name == "server.engines.torch"]
    assert lines == ["compiled digits batch 8"]


def test_only_a_compiled_program_has_warm_up_run_every_shape(digits: Path, compiled: list[dict[str, Any]]) -> None:
    assert not create_engine(digits_config(), digits, Device("CPU")).compiles_per_shape
    config = digits_config(torch={"compile": True}, batch_buckets=[8])
    assert create_engine(config, digits, Device("CPU")).compiles_per_shape


class Tokens(torch.nn.Module):
    """A text model's program: token tensors in, three numbers per text out."""

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        return torch.stack([(ids * mask).sum(1), mask.sum(1), types.sum(1)], 1).float()


def test_a_text_models_compile_is_logged_with_its_sequence_bucket(
    tmp_path: Path, compiled: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    tokens = [torch.ones(2, 5, dtype=torch.int64)] * 3
    dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence")}
    program = torch.export.export(Tokens(), tuple(tokens), dynamic_shapes=({**dims}, {**dims}, {**dims}))
    (tmp_path / "1").mkdir()
    torch.export.save(program, tmp_path / "1" / "model.pt2")
    config = ModelConfig.model_validate({
        "name": "text", "engine": "torch", "max_batch_size": 4, "batch_buckets": [4],
        "inputs": [{"name": "text", "datatype": "BYTES", "dims": [1]}],
        "outputs": [{"name": "numbers", "datatype": "FP32", "dims": [3]}],
        "preprocess": {"tokenize": {"input": "text", "max_length": 8, "sequence_buckets": [8]}},
        "torch": {"compile": True},
    })
    engine = create_engine(config, tmp_path / "1", Device("CPU"))
    feed = {n: np.ones((4, 8), dtype=np.int64) for n in ("input_ids", "attention_mask", "token_type_ids")}
    with caplog.at_level(logging.INFO, logger="server.engines.torch"):
        np.testing.assert_array_equal(engine.run(feed)["numbers"], np.full((4, 3), 8, dtype=np.float32))
    lines = [r.getMessage().rsplit(" in ", 1)[0] for r in caplog.records if r.name == "server.engines.torch"]
    assert lines == ["compiled text batch 4 sequence 8"]


def test_two_models_never_compile_at_once(digits: Path, compiled: list[dict[str, Any]]) -> None:
    """The first engine's compile waits (bounded) for the second to start one of its own: with
    the process-wide lock, the second cannot, until the first is done."""
    config = digits_config(torch={"compile": True}, batch_buckets=[8])
    first, second = (create_engine(config, digits, Device("CPU")) for _ in range(2))
    first_started, second_started = threading.Event(), threading.Event()
    overlapped: list[bool] = []

    def slow_compile(*args: torch.Tensor) -> Any:
        first_started.set()
        overlapped.append(second_started.wait(timeout=0.5))
        return first_module(*args)

    def marked(*args: torch.Tensor) -> Any:
        second_started.set()
        return second_module(*args)

    first_module, second_module = first._module, second._module
    first._module, second._module = slow_compile, marked
    thread = threading.Thread(target=first.run, args=({"image": images(8)},))
    thread.start()
    assert first_started.wait(timeout=30)
    second.run({"image": images(8)})
    thread.join()
    assert overlapped == [False]

