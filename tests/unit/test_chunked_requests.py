"""A request of more texts than its model's token budget takes at their longest runs as chunks
within it: the batcher runs a request whole, and one of 64 texts of about 1 KB (8x minilm's
budget) held its only instance, and every other caller, for about 3.5 s on one core."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import server.model
from server.config import ModelConfig
from server.devices import Device
from server.engines.base import Engine
from server.errors import InvalidInput
from server.model import ModelVersion
from server.preprocess import TextTokenizer
from server.scheduler.admission import Admission
from server.scheduler.request import RequestRecord
from tests.unit.test_warmup_buckets import WORDS, RecordingEngine, text_model, tokenizer_folder
from tests.unit.waiting import eventually

__all__ = ["tokenizer_folder"]  # the fixture, used by name

BUDGET = 40  # tokens a batch: 2 texts of max_length 16 at most, by their bytes


class TokenCounting(RecordingEngine):
    """Answers each row with its count of tokens (its attention mask's sum): each answer says
    which text it came from. While `hold` is set, a batch waits for `release` (`running` says
    one does)."""

    hold = False
    running = threading.Event()
    release = threading.Event()

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if TokenCounting.hold:
            TokenCounting.running.set()
            assert TokenCounting.release.wait(30), "the test never released the batch"
        super().run(inputs)
        mask = next(array for name, array in inputs.items() if "mask" in name)
        counts = mask.sum(axis=1).astype(np.float32)
        return {"embedding": np.repeat(counts[:, None], 3, axis=1)}


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[TokenCounting]]:
    created: list[TokenCounting] = []
    TokenCounting.hold = False
    TokenCounting.running, TokenCounting.release = threading.Event(), threading.Event()

    def create(config: ModelConfig, version_dir: Path, device: Device) -> Engine:
        created.append(TokenCounting(config, version_dir, device))
        return created[-1]

    monkeypatch.setattr(server.model, "create_engine", create)
    yield created
    TokenCounting.release.set()


async def loaded(folder: Path, **batching: Any) -> ModelVersion:
    config = text_model(None, max_batch_size=8, dynamic_batching={"max_batch_tokens": BUDGET, **batching})
    version = ModelVersion(ModelConfig.model_validate(config), 1, folder)
    await version.load()
    assert version.ready, version.reason
    return version


@contextlib.asynccontextmanager
async def serving(folder: Path, **batching: Any) -> AsyncIterator[ModelVersion]:
    """`loaded`, and unloaded at the end, the test's outcome whatever it is."""
    version = await loaded(folder, **batching)
    try:
        yield version
    finally:
        await version.unload()


def texts(*word_counts: int) -> tuple[str, np.ndarray]:
    array = np.empty((len(word_counts), 1), dtype=object)
    array[:, 0] = [" ".join(WORDS[:n]).encode() for n in word_counts]
    return "BYTES", array


async def test_a_request_over_the_budget_runs_in_chunks_answered_in_its_order(
    engines: list[TokenCounting], tokenizer_folder: Path,
) -> None:
    async with serving(tokenizer_folder) as version:
        warmed = len(engines[0].runs)
        counts = (8, 1, 5, 8, 2, 7, 3, 6)  # words: each text's tokens are 2 more
        record = RequestRecord()
        outputs = await version.start_request({"text": texts(*counts)}, {}, record)
        assert outputs["embedding"][:, 0].tolist() == [n + 2 for n in counts]
        batches = engines[0].runs[warmed:]
        assert len(batches) > 1
        assert all(run["input_ids"][0] * run["input_ids"][1] <= BUDGET for run in batches), batches
        assert record.tokens == sum(n + 2 for n in counts)


async def test_chunks_are_cut_by_the_texts_tokens_not_their_bytes(
    engines: list[TokenCounting], tokenizer_folder: Path,
) -> None:
    """Eight texts of 10 tokens and about 50 bytes: planned from their bytes (a token a byte, at
    most max_length 16) they went 2 a chunk, 4 chunks; by their tokens, 4 a chunk. Ordinary
    text has a token per four or five bytes, so chunks by bytes ran 4-5x smaller batches."""
    async with serving(tokenizer_folder) as version:
        warmed = len(engines[0].runs)
        outputs = await version.start_request({"text": texts(*[8] * 8)}, {})
        assert outputs["embedding"][:, 0].tolist() == [10] * 8
        assert [run["input_ids"] for run in engines[0].runs[warmed:]] == [(4, 10), (4, 10)]
        fits = version.start_request({"text": texts(3, 3, 3)}, {})  # 3 x 16 by their bytes; 3 x 5 tokens
        assert not isinstance(fits, asyncio.Task) and not version._chunked  # one request, no task
        assert (await fits)["embedding"][:, 0].tolist() == [5, 5, 5]


async def test_a_request_tokenized_off_the_loop_is_cut_and_answered_in_its_order(
    engines: list[TokenCounting], tokenizer_folder: Path,
) -> None:
    """Texts of more than 4 KiB in all are tokenized on a worker thread, then cut."""
    async with serving(tokenizer_folder) as version:
        warmed = len(engines[0].runs)
        _, array = texts(*[3] * 8)
        array[::2, 0] = [b"batchline " * 80] * 4  # 800 bytes each: 16 tokens at most
        outputs = await version.start_request({"text": ("BYTES", array)}, {})
        assert outputs["embedding"][:, 0].tolist() == [16, 5] * 4
        batches = [run["input_ids"] for run in engines[0].runs[warmed:]]
        assert sorted(batches) == [(2, 16), (2, 16), (4, 5)]


async def test_a_request_within_the_budget_runs_whole(engines: list[TokenCounting], tokenizer_folder: Path) -> None:
    async with serving(tokenizer_folder) as version:
        warmed = len(engines[0].runs)
        outputs = await version.start_request({"text": texts(1, 1)}, {})  # 2 texts of 16 tokens at most: 32
        assert outputs["embedding"][:, 0].tolist() == [3, 3]
        assert len(engines[0].runs) == warmed + 1 and not version._chunked


async def held(version: ModelVersion, engines: list[TokenCounting]) -> asyncio.Future[dict[str, np.ndarray]]:
    """A request of 8 long texts (4 chunks) whose first chunk runs, held, and whose second waits
    in the queue behind it."""
    TokenCounting.hold = True
    future = version.start_request({"text": texts(*[8] * 8)}, {})
    await asyncio.to_thread(TokenCounting.running.wait, 10)
    await eventually(lambda: version.queue_depth == 1, "the second chunk waits in the queue")
    return future


async def test_a_chunked_request_withdrawn_drops_its_chunks_still_queued(
    engines: list[TokenCounting], tokenizer_folder: Path,
) -> None:
    async with serving(tokenizer_folder) as version:
        warmed = len(engines[0].runs)
        future = await held(version, engines)
        assert version.withdraw(future)
        with pytest.raises(asyncio.CancelledError):
            await future
        TokenCounting.release.set()
        await eventually(lambda: not version._chunked and version.queue_depth == 0, "the chunks are gone")
        await asyncio.sleep(0.05)
        assert len(engines[0].runs) == warmed + 1  # the one computing ran out; no other chunk ran


async def test_a_chunked_request_is_answered_whole_through_an_unload(
    engines: list[TokenCounting], tokenizer_folder: Path,
) -> None:
    """Its later chunks are queued while the version unloads (an unload, a reload's too, waits
    for the request): it was answered 503 after some of its chunks had run."""
    version = await loaded(tokenizer_folder)
    future = await held(version, engines)
    unloading = asyncio.ensure_future(version.unload())
    await asyncio.sleep(0.05)
    assert not unloading.done()
    TokenCounting.release.set()
    outputs = await future
    assert outputs["embedding"][:, 0].tolist() == [10] * 8
    await unloading


async def test_a_chunked_requests_options_are_refused_once(engines: list[TokenCounting], tokenizer_folder: Path) -> None:
    async with serving(tokenizer_folder) as version:
        with pytest.raises(InvalidInput, match="priority"):
            version.start_request({"text": texts(*[8] * 8)}, {"priority": 9})
        assert version.stats.failures["invalid"] == 1 and not version._chunked


def test_without_an_attention_mask_a_part_keeps_the_requests_width(tokenizer_folder: Path) -> None:
    """Nothing else says where a row's padding begins: a real token may share the pad's id (here
    [SEP]), and a part cut to its rows' count of other ids would lose it."""
    config = ModelConfig.model_validate(text_model(
        None, max_batch_size=8, dynamic_batching={"max_batch_tokens": BUDGET},
        preprocess={"tokenize": {"input": "text", "max_length": 16, "attention_mask": None, "pad_id": 3}}))
    assert config.tokenize is not None
    admission = Admission(config, TextTokenizer(config.tokenize, tokenizer_folder))
    _, array = texts(1, 8, 1, 1, 8, 1)
    whole = admission.admit_now({"text": np.vectorize(bytes.decode, otypes=[object])(array)}, 6)
    parts = admission.split(whole)
    assert parts is not None
    assert [part.feed["input_ids"].shape for _, part in parts] == [(4, 10), (2, 10)]  # the whole width, 10
    assert all(part.feed["input_ids"][:, -1].tolist().count(3) >= 1 for _, part in parts)  # [SEP] kept
