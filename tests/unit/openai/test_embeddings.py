"""One embeddings call as data-plane requests: the list tokenized once and run in parts of
like-length texts within the batch cap and the token budget, two an instance in flight, answers
put back in the order of the texts, usage summed, the first failure fails all. A real model
version runs them, its engine a stand-in that answers each text with its count of tokens."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer

from server.config import ModelConfig, load_model_config
from server.dataplane import DataPlane
from server.errors import DeadlineExceeded, EngineError
from server.model import ModelVersion
from server.openai.embeddings import chunk_size, embed
from server.preprocess import TextTokenizer
from server.scheduler.admission import Admission
from server.scheduler.chunking import chunks
from server.scheduler.request import RequestRecord
from server.stats import ModelStatistics
from tests.unit.cycles import server_objects_left_in_cycles
from tests.unit.test_chunked_requests import BUDGET, TokenCounting, engines
from tests.unit.test_warmup_buckets import WORDS, text_model, tokenizer_folder
from tests.unit.waiting import eventually

__all__ = ["engines", "tokenizer_folder"]  # the fixtures, used by name

ROOT = Path(__file__).resolve().parents[3]
MINILM = ROOT / "models" / "minilm"
PLANE = DataPlane(None)  # type: ignore[arg-type]  # start_call needs no repository for a model that serves


async def loaded(folder: Path, max_batch_size: int = 4, instances: int = 1, **batching: Any) -> ModelVersion:
    config = text_model(None, max_batch_size=max_batch_size, openai={"task": "embeddings"},
                        instance_group=[{"count": instances, "kind": "CPU"}],
                        **({"dynamic_batching": batching} if max_batch_size else {}))
    version = ModelVersion(ModelConfig.model_validate(config), 3, folder)
    await version.load()
    assert version.ready, version.reason
    return version


def texts(*word_counts: int) -> list[bytes]:
    """Texts of these many words: each text's tokens are 2 more ([CLS] and [SEP])."""
    return [" ".join(WORDS[:n]).encode() for n in word_counts]


def batches(engine: TokenCounting, warmed: int) -> list[tuple[int, int]]:
    """(rows, tokens a row) of each batch the engine ran after warm-up."""
    return [run["input_ids"] for run in engine.runs[warmed:]]  # type: ignore[misc]


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




def test_a_part_is_the_measured_batch_cap_within_max_batch_size() -> None:
    class Measured:
        config = ModelConfig.model_validate(text_model(None, max_batch_size=64))
        stats = ModelStatistics()

    model = Measured()
    assert chunk_size(model) == 64  # type: ignore[arg-type]  # not measured: the whole batch
    model.stats.batch_cap = 16
    assert chunk_size(model) == 16  # type: ignore[arg-type]


async def test_a_list_past_the_batch_cap_runs_in_parts_of_like_length_and_comes_back_in_order(
    engines: list[TokenCounting], tokenizer_folder: Path,
) -> None:
    version = await loaded(tokenizer_folder, max_batch_size=4)
    try:
        warmed = len(engines[0].runs)
        counts = (5, 1, 8, 3, 1, 7, 2, 4, 8, 6)
        record = RequestRecord()
        vectors = await embed(PLANE, version, texts(*counts), record, time.perf_counter_ns())
        np.testing.assert_array_equal(vectors[:, 0], [n + 2 for n in counts])
        assert vectors.shape == (10, 3)
        # Ordered by tokens, cut at the cap of 4: 3 3 4 5 | 6 7 8 9 | 10 10 (each part its own width).
        assert batches(engines[0], warmed) == [(4, 5), (4, 9), (2, 10)]
        assert record.tokens == sum(n + 2 for n in counts)
        assert version.stats.as_dict("text", 3)["inference_stats"]["success"]["count"] == 3  # a request a part
    finally:
        await version.unload()


async def test_a_list_within_the_cap_and_the_budget_is_one_request_with_no_task(
    engines: list[TokenCounting], tokenizer_folder: Path,
) -> None:
    version = await loaded(tokenizer_folder, max_batch_size=4, max_batch_tokens=BUDGET)
    try:
        warmed = len(engines[0].runs)
        column = np.array([[t] for t in texts(8, 8, 8)], dtype=object)  # 30 tokens; by their bytes, 48
        future = version.start_request({"text": ("BYTES", column)}, items_a_part=4)
        assert not isinstance(future, asyncio.Task)
        assert (await future)["embedding"][:, 0].tolist() == [10, 10, 10]
        assert batches(engines[0], warmed) == [(3, 10)]
    finally:
        await version.unload()


async def test_parts_hold_what_the_budget_allows_by_real_tokens(
    engines: list[TokenCounting], tokenizer_folder: Path,
) -> None:
    """Planned from bytes (a token a byte, at most max_length 16), these 8 texts went 2 a part,
    4 parts; their tokens (10 each) allow 4 a part within the budget of 40. On a GPU, whose cap
    is large, chunks by bytes ran 4-5x smaller batches of ordinary text than the budget allows."""
    version = await loaded(tokenizer_folder, max_batch_size=8, max_batch_tokens=BUDGET)
    try:
        warmed = len(engines[0].runs)
        vectors = await embed(PLANE, version, texts(*[8] * 8), RequestRecord())
        assert vectors[:, 0].tolist() == [10] * 8
        assert batches(engines[0], warmed) == [(4, 10), (4, 10)]
    finally:
        await version.unload()


async def test_a_long_list_has_two_parts_an_instance_in_flight_at_most(
    engines: list[TokenCounting], tokenizer_folder: Path,
) -> None:
    version = await loaded(tokenizer_folder, max_batch_size=2)
    try:
        TokenCounting.hold = True
        call = asyncio.ensure_future(embed(PLANE, version, texts(*[3] * 12), RequestRecord()))  # 6 parts
        await asyncio.to_thread(TokenCounting.running.wait, 10)
        await eventually(lambda: version.queue_depth == 1, "the second part waits in the queue")
        await asyncio.sleep(0.05)
        assert version.queue_depth == 1  # and no third
        TokenCounting.release.set()
        assert (await call)[:, 0].tolist() == [5] * 12
    finally:
        TokenCounting.release.set()
        await version.unload()


async def test_an_unload_waits_for_a_list_under_way(engines: list[TokenCounting], tokenizer_folder: Path) -> None:
    """Its parts not yet queued were refused with 503 once the version began to unload."""
    version = await loaded(tokenizer_folder, max_batch_size=2)
    TokenCounting.hold = True
    call = asyncio.ensure_future(embed(PLANE, version, texts(*[3] * 8), RequestRecord()))
    await asyncio.to_thread(TokenCounting.running.wait, 10)
    unloading = asyncio.ensure_future(version.unload())
    await asyncio.sleep(0.05)
    assert not unloading.done()
    TokenCounting.release.set()
    assert (await call)[:, 0].tolist() == [5] * 8
    await unloading


async def test_every_part_counts_its_deadline_from_the_calls_arrival(
    engines: list[TokenCounting], tokenizer_folder: Path,
) -> None:
    version = await loaded(tokenizer_folder, max_batch_size=2, default_queue_policy={"default_timeout_microseconds": 1_000_000})
    try:
        warmed = len(engines[0].runs)
        with pytest.raises(DeadlineExceeded):
            await embed(PLANE, version, texts(*[3] * 8), RequestRecord(), time.perf_counter_ns() - 2_000_000_000)
        assert batches(engines[0], warmed) == []
    finally:
        await version.unload()


def failing_on_nine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine fails any batch holding a text of 9 tokens (7 words)."""
    counting = TokenCounting.run

    def run(self: TokenCounting, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if (inputs["attention_mask"].sum(axis=1) == 9).any():
            raise EngineError("no kernel for nine")
        return counting(self, inputs)

    monkeypatch.setattr(TokenCounting, "run", run)


async def test_the_first_failure_fails_the_call_and_drops_the_parts_still_waiting(
    engines: list[TokenCounting], tokenizer_folder: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    version = await loaded(tokenizer_folder, max_batch_size=1)
    failing_on_nine(monkeypatch)
    try:
        warmed = len(engines[0].runs)
        with pytest.raises(EngineError, match="no kernel for nine"):
            await embed(PLANE, version, texts(7, 1, 1, 1, 8, 8, 8, 8), RequestRecord())  # the 9 runs fourth
        await asyncio.sleep(0.05)
        assert len(batches(engines[0], warmed)) < 8  # the parts after it never ran
    finally:
        await version.unload()


async def test_a_failed_call_leaves_nothing_in_reference_cycles(
    engines: list[TokenCounting], tokenizer_folder: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Else the call's texts, megabytes of them, live on until a full collection, which the
    server's tuned collector runs rarely: about 100 MB a failed call of 2,048 long texts."""
    version = await loaded(tokenizer_folder, max_batch_size=1)
    failing_on_nine(monkeypatch)

    async def failing_calls(count: int) -> None:
        for _ in range(count):
            try:
                await embed(PLANE, version, texts(7, 1, 1, 1), RequestRecord())
            except EngineError:
                pass
            await asyncio.sleep(0)

    try:
        found = await server_objects_left_in_cycles(failing_calls, 5, 50)
        assert not found, found
    finally:
        await version.unload()


async def test_a_model_that_does_not_batch_gets_one_text_a_call(
    engines: list[TokenCounting], tokenizer_folder: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    counting = TokenCounting.run
    monkeypatch.setattr(TokenCounting, "run", lambda self, inputs: {"embedding": counting(self, inputs)["embedding"][0]})
    version = await loaded(tokenizer_folder, max_batch_size=0)
    try:
        assert not version.splits_rows
        warmed = len(engines[0].runs)
        vectors = await embed(PLANE, version, texts(3, 1, 5), RequestRecord())
        assert vectors[:, 0].tolist() == [5, 3, 7]
        assert len(batches(engines[0], warmed)) == 3
    finally:
        await version.unload()
