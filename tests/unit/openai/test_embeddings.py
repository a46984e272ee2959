"""One embeddings call as data-plane requests: chunks of like-length texts, all in flight at
once, answers put back in the order of the texts, usage summed, the first failure fails all."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer

from server.config import DynamicBatching, ModelConfig, Tokenize, load_model_config
from server.dataplane import Call
from server.errors import QueueFull
from server.openai.embeddings import chunk_size, embed
from server.preprocess import TextTokenizer
from server.scheduler.admission import Admission
from server.scheduler.chunking import chunks, tokens_at_most
from server.scheduler.request import RequestRecord
from server.stats import ModelStatistics
from tests.unit.cycles import left_in_cycles

ROOT = Path(__file__).resolve().parents[3]
MINILM = ROOT / "models" / "minilm"
DIMS = 4


def config(max_batch_size: int = 8) -> ModelConfig:
    return ModelConfig.model_validate({
        "name": "emb", "engine": "onnxruntime", "max_batch_size": max_batch_size,
        "inputs": [{"name": "text", "datatype": "BYTES", "dims": [1]}],
        "outputs": [{"name": "embedding", "datatype": "FP32", "dims": [DIMS]}],
        "preprocess": {"tokenize": {"input": "text"}},
        "openai": {"task": "embeddings"},
    })


@dataclass
class FakeModel:
    config: ModelConfig
    version: int = 3
    stats: ModelStatistics = field(default_factory=ModelStatistics)
    instances: list[object] = field(default_factory=lambda: [object(), object()])  # two: four chunks at once


class FakePlane:
    """Answers each text with a vector of its length, and counts a token per byte; holds the
    calls until `expected` are in flight at once (so they must be submitted together), or fails
    the one that holds `fail_on`."""

    def __init__(self, expected: int, fail_on: bytes | None = None) -> None:
        self.expected = expected
        self.fail_on = fail_on
        self.calls: list[list[bytes]] = []
        self.all_in = asyncio.Event()
        self.cancelled = 0
        self.now = self.most = 0
        self.received: list[int | None] = []

    def start_call(self, *call: Any) -> Call:
        """A started call as the data plane starts one: its future, completed as computed."""
        return Call(asyncio.ensure_future(self._answer(*call)), [("embedding", "FP32")], call[0])

    async def _answer(self, model: FakeModel, inputs: dict[str, tuple[str, np.ndarray]], parameters: dict[str, Any],
                      outputs: list[str] | None, record: RequestRecord,
                      received_ns: int | None = None) -> dict[str, np.ndarray]:
        self.received.append(received_ns)
        datatype, array = inputs["text"]
        assert datatype == "BYTES" and array.shape == (len(array), 1) and outputs == ["embedding"]
        texts = list(array.reshape(-1))
        self.calls.append(texts)
        if self.fail_on in texts:
            raise QueueFull("the queue of this model is full")
        self.now += 1
        self.most = max(self.most, self.now)
        if self.now == self.expected:
            self.all_in.set()
        try:
            await self.all_in.wait()
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.now -= 1
        record.tokens = sum(len(t) for t in texts)
        record.queue_ns, record.compute_ns = len(texts), 10 * len(texts)
        return {"embedding": np.array([[len(t)] * DIMS for t in texts], dtype=np.float32)}


def test_chunks_group_texts_of_like_length_and_keep_every_index_once() -> None:
    sizes = [5, 1, 9, 3, 1, 7, 2]
    plan = chunks(sizes, 3)
    assert plan == [[1, 4, 6], [3, 0, 5], [2]]
    assert sorted(i for part in plan for i in part) == list(range(len(sizes)))
    assert chunks([4], 64) == [[0]]


def test_with_a_token_budget_a_chunk_of_long_texts_holds_fewer_of_them() -> None:
    sizes = [40, 10, 200, 10, 40, 10]
    assert chunks(sizes, 64, max_tokens=80) == [[1, 3, 5], [0, 4], [2]]  # 4 x 10 fits, 3 x 40 would not
    assert chunks(sizes, 2, max_tokens=80) == [[1, 3], [5, 0], [4], [2]]  # and never more than the size
    assert chunks([500], 64, max_tokens=80) == [[0]]  # alone, whatever its tokens
    plain, bucketed = Tokenize(input="text", max_length=256), Tokenize(input="text", max_length=256,
                                                                        sequence_buckets=[16, 64, 256])
    assert tokens_at_most(b"x" * 10, plain) == 12 and tokens_at_most(b"x" * 10_000, plain) == 256
    assert tokens_at_most(b"x" * 10, bucketed) == 16 and tokens_at_most(b"x" * 39, bucketed) == 64  # as batched


async def test_a_model_with_a_token_budget_gets_its_long_texts_in_smaller_chunks() -> None:
    """On one CPU core a chunk of 64 texts at 256 tokens ran for seconds, and every other
    caller's text waited behind it; within the model's max_batch_tokens it runs as a batch may."""
    budgeted = config(max_batch_size=8).model_copy(update={"dynamic_batching": DynamicBatching(max_batch_tokens=210)})
    texts = [b"x" * 100, b"abc", b"y" * 100, b"def", b"z" * 100, b"ghi", b"w" * 100, b"jkl"]
    plane = FakePlane(expected=3)
    vectors = await embed(plane, FakeModel(budgeted), texts, RequestRecord())  # type: ignore[arg-type]
    assert [len(call) for call in plane.calls] == [4, 2, 2]  # 4 x 5 tokens; 2 x 102, as 3 x 102 > 210
    np.testing.assert_array_equal(vectors[:, 0], [len(t) for t in texts])


def test_the_chunk_is_the_measured_batch_cap_within_max_batch_size() -> None:
    model = FakeModel(config(max_batch_size=64))
    assert chunk_size(model) == 64  # not measured: the whole batch
    model.stats.batch_cap = 16
    assert chunk_size(model) == 16


async def test_a_list_goes_as_chunks_in_flight_together_and_comes_back_in_order() -> None:
    texts = [b"x" * n for n in (5, 1, 9, 3, 1, 7, 2, 4, 8, 6)]
    model = FakeModel(config(max_batch_size=3))
    plane = FakePlane(expected=4)
    record = RequestRecord()
    vectors = await embed(plane, model, texts, record, 12345)  # type: ignore[arg-type]
    assert set(plane.received) == {12345}  # every chunk's deadline counts from the call's arrival
    assert [len(call) for call in plane.calls] == [3, 3, 3, 1]
    assert [len(t) for call in plane.calls for t in call] == sorted(len(t) for t in texts)
    np.testing.assert_array_equal(vectors[:, 0], [len(t) for t in texts])
    assert record.tokens == sum(len(t) for t in texts)
    assert (record.model_version, record.queue_ns, record.compute_ns) == (3, 3, 30)  # the longest chunk's times


async def test_a_long_list_has_two_chunks_per_instance_in_flight_at_most() -> None:
    texts = [b"x" * n for n in range(1, 41)]
    plane = FakePlane(expected=4)  # FakeModel has two instances
    vectors = await embed(plane, FakeModel(config(max_batch_size=2)), texts, RequestRecord())  # type: ignore[arg-type]
    assert len(plane.calls) == 20 and plane.most == 4
    np.testing.assert_array_equal(vectors[:, 0], [len(t) for t in texts])


async def test_the_first_failure_fails_the_call_and_cancels_the_chunks_still_waiting() -> None:
    texts = [b"a", b"bb", b"ccc", b"dddd"]
    plane = FakePlane(expected=99, fail_on=b"dddd")  # the others wait until cancelled
    model = FakeModel(config(max_batch_size=1), instances=[object(), object()])
    with pytest.raises(QueueFull):
        await embed(plane, model, texts, RequestRecord())  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert plane.cancelled == 3  # the longest text is last: the three before it were in flight


def test_usage_is_the_tokenizers_count_without_padding() -> None:
    """Counted from the tensors admission built, so nothing is tokenized twice."""
    minilm = load_model_config(MINILM / "config.yaml")
    tokenizer = TextTokenizer(minilm.tokenize, MINILM / "1")  # type: ignore[arg-type]
    admission = Admission(minilm, tokenizer)
    texts = ["hi", "a much longer sentence than the other one", "word " * 400]
    feed = admission.admit_now({"text": np.array([[t] for t in texts], dtype=object)}, len(texts)).feed
    plain = Tokenizer.from_file(str(MINILM / "1" / "tokenizer.json"))
    plain.no_padding()  # the file may pad; the count is of real tokens
    plain.enable_truncation(max_length=minilm.tokenize.max_length)  # type: ignore[union-attr]
    expected = sum(len(plain.encode(t).ids) for t in texts)
    assert admission.tokens_in(feed) == expected
    assert expected == 3 + 10 + 256  # [CLS] hi [SEP]; ...; truncated at max_length 256
    no_mask = minilm.model_copy(update={"preprocess": minilm.preprocess.model_copy(update={  # type: ignore[union-attr]
        "tokenize": minilm.tokenize.model_copy(update={"attention_mask": None})})})  # type: ignore[union-attr]
    assert Admission(no_mask, tokenizer).tokens_in({k: v for k, v in feed.items() if k != "attention_mask"}) == expected


async def test_a_failed_call_leaves_nothing_in_reference_cycles() -> None:
    """Else the call's texts, megabytes of them, live on until a full collection, which the
    server's tuned collector runs rarely: about 100 MB a failed call of 2,048 long texts."""
    texts = [b"a", b"bb", b"ccc", b"dddd"]
    model = FakeModel(config(max_batch_size=1))

    async def failing_calls(count: int) -> None:
        for _ in range(count):
            try:
                await embed(FakePlane(expected=99, fail_on=b"dddd"), model, texts, RequestRecord())  # type: ignore[arg-type]
            except QueueFull:
                pass
            await asyncio.sleep(0)

    found = await left_in_cycles(failing_calls, 5, 50)
    assert found < 50, f"{found} objects in reference cycles after 50 failed calls"
