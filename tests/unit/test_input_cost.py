"""What a request costs before it is refused: the cheap checks (batch size, element counts,
bytes per item) come before any per-element work (building tensors, UTF-8, tokenizing), and
the per-element work of a large request runs off the event loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import orjson
import pytest

from server.config import ModelConfig
from server.dataplane import DataPlane
from server.errors import InvalidInput
from server.http import v2_infer
from server.protocol import v2
from server.protocol.v2 import parse_request
from server.scheduler import admission
from server.scheduler.admission import INLINE_ITEMS, INLINE_TEXT_BYTES, Admission
from tests.unit.admitting import admit

TEXT_MODEL = ModelConfig.model_validate(
    {
        "name": "embed",
        "engine": "onnxruntime",
        "max_batch_size": 4,
        "max_item_bytes": 1000,
        "inputs": [{"name": "text", "datatype": "BYTES", "dims": [1]}],
        "outputs": [{"name": "embedding", "datatype": "FP32", "dims": [2]}],
        "preprocess": {"tokenize": {"input": "text"}},
    }
)


class SpyTokenizer:
    """Stands in for TextTokenizer: records each call and the thread it ran on."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def encode(self, texts: list[str]) -> dict[str, np.ndarray]:
        self.threads.append(threading.current_thread().name)
        ids = np.ones((len(texts), 3), dtype=np.int64)
        return {"input_ids": ids, "attention_mask": ids, "token_type_ids": ids * 0}


def texts(*items: bytes) -> dict[str, tuple[str, np.ndarray]]:
    array = np.empty((len(items), 1), dtype=object)
    array[:, 0] = list(items)
    return {"text": ("BYTES", array)}


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The thread of every UTF-8 decode of a text item at admission."""
    threads: list[str] = []
    real = admission._text

    def spy(item: object, name: str, index: int) -> str:
        threads.append(threading.current_thread().name)
        return real(item, name, index)

    monkeypatch.setattr(admission, "_text", spy)
    return threads


async def test_too_many_items_are_refused_before_decoding_or_tokenizing(decoded: list[str]) -> None:
    tokenizer = SpyTokenizer()
    with pytest.raises(InvalidInput, match="batch size 5 is outside 1..4"):
        await admit(Admission(TEXT_MODEL, tokenizer), texts(*[b"hello"] * 5), {})  # type: ignore[arg-type]
    assert tokenizer.threads == [] and decoded == []


async def test_an_item_over_max_item_bytes_is_refused_before_decoding_or_tokenizing(decoded: list[str]) -> None:
    tokenizer = SpyTokenizer()
    with pytest.raises(InvalidInput, match="item 1 is 1001 bytes, over the model's max_item_bytes of 1000"):
        await admit(Admission(TEXT_MODEL, tokenizer), texts(b"ok", b"x" * 1001), {})  # type: ignore[arg-type]
    assert tokenizer.threads == [] and decoded == []


def test_max_item_bytes_has_a_default() -> None:
    config = TEXT_MODEL.model_copy(update={"max_item_bytes": ModelConfig.model_fields["max_item_bytes"].default})
    assert config.max_item_bytes == 64 << 10


async def test_large_text_is_decoded_and_tokenized_off_the_event_loop(decoded: list[str]) -> None:
    tokenizer = SpyTokenizer()
    item = b"w" * (INLINE_TEXT_BYTES // 2 + 1)
    model = Admission(TEXT_MODEL.model_copy(update={"max_item_bytes": 1 << 20}), tokenizer)  # type: ignore[arg-type]
    await admit(model, texts(b"small"), {})
    main = threading.main_thread().name
    assert tokenizer.threads == [main] and decoded == [main]
    await admit(model, texts(item, item), {})
    assert tokenizer.threads[1] != main and decoded[1:] and main not in decoded[1:]


async def test_many_bytes_items_are_checked_off_the_event_loop(decoded: list[str]) -> None:
    config = ModelConfig.model_validate(
        {
            "name": "strings",
            "engine": "onnxruntime",
            "max_batch_size": 4,
            "inputs": [{"name": "s", "datatype": "BYTES", "dims": [-1]}],
            "outputs": [{"name": "y", "datatype": "FP32", "dims": [1]}],
        }
    )
    array = np.empty((1, INLINE_ITEMS + 1), dtype=object)
    array.fill(b"a")
    await admit(Admission(config, None), {"s": ("BYTES", array)}, {})
    main = threading.main_thread().name
    assert len(decoded) == INLINE_ITEMS + 1 and main not in decoded


def test_flat_data_of_the_wrong_length_is_refused_without_building_a_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []
    monkeypatch.setattr(v2, "json_tensor", lambda *args: built.append(args[3]))
    body = orjson.dumps({"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [0.0] * 100_000}]})
    with pytest.raises(InvalidInput, match=r"shape \[1, 3\] needs 3 elements, data has 100000"):
        parse_request(body)
    assert built == []


class Stats:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def count_failure(self, reason: str) -> None:
        self.failures.append(reason)


class Model:
    config = TEXT_MODEL
    version = 1
    ready = True
    every_output = tuple((t.name, t.datatype) for t in TEXT_MODEL.outputs)
    queue_depth = 0

    def __init__(self) -> None:
        self.stats = Stats()
        self.calls = 0

    def start_request(
        self, inputs: Any, parameters: Any, record: Any = None, received_ns: Any = None,
        checked_batch_size: Any = None, items_a_part: Any = None,
    ) -> asyncio.Future[dict[str, np.ndarray]]:
        self.calls += 1
        answered: asyncio.Future[dict[str, np.ndarray]] = asyncio.get_running_loop().create_future()
        answered.set_result({"embedding": np.zeros((1, 2), np.float32)})
        return answered


class Repository:
    def __init__(self) -> None:
        self.model = Model()

    def get(self, name: str, version: str | None = None) -> Model:
        return self.model


async def test_a_v2_call_checks_shapes_before_building_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[object] = []
    monkeypatch.setattr(v2_infer, "build_tensors", lambda parsed: built.append(parsed))
    repository = Repository()
    plane = DataPlane(repository)  # type: ignore[arg-type]
    body = orjson.dumps({"inputs": [{"name": "text", "shape": [5, 1], "datatype": "BYTES", "data": ["a"] * 5}]})
    with pytest.raises(InvalidInput, match="batch size 5"):
        await v2_infer.infer_v2(plane, "embed", None, body, None)
    assert built == [] and repository.model.calls == 0
    assert repository.model.stats.failures == ["invalid"]
