"""Warm-up, on the instance's own thread. For an engine that prepares each shape on its first run
(`compiles_per_shape`) it covers every shape a model can be sent: each batch bucket a batch can be
padded up to, times each sequence bucket of a text model, so a compiled engine never compiles
while serving; any other engine runs a few batch sizes, the warm-up text at its own length.
A recording engine stands in for the real one; the last test compiles the digits model for real."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

import server.model
from server.config import ModelConfig
from server.devices import Device
from server.engines.base import Engine, EngineDescription
from server.engines.signature import EngineSignature
from server.errors import EngineError
from server.model import ModelVersion
from tests.integration.conftest import require_built_models
from tests.unit.onnx_models import doubling, summed_over_the_batch

WORDS = ["batchline", "warms", "up", "this", "model", "before", "it", "serves"]
SWEPT = "every bucket a batch can reach (the engine prepares each shape on its first run)"
NOT_SWEPT = "buckets not swept (the engine prepares nothing per shape)"


class RecordingEngine(Engine):
    """Answers zeros of the declared output dims, and keeps the shapes of every input it ran and
    the thread that ran each; `compiles` is what it says of itself (compiles_per_shape)."""

    def __init__(self, config: ModelConfig, version_dir: Path, device: Device, compiles: bool = False) -> None:
        self.config = config
        self.compiles = compiles
        self.runs: list[dict[str, tuple[int, ...]]] = []
        self.threads: list[threading.Thread] = []

    @property
    def compiles_per_shape(self) -> bool:
        return self.compiles

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.runs.append({name: array.shape for name, array in inputs.items()})
        self.threads.append(threading.current_thread())
        rows = len(next(iter(inputs.values())))
        return {t.source_name: np.zeros((rows, *t.dims), dtype=np.float32) for t in self.config.outputs}

    def describe(self) -> EngineDescription:
        return EngineDescription("recording", "cpu", "fp32")

    def signature(self) -> EngineSignature:
        return EngineSignature(inputs=(), outputs=())


def install(monkeypatch: pytest.MonkeyPatch, compiles: bool) -> list[RecordingEngine]:
    """Recording engines in place of the real ones; the list holds each one made."""
    created: list[RecordingEngine] = []

    def create(config: ModelConfig, version_dir: Path, device: Device) -> Engine:
        created.append(RecordingEngine(config, version_dir, device, compiles))
        return created[-1]

    monkeypatch.setattr(server.model, "create_engine", create)
    return created


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> list[RecordingEngine]:
    """Engines that compile per shape, as torch.compile and TensorRT do."""
    return install(monkeypatch, compiles=True)


@pytest.fixture
def plain_engines(monkeypatch: pytest.MonkeyPatch) -> list[RecordingEngine]:
    """Engines with nothing to prepare per shape, as ONNX Runtime on the CPU."""
    return install(monkeypatch, compiles=False)


def built(config: dict[str, Any], version_dir: Path) -> ModelVersion:
    """A model version loaded as the server loads it (instances built and warmed up), closed."""
    version = ModelVersion(ModelConfig.model_validate(config), 1, version_dir)
    try:
        version._build()
    finally:
        version._close_instances()
    return version


def vector_model(**fields: Any) -> dict[str, Any]:
    return {
        "name": "vector",
        "engine": "onnxruntime",
        "max_batch_size": 6,
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [2]}],
        **fields,
    }


@pytest.fixture
def tokenizer_folder(tmp_path: Path) -> Path:
    """A word-level tokenizer that brackets each text in [CLS] ... [SEP], as BERT's does."""
    vocabulary = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3} | {w: i + 4 for i, w in enumerate(WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def text_model(sequence_buckets: list[int] | None, **fields: Any) -> dict[str, Any]:
    return {
        "name": "text",
        "engine": "torch",
        "max_batch_size": 4,
        "inputs": [{"name": "text", "datatype": "BYTES", "dims": [1]}],
        "outputs": [{"name": "embedding", "datatype": "FP32", "dims": [3]}],
        "preprocess": {"tokenize": {"input": "text", "max_length": 16, "sequence_buckets": sequence_buckets}},
        "warmup": {"text": " ".join(WORDS)},  # 10 tokens with [CLS] and [SEP]
        **fields,
    }


def shapes(engine: RecordingEngine, name: str) -> set[tuple[int, ...]]:
    return {run[name] for run in engine.runs}


def test_every_batch_bucket_is_warmed_up_even_past_max_batch_size(
    engines: list[RecordingEngine], tmp_path: Path
) -> None:
    """A full batch of 6 pads up to the bucket of 8, which warm-up reached only at a batch of 8
    (refused: above max_batch_size); 16 is past every batch."""
    built(vector_model(batch_buckets=[2, 4, 8, 16], warmup={"batch_sizes": [1]}), tmp_path)
    assert shapes(engines[0], "x") == {(2, 4), (4, 4), (8, 4)}


def test_without_batch_buckets_warm_up_runs_its_batch_sizes(engines: list[RecordingEngine], tmp_path: Path) -> None:
    built(vector_model(warmup={"batch_sizes": [1, 3, 6]}), tmp_path)
    assert [run["x"] for run in engines[0].runs] == [(1, 4), (3, 4), (6, 4)]


def test_the_batch_cap_is_the_models_not_the_machines_drift(
    plain_engines: list[RecordingEngine], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A batch costs 1 ms + 0.25 ms an item (items/s: 800, 1333, 2000, 2667 at 1, 2, 4, 8), and
    the machine runs three times slower from its eleventh batch on (two warm-up runs, at 1 and 2,
    one untimed run per size, then four timed). Timing one size after another, sizes 4 and 8 were timed slow
    only and the cap came out 2; with each repeat over every size, the fast first round counts
    for all of them."""
    clock = [0.0]
    monkeypatch.setattr(server.model, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    recorded = RecordingEngine.run

    def run(engine: RecordingEngine, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        clock[0] += (0.001 + 0.00025 * len(inputs["x"])) * (3 if len(engine.runs) >= 10 else 1)
        return recorded(engine, inputs)

    monkeypatch.setattr(RecordingEngine, "run", run)
    version = built(vector_model(max_batch_size=8, warmup={"profile": True, "profile_repeats": 3}), tmp_path)
    assert [r["x"][0] for r in plain_engines[0].runs[:10]] == [1, 2, 1, 2, 4, 8, 1, 2, 4, 8]
    profile = {p["batch_size"]: round(p["items_per_second"]) for p in version.stats.batch_profile}
    assert profile == {1: 800, 2: 1333, 4: 2000, 8: 2667}
    assert version.stats.batch_cap == 8


def test_a_batch_profile_ends_within_its_time_budget(
    plain_engines: list[RecordingEngine], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A profile of a billion repeats once held its load for good: the model could not be
    reloaded or unloaded, other models' profiles waited, and a stop never ended. Repeats are
    bounded, and passes stop once the budget has gone (one pass of sizes 1, 2, 4, 8: 4 s)."""
    clock = [0.0]
    monkeypatch.setattr(server.model, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    recorded = RecordingEngine.run

    def run(engine: RecordingEngine, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        clock[0] += 1.0
        return recorded(engine, inputs)

    monkeypatch.setattr(RecordingEngine, "run", run)
    with pytest.raises(ValueError, match="profile_repeats"):
        ModelConfig.model_validate(vector_model(warmup={"profile": True, "profile_repeats": 1_000_000_000}))
    version = built(vector_model(max_batch_size=8, warmup={"profile": True, "profile_repeats": 100}), tmp_path)
    passes = (len(plain_engines[0].runs) - 2 - 4) / 4  # less the warm-up runs and the untimed pass
    assert passes == server.model.PROFILE_BUDGET_S // 4 + 1
    assert version.stats.batch_cap == 8  # every size took 1 s: the largest gives most


def test_every_instance_is_warmed_up_at_every_bucket(engines: list[RecordingEngine], tmp_path: Path) -> None:
    built(vector_model(batch_buckets=[4, 6], instance_group=[{"count": 2, "kind": "CPU"}]), tmp_path)
    assert len(engines) == 2
    assert all(shapes(e, "x") == {(4, 4), (6, 4)} for e in engines)


def test_warm_up_and_the_profile_run_on_the_instances_own_thread(
    engines: list[RecordingEngine], tmp_path: Path
) -> None:
    """torch keeps CUDA graphs per thread: made on any other thread than the one that serves,
    they would be made twice, and the second time with a client waiting."""
    config = vector_model(
        batch_buckets=[2, 4, 8], warmup={"profile": True, "profile_repeats": 1},
        instance_group=[{"count": 2, "kind": "CPU"}],
    )
    version = ModelVersion(ModelConfig.model_validate(config), 1, tmp_path)
    try:
        version._build()
        assert len(engines[0].runs) > len(engines[1].runs)  # the profile ran on the first instance
        for instance, engine in zip(version.instances, engines):
            assert engine.threads and set(engine.threads) == {instance._thread}
            assert instance._thread.name == instance.label
    finally:
        version._close_instances()


def test_a_replacement_instance_warms_up_on_its_own_thread(engines: list[RecordingEngine], tmp_path: Path) -> None:
    version = ModelVersion(ModelConfig.model_validate(vector_model(batch_buckets=[2, 6])), 1, tmp_path)
    try:
        version._build()
        stuck = version.instances[0]
        stuck.abandoned = True  # as the watchdog leaves it (its thread came back: nothing is stuck)
        fresh = asyncio.run(version._replace(stuck))
        assert version.instances == [fresh] and fresh is not stuck
        assert shapes(engines[1], "x") == {(2, 4), (6, 4)}
        assert set(engines[1].threads) == {fresh._thread} and fresh._thread is not stuck._thread
    finally:
        version._close_instances()


def test_a_text_model_warms_every_batch_bucket_at_every_sequence_bucket(
    engines: list[RecordingEngine], tokenizer_folder: Path
) -> None:
    """The warm-up text is 10 tokens: cut to the bucket of 4 and padded to those of 8 and 16."""
    built(text_model([4, 8, 16], batch_buckets=[2, 4]), tokenizer_folder)
    expected = {(b, s) for b in (2, 4) for s in (4, 8, 16)}
    for name in ("input_ids", "attention_mask", "token_type_ids"):
        assert shapes(engines[0], name) == expected


def test_sequence_padding_is_what_a_batch_of_longer_texts_would_give(
    engines: list[RecordingEngine], tokenizer_folder: Path
) -> None:
    version = built(text_model([4, 16], warmup={"text": "this model", "batch_sizes": [1]}), tokenizer_folder)
    feed = version._sample_feed(1)
    assert feed["input_ids"].tolist() == [[2, 7, 8, 3]]  # [CLS] this model [SEP]
    padded = version._fitted(feed, 16)
    assert padded["input_ids"].tolist() == [[2, 7, 8, 3] + [0] * 12]
    assert padded["attention_mask"].tolist() == [[1] * 4 + [0] * 12]
    assert version._fitted(feed, 2)["input_ids"].tolist() == [[2, 7]]
    assert version._fitted(feed, None) is feed


def test_a_text_model_without_sequence_buckets_runs_its_text_as_it_is(
    engines: list[RecordingEngine], tokenizer_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="server.model"):
        built(text_model(None, warmup={"text": " ".join(WORDS), "batch_sizes": [1, 4]}), tokenizer_folder)
    assert shapes(engines[0], "input_ids") == {(1, 10), (4, 10)}
    assert caplog.messages == [f"model text/1: warm-up at batch sizes [1, 4]: {SWEPT}"]


def test_a_compiling_engines_sweep_is_logged_with_its_sequence_lengths(
    engines: list[RecordingEngine], tokenizer_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="server.model"):
        built(text_model([4, 8, 16], batch_buckets=[2, 4]), tokenizer_folder)
    assert caplog.messages == [f"model text/1: warm-up at batch sizes [1, 2, 4], each at sequence lengths [4, 8, 16]: {SWEPT}"]


# an engine with nothing to prepare per shape (ONNX Runtime on the CPU) sweeps no buckets


def test_an_engine_that_compiles_nothing_warms_up_its_sizes_and_the_buckets_within_max_batch_size(
    plain_engines: list[RecordingEngine], tmp_path: Path
) -> None:
    """No bucket past max_batch_size: a full batch pads up to it, but there is nothing to prepare."""
    built(vector_model(batch_buckets=[2, 4, 8, 16], warmup={"batch_sizes": [1, 3]}), tmp_path)
    assert [run["x"] for run in plain_engines[0].runs] == [(2, 4), (2, 4), (4, 4), (4, 4)]  # 1, 2, 3, 4: padded


def test_an_engine_that_compiles_nothing_runs_the_warm_up_text_once_at_its_own_length(
    plain_engines: list[RecordingEngine], tokenizer_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The 10-token text at its own length, as a batch of it would run on such an engine (the
    bucket's padding is for compiled shapes): no sweep of 4, 8 and 16."""
    with caplog.at_level(logging.INFO, logger="server.model"):
        built(text_model([4, 8, 16], batch_buckets=[2, 4]), tokenizer_folder)
    assert [run["input_ids"] for run in plain_engines[0].runs] == [(2, 10), (2, 10), (4, 10)]  # 1 pads up to 2
    assert caplog.messages == [f"model text/1: warm-up at batch sizes [1, 2, 4]: {NOT_SWEPT}"]


def test_a_failed_warm_up_names_the_batch_size_and_sequence_length(
    monkeypatch: pytest.MonkeyPatch, engines: list[RecordingEngine], tokenizer_folder: Path
) -> None:
    run = RecordingEngine.run

    def refuse_long(self: RecordingEngine, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if inputs["input_ids"].shape[1] > 8:
            raise EngineError("no kernel for this shape")
        return run(self, inputs)

    monkeypatch.setattr(RecordingEngine, "run", refuse_long)
    with pytest.raises(EngineError, match="warm-up at batch size 1, sequence length 16 failed: no kernel"):
        built(text_model([8, 16], batch_buckets=[2, 4]), tokenizer_folder)


def test_onnxruntime_on_the_cpu_sweeps_no_buckets(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The real engine says it prepares nothing per shape (docs: the shipped minilm's warm-up)."""
    doubling(tmp_path)
    config = vector_model(
        batch_buckets=[2, 4, 8], inputs=[{"name": "x", "datatype": "FP32", "dims": [2]}],
        outputs=[{"name": "y", "datatype": "FP32", "dims": [2]}],
    )
    with caplog.at_level(logging.INFO, logger="server.model"):
        built(config, tmp_path)
    warm_up = [r.getMessage() for r in caplog.records if r.name == "server.model"]
    assert warm_up == [f"model vector/1: warm-up at batch sizes [1, 2, 4]: {NOT_SWEPT}"]


def test_a_model_whose_outputs_ignore_the_batch_is_refused_at_load(tmp_path: Path) -> None:
    """Its batch of 1 is right; with a warm-up of batch 1 alone it loaded, and failed every
    batch of more under load. A batching model now warms up at 2 as well."""
    summed_over_the_batch(tmp_path)
    config = vector_model(inputs=[{"name": "x", "datatype": "FP32", "dims": [2]}],
                          outputs=[{"name": "y", "datatype": "FP32", "dims": [2]}])
    with pytest.raises(EngineError, match=r"warm-up at batch size 2 failed: output 'y'.* returned FP32 \[1, 2\] for a batch of 2"):
        built(config, tmp_path)
    one_a_batch = {**config, "max_batch_size": 1}  # a batch of 1 is all it serves
    assert built(one_a_batch, tmp_path).stats.batch_cap == 1


def test_warm_up_disabled_runs_nothing(engines: list[RecordingEngine], tmp_path: Path) -> None:
    built(vector_model(batch_buckets=[2, 8], warmup={"enabled": False}), tmp_path)
    assert engines[0].runs == []


def test_a_compiled_torch_model_compiles_every_bucket_at_warm_up(caplog: pytest.LogCaptureFixture) -> None:
    """The real torch.compile on the CPU: each bucket once, each logged with its time, and none
    left for serving (the bucket past max_batch_size included)."""
    require_built_models(("digits",))
    digits = Path(__file__).resolve().parents[2] / "models" / "digits" / "1"
    config = {
        "name": "digits",
        "engine": "torch",
        "max_batch_size": 6,
        "batch_buckets": [2, 8],
        "inputs": [{"name": "image", "datatype": "FP32", "dims": [1, 8, 8]}],
        "outputs": [{"name": "probabilities", "datatype": "FP32", "dims": [10]}],
        "torch": {"compile": True, "num_threads": 1},
    }
    version = ModelVersion(ModelConfig.model_validate(config), 1, digits)
    try:
        with caplog.at_level(logging.INFO, logger="server.engines.torch"):
            version._build()
        compiled = [m.rsplit(" in ", 1)[0] for m in caplog.messages if m.startswith("compiled")]
        assert compiled == ["compiled digits batch 2", "compiled digits batch 8"]
        caplog.clear()
        pipeline = version.instances[0].pipeline
        for size in range(1, 7):
            pipeline.run_batch([version._sample_feed(size)])
        assert not [m for m in caplog.messages if m.startswith("compiled")]
    finally:
        version._close_instances()


@pytest.mark.parametrize(("compiles", "buckets", "preserve", "by_length"), [
    (False, [8, 16], False, True),  # a batch runs its longest text: its order saves padding
    (True, [8, 16], False, False),  # padded to the bucket: any order costs the same
    (False, [16], False, False),  # one bucket, one length for every batch
    (False, [8, 16], True, False),  # answers leave in arrival order: none waits on a reordering
])
def test_texts_are_batched_by_length_only_where_that_saves_padding(
    monkeypatch: pytest.MonkeyPatch, tokenizer_folder: Path, compiles: bool, buckets: list[int], preserve: bool,
    by_length: bool,
) -> None:
    install(monkeypatch, compiles)
    config = text_model(buckets, dynamic_batching={"preserve_ordering": preserve})
    version = ModelVersion(ModelConfig.model_validate(config), 1, tokenizer_folder)

    async def submitted() -> list[int]:
        await version.load()
        assert version.ready, version.reason
        queued: list[int] = []
        assert version._batcher is not None
        assert version._batcher._settings.by_length is by_length
        sent = version._batcher.submit
        monkeypatch.setattr(version._batcher, "submit", lambda request: (queued.append(request.length), sent(request)))
        texts = np.array([["batchline warms up"], ["this model"]], dtype=object)
        await version.start_request({"text": ("BYTES", texts)})
        await version.unload()
        return queued

    assert asyncio.run(submitted()) == [5], "its longest text in tokens, [CLS] and [SEP] included"
