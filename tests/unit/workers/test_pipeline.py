"""Batch assembly: merging, padding to the batch's longest, bucket ladders, splitting back."""

from __future__ import annotations

import numpy as np
import pytest

from server.config import ModelConfig
from server.engines.base import Engine, EngineDescription
from server.engines.signature import EngineSignature, TensorSignature
from server.errors import EngineError
from server.preprocess import TextTokenizer
from server.workers.pipeline import ModelPipeline, paddable_inputs, split
from tests.integration.conftest import MODELS, require_built_models


@pytest.fixture
def built_minilm() -> None:
    """A missing model is a failure with the reason (make test builds it), never a skip."""
    require_built_models(("minilm",))


class RowSums(Engine):
    """Sums each row over its non-batch dims; records the shapes it was given."""

    def __init__(self) -> None:
        self.seen: list[dict[str, tuple[int, ...]]] = []

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.seen.append({k: v.shape for k, v in inputs.items()})
        total = sum(v.reshape(len(v), -1).sum(1).astype(np.float64) for v in inputs.values())
        return {"engine_sum": total.reshape(-1, 1)}

    def describe(self) -> EngineDescription:
        return EngineDescription("fake", "cpu", "fp32")

    def signature(self) -> EngineSignature:
        return EngineSignature(inputs=(), outputs=(TensorSignature("engine_sum", "FP64", (None, 1)),))


def config(**overrides) -> ModelConfig:
    document = {
        "name": "toy",
        "engine": "onnxruntime",
        "max_batch_size": 8,
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [-1], "pad_value": 0}],
        "outputs": [{"name": "sum", "datatype": "FP32", "dims": [1], "engine_name": "engine_sum"}],
        "dynamic_batching": {},
        **overrides,
    }
    return ModelConfig.model_validate(document)


def test_requests_of_different_lengths_pad_to_the_longest() -> None:
    cfg = config()
    engine = RowSums()
    pipeline = ModelPipeline(cfg, engine, paddable_inputs(cfg, {}))
    feeds = [{"x": np.ones((2, 3), np.float32)}, {"x": np.full((1, 5), 2, np.float32)}]
    result = pipeline.run_batch(feeds)
    assert engine.seen == [{"x": (3, 5)}]
    assert [o["sum"].ravel().tolist() for o in result.outputs] == [[3.0, 3.0], [10.0]]
    assert all(o["sum"].dtype == np.float32 for o in result.outputs)
    assert result.compute_infer_ns > 0


def test_batches_pad_up_to_the_engines_bucket_and_cut_back() -> None:
    cfg = config(batch_buckets=[1, 4, 8], inputs=[{"name": "x", "datatype": "FP32", "dims": [2]}])
    engine = RowSums()
    pipeline = ModelPipeline(cfg, engine, paddable_inputs(cfg, {}))
    feeds = [{"x": np.array([[1, 2]], np.float32)}, {"x": np.array([[3, 4], [5, 6]], np.float32)}]
    result = pipeline.run_batch(feeds)
    assert engine.seen == [{"x": (4, 2)}]  # 3 items padded to the bucket of 4
    assert [o["sum"].ravel().tolist() for o in result.outputs] == [[3.0], [7.0, 11.0]]


def test_a_single_request_pads_to_its_bucket_too() -> None:
    cfg = config(batch_buckets=[4, 8], inputs=[{"name": "x", "datatype": "FP32", "dims": [1]}])
    engine = RowSums()
    result = ModelPipeline(cfg, engine, {}).run_batch([{"x": np.ones((3, 1), np.float32)}])
    assert engine.seen == [{"x": (4, 1)}]
    assert result.outputs[0]["sum"].shape == (3, 1)


@pytest.mark.parametrize("sizes", [[1, 1, 1], [2, 1, 3], [1, 2]])
def test_outputs_cut_back_per_request_are_views_of_their_own_rows_bucket_rows_dropped(sizes: list[int]) -> None:
    outputs = {"a": np.arange(16, dtype=np.float32).reshape(8, 2), "b": np.arange(8, dtype=np.int64)}
    pieces = split(outputs, sizes)
    start = 0
    assert len(pieces) == len(sizes)
    for piece, size in zip(pieces, sizes, strict=True):
        assert list(piece) == ["a", "b"]
        np.testing.assert_array_equal(piece["a"], outputs["a"][start:start + size])
        np.testing.assert_array_equal(piece["b"], outputs["b"][start:start + size])
        assert piece["a"].shape == (size, 2) and piece["b"].shape == (size,)
        assert np.shares_memory(piece["a"], outputs["a"]), "a view, not a copy"
        start += size


def test_unbatched_models_run_the_request_as_given() -> None:
    cfg = config(max_batch_size=0, dynamic_batching=None, inputs=[{"name": "x", "datatype": "FP32", "dims": [2, 2]}])
    engine = RowSums()
    result = ModelPipeline(cfg, engine, {}).run_batch([{"x": np.ones((2, 2), np.float32)}])
    assert engine.seen == [{"x": (2, 2)}]
    assert result.outputs[0]["sum"].shape == (2, 1)


def text_config(max_length: int, sequence_buckets: list[int], max_batch_tokens: int | None = None) -> ModelConfig:
    """A text model tokenized with minilm's tokenizer, whose engine just sums its inputs."""
    batching = {"max_batch_tokens": max_batch_tokens} if max_batch_tokens else {}
    return ModelConfig.model_validate(
        {
            "name": "text",
            "engine": "onnxruntime",
            "max_batch_size": 8,
            "inputs": [{"name": "text", "datatype": "BYTES", "dims": [1]}],
            "outputs": [{"name": "sum", "datatype": "FP32", "dims": [1], "engine_name": "engine_sum"}],
            "preprocess": {"tokenize": {"input": "text", "max_length": max_length, "sequence_buckets": sequence_buckets}},
            "dynamic_batching": batching,
        }
    )


class CompiledRowSums(RowSums):
    """RowSums as an engine prepared per shape (compiled): it gets only the shapes of its buckets."""

    @property
    def compiles_per_shape(self) -> bool:
        return True


@pytest.mark.usefixtures("built_minilm")
def test_token_tensors_pad_to_their_sequence_bucket_for_a_compiled_engine_only() -> None:
    cfg = text_config(max_length=16, sequence_buckets=[8, 16])
    tokenizer = TextTokenizer(cfg.tokenize, MODELS / "minilm/1")
    short, long = tokenizer.encode(["hi"]), tokenizer.encode(["a much longer sentence than the other one"])
    assert short["input_ids"].shape == (1, 3)  # [CLS] hi [SEP]
    assert long["input_ids"].shape[1] == 10
    compiled, plain = CompiledRowSums(), RowSums()
    for engine in (compiled, plain):
        ModelPipeline(cfg, engine, paddable_inputs(cfg, tokenizer.outputs)).run_batch([short, long])
        ModelPipeline(cfg, engine, paddable_inputs(cfg, tokenizer.outputs)).run_batch([short])
    assert [seen["input_ids"] for seen in compiled.seen] == [(2, 16), (1, 8)]  # the shapes it was compiled for
    assert [seen["input_ids"] for seen in plain.seen] == [(2, 10), (1, 3)]  # the batch's longest text: no waste
    assert tokenizer.encode(["word " * 100])["input_ids"].shape == (1, 16)  # truncated at max_length
    fixed = text_config(max_length=16, sequence_buckets=[16])  # one bucket: a fixed length, any engine
    ModelPipeline(fixed, plain, paddable_inputs(fixed, tokenizer.outputs)).run_batch([short])
    assert plain.seen[-1]["input_ids"] == (1, 16)


@pytest.mark.usefixtures("built_minilm")
def test_only_texts_of_one_length_bucket_share_a_batch() -> None:
    from server.scheduler.admission import Admission

    cfg = text_config(max_length=64, sequence_buckets=[8, 64], max_batch_tokens=256)
    admission = Admission(cfg, TextTokenizer(cfg.tokenize, MODELS / "minilm/1"))

    def admitted(text: str):
        return admission.admit_now({"text": np.array([[text]], dtype=object)}, 1)

    short, also_short, long = admitted("hi"), admitted("hello there"), admitted("a sentence of many more words " * 3)
    assert short.shape_key == also_short.shape_key != long.shape_key
    assert (short.longest, long.longest) == (8, 64)  # the budget counts padded tokens
    assert (short.length, also_short.length) == (3, 4)  # the batcher groups by the tokens themselves



def test_verify_checks_the_engines_own_outputs_before_the_cast() -> None:
    """Warm-up verifies: RowSums gives FP64 (a float, cast to the declared FP32) of one column."""
    feeds = [{"x": np.ones((2, 3), np.float32)}]
    cfg = config()
    ModelPipeline(cfg, RowSums(), paddable_inputs(cfg, {})).run_batch(feeds, verify=True)
    wide = config(outputs=[{"name": "sum", "datatype": "FP32", "dims": [2], "engine_name": "engine_sum"}])
    pipeline = ModelPipeline(wide, RowSums(), paddable_inputs(wide, {}))
    pipeline.run_batch(feeds)  # serving trusts the check made at load
    with pytest.raises(EngineError, match=r"output 'sum' \(engine name 'engine_sum'\): the config says FP32 \[-1, 2\], "
                                          r"the model returned FP64 \[2, 1\] for a batch of 2"):
        pipeline.run_batch(feeds, verify=True)


class SumsEverything(RowSums):
    """A model that reduces over the batch too: one row whatever the batch holds."""

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"engine_sum": np.array([[float(sum(v.sum() for v in inputs.values()))]])}


def test_an_output_without_a_row_for_each_of_the_batch_fails_the_batch_rather_than_answer_wrong_rows() -> None:
    cfg = config()
    pipeline = ModelPipeline(cfg, SumsEverything(), paddable_inputs(cfg, {}))
    alone = pipeline.run_batch([{"x": np.ones((1, 3), np.float32)}])  # one row for one: right
    assert alone.outputs[0]["sum"].tolist() == [[3.0]]
    with pytest.raises(EngineError, match=r"model 'toy' returned output 'sum' of shape \[1, 1\] for a batch of 3 items"):
        pipeline.run_batch([{"x": np.ones((2, 3), np.float32)}, {"x": np.ones((1, 3), np.float32)}])


class Identity(Engine):
    """Answers its input as its output, the very array (as a torch program on the CPU may): the
    answer shares memory with the merged batch. Records the arrays it was given."""

    def __init__(self) -> None:
        self.given: list[np.ndarray] = []

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.given.append(inputs["x"])
        return {"y": inputs["x"]}

    def describe(self) -> EngineDescription:
        return EngineDescription("fake", "cpu", "fp32")

    def signature(self) -> EngineSignature:
        return EngineSignature(inputs=(), outputs=(TensorSignature("y", "FP32", (None, 1024)),))


def image_config(**overrides) -> ModelConfig:  # type: ignore[no-untyped-def]
    return config(max_batch_size=64, inputs=[{"name": "x", "datatype": "FP32", "dims": [1024]}],
                  outputs=[{"name": "y", "datatype": "FP32", "dims": [1024]}], **overrides)


def requests_of(rows: int, first: float) -> list[dict[str, np.ndarray]]:
    """`rows` requests of one row of 1,024 floats (4 KiB), the first row all `first`, then first+1..."""
    return [{"x": np.full((1, 1024), first + i, np.float32)} for i in range(rows)]


def test_a_large_merge_reuses_the_instances_buffer_and_answers_stay_each_batchs_own() -> None:
    """Batches past the reuse size merge into one kept buffer (no new memory from the system for
    each); an engine that answers with its input does not see the next batch overwrite the
    answers already cut for the last one."""
    cfg = image_config()
    engine = Identity()
    pipeline = ModelPipeline(cfg, engine, paddable_inputs(cfg, {}), reuse_min_bytes=16 << 10)  # 4 rows of 4 KiB
    first = pipeline.run_batch(requests_of(8, 0.0))
    second = pipeline.run_batch(requests_of(8, 100.0))
    assert np.shares_memory(engine.given[0], engine.given[1]), "the second batch merged into the first's buffer"
    assert [float(r["y"][0, 0]) for r in first.outputs] == [float(i) for i in range(8)]
    assert [float(r["y"][0, 0]) for r in second.outputs] == [100.0 + i for i in range(8)]
    # a larger batch grows the buffer (at least doubling); a small one (3 rows) stays out of it
    third = pipeline.run_batch(requests_of(12, 200.0))
    small = pipeline.run_batch(requests_of(3, 300.0))
    assert not np.shares_memory(engine.given[2], engine.given[0])
    assert engine.given[2].base is not None and engine.given[2].base.nbytes >= 2 * 8 * 4096
    assert not np.shares_memory(engine.given[3], engine.given[2])
    assert [float(r["y"][0, 0]) for r in third.outputs] == [200.0 + i for i in range(12)]
    assert [float(r["y"][0, 0]) for r in small.outputs] == [300.0, 301.0, 302.0]


def test_a_large_merge_fills_its_bucket_with_copies_of_the_last_row() -> None:
    cfg = image_config(batch_buckets=[4, 16, 64])
    engine = Identity()
    pipeline = ModelPipeline(cfg, engine, paddable_inputs(cfg, {}), reuse_min_bytes=16 << 10)
    pipeline.run_batch(requests_of(16, 50.0))  # the buffer, full of the first batch's rows
    result = pipeline.run_batch(requests_of(5, 0.0))
    merged = engine.given[1]
    assert merged.shape == (16, 1024) and np.shares_memory(merged, engine.given[0])
    assert merged[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0] + [4.0] * 12
    assert [float(r["y"][0, 0]) for r in result.outputs] == [0.0, 1.0, 2.0, 3.0, 4.0]
    # one request of 5 rows short of its bucket goes through the buffer too; one of a whole bucket
    # is passed as it is
    request = {"x": np.arange(5 * 1024, dtype=np.float32).reshape(5, 1024)}
    pipeline.run_batch([request])
    assert np.shares_memory(engine.given[2], engine.given[0]) and engine.given[2].shape == (16, 1024)
    assert (engine.given[2][5:] == request["x"][4]).all()
    whole = {"x": np.ones((16, 1024), np.float32)}
    pipeline.run_batch([whole])
    assert engine.given[3] is whole["x"]


def test_each_large_input_has_a_buffer_of_its_own() -> None:
    cfg = config(max_batch_size=64, inputs=[{"name": "x", "datatype": "FP32", "dims": [1024]},
                                            {"name": "z", "datatype": "FP32", "dims": [1024]}],
                 outputs=[{"name": "sum", "datatype": "FP32", "dims": [1], "engine_name": "engine_sum"}])
    engine = RowSums()
    pipeline = ModelPipeline(cfg, engine, paddable_inputs(cfg, {}), reuse_min_bytes=16 << 10)
    feeds = [{"x": np.full((1, 1024), i, np.float32), "z": np.full((1, 1024), 10 * i, np.float32)} for i in range(8)]
    result = pipeline.run_batch(feeds)
    assert [float(r["sum"][0, 0]) for r in result.outputs] == [1024.0 * 11 * i for i in range(8)]


def test_bytes_and_mixed_datatypes_merge_as_before_past_the_reuse_size() -> None:
    """A byte buffer cannot be viewed as object pointers: BYTES inputs are concatenated as
    before, as are parts whose datatypes differ (numpy promotes them)."""
    cfg = config(max_batch_size=64, inputs=[{"name": "x", "datatype": "BYTES", "dims": [2]}],
                 outputs=[{"name": "y", "datatype": "BYTES", "dims": [2]}])
    seen: list[np.ndarray] = []

    class Echo(Identity):
        def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            seen.append(inputs["x"])
            return {"y": inputs["x"]}

    pipeline = ModelPipeline(cfg, Echo(), paddable_inputs(cfg, {}), reuse_min_bytes=8)
    feeds = [{"x": np.array([[b"a%d" % i, b"b"]], dtype=object)} for i in range(4)]
    result = pipeline.run_batch(feeds)
    assert [r["y"][0, 0] for r in result.outputs] == [b"a0", b"a1", b"a2", b"a3"]
    mixed = ModelPipeline(image_config(), Identity(), {}, reuse_min_bytes=8)
    parts = [{"x": np.ones((1, 1024), np.float32)}, {"x": np.ones((1, 1024), np.float64)}]
    assert [r["y"].dtype for r in mixed.run_batch(parts).outputs] == [np.float32, np.float32]


def test_the_shipped_reuse_size_leaves_small_models_merging_as_before() -> None:
    cfg = image_config()
    engine = Identity()
    pipeline = ModelPipeline(cfg, engine, paddable_inputs(cfg, {}))
    for _ in range(2):
        pipeline.run_batch(requests_of(64, 0.0))  # 256 KiB: under 32 MiB
    assert not np.shares_memory(engine.given[0], engine.given[1])
