"""Admission: a decoded request is checked against the model's declared inputs, turned into
engine-ready tensors and given its priority and deadline before it may queue, so a bad
request costs its sender a clear 400 and costs nobody else anything."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from server.config import ModelConfig
from server.errors import InvalidInput
from server.preprocess import TextTokenizer

# Requests with more text than this are tokenized on a worker thread, not the event loop.
INLINE_TOKENIZE_CHARS = 4096


@dataclass
class Admitted:
    feed: dict[str, np.ndarray]
    batch_size: int
    shape_key: Hashable
    longest: int
    priority: int
    deadline_ns: int | None


def validate_inputs(
    config: ModelConfig, inputs: dict[str, tuple[str, np.ndarray]]
) -> tuple[dict[str, np.ndarray], int]:
    """The inputs in config order and the request's batch size (1 for unbatched models)."""
    unknown = sorted(set(inputs) - {t.name for t in config.inputs})
    if unknown:
        expected = ", ".join(t.name for t in config.inputs)
        raise InvalidInput(f"unexpected input {unknown[0]!r} for model '{config.name}' (inputs: {expected})")
    text_input = config.tokenize.input if config.tokenize else None
    validated: dict[str, np.ndarray] = {}
    batch_sizes: set[int] = set()
    for tensor in config.inputs:
        if tensor.name not in inputs:
            raise InvalidInput(f"model '{config.name}' expects input '{tensor.name}', which is missing")
        datatype, array = inputs[tensor.name]
        if datatype != tensor.datatype:
            raise InvalidInput(
                f"input '{tensor.name}' has datatype {datatype}, model '{config.name}' expects {tensor.datatype}"
            )
        shape = list(array.shape)
        expected = config.api_shape(tensor)
        if len(shape) != len(expected) or any(e != -1 and e != s for e, s in zip(expected, shape)):
            raise InvalidInput(
                f"input '{tensor.name}' has shape {shape}, model '{config.name}' expects {expected}"
            )
        if config.batched:
            batch_sizes.add(shape[0])
        if tensor.name == text_input:
            array = _decoded_text(array, tensor.name)
        elif tensor.datatype == "BYTES":
            _check_text(array, tensor.name)
        validated[tensor.name] = array
    if len(batch_sizes) > 1:
        raise InvalidInput(f"inputs disagree on the batch size: {sorted(batch_sizes)}")
    batch_size = batch_sizes.pop() if batch_sizes else 1
    if config.batched and not 1 <= batch_size <= config.max_batch_size:
        raise InvalidInput(
            f"batch size {batch_size} is outside 1..{config.max_batch_size} (max_batch_size of '{config.name}');"
            " split the request"
        )
    return validated, batch_size


def _decoded_text(array: np.ndarray, name: str) -> np.ndarray:
    """UTF-8 check at the door, so one bad string cannot fail a whole batch later."""
    decoded = np.empty(array.shape, dtype=object)
    flat = decoded.reshape(-1)
    for i, item in enumerate(array.reshape(-1)):
        flat[i] = _text(item, name, i)
    return decoded


def _check_text(array: np.ndarray, name: str) -> None:
    """A BYTES input reaches an engine only as a string tensor (ONNX `tensor(string)`, as the
    load-time signature check ensures), which holds UTF-8 text: checked here, for the same reason
    as the text to tokenize. The items stay bytes, as every engine receives BYTES."""
    for i, item in enumerate(array.reshape(-1)):
        _text(item, name, i)


def _text(item: object, name: str, index: int) -> str:
    try:
        return item.decode() if isinstance(item, bytes) else str(item)
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"input '{name}' item {index} is not valid UTF-8") from exc


class Admission:
    """Turns one model's validated requests into what its batcher queues."""

    def __init__(self, config: ModelConfig, tokenizer: TextTokenizer | None) -> None:
        self._config = config
        self._tokenizer = tokenizer
        self._text_input = config.tokenize.input if config.tokenize else None
        self._bucketed = bool(config.tokenize and config.tokenize.sequence_buckets)
        self._padded = {t.name for t in config.inputs if t.pad_value is not None}
        batching = config.dynamic_batching
        self._levels = batching.levels if batching else 1
        self._default_level = batching.default_level if batching else 1
        policy = batching.default_queue_policy if batching else None
        self._default_timeout_us = policy.default_timeout_microseconds if policy else 0
        self._timeout_override = policy.allow_timeout_override if policy else True

    async def admit(self, inputs: dict[str, tuple[str, np.ndarray]], parameters: dict[str, Any]) -> Admitted:
        priority, deadline_ns = self._options(parameters)
        arrays, batch_size = validate_inputs(self._config, inputs)
        texts = self._texts(arrays)
        if texts is not None and sum(len(t) for t in texts) > INLINE_TOKENIZE_CHARS:
            tokens = await asyncio.to_thread(self._tokenizer.encode, texts)
        else:
            tokens = self._tokenizer.encode(texts) if texts is not None else None
        return self._admitted(arrays, batch_size, tokens, priority, deadline_ns)

    def admit_now(self, inputs: dict[str, np.ndarray], batch_size: int) -> Admitted:
        """Synchronous admission of already validated inputs (warm-up and profiling)."""
        texts = self._texts(inputs)
        tokens = self._tokenizer.encode(texts) if texts is not None else None
        return self._admitted(inputs, batch_size, tokens, self._default_level, None)

    def _texts(self, arrays: dict[str, np.ndarray]) -> list[str] | None:
        if self._text_input is None:
            return None
        return list(arrays[self._text_input].reshape(-1))  # decoded to str at validation

    def _admitted(
        self,
        arrays: dict[str, np.ndarray],
        batch_size: int,
        tokens: dict[str, np.ndarray] | None,
        priority: int,
        deadline_ns: int | None,
    ) -> Admitted:
        feed: dict[str, np.ndarray] = {}
        key: list[tuple[str, tuple[int, ...]]] = []
        for tensor in self._config.inputs:
            if tensor.name == self._text_input:
                assert tokens is not None
                feed.update(tokens)
                continue
            array = arrays[tensor.name]
            feed[tensor.source_name] = array
            if tensor.name not in self._padded:
                key.append((tensor.name, array.shape[1:] if self._config.batched else array.shape))
        longest = 0
        if tokens:
            assert self._config.tokenize is not None
            longest = self._config.tokenize.bucket(next(iter(tokens.values())).shape[1])
            if self._bucketed:  # only texts of the same length bucket share a batch
                key.append(("sequence", (longest,)))
        return Admitted(feed, batch_size, tuple(key), longest, priority, deadline_ns)

    def _options(self, parameters: dict[str, Any]) -> tuple[int, int | None]:
        """Priority level and deadline from the request's `priority` and `timeout` (microseconds)."""
        priority = parameters.get("priority", 0)
        if type(priority) is not int or not 0 <= priority <= self._levels:
            raise InvalidInput(f"'priority' must be an integer within 0..{self._levels} (0: the model's default)")
        timeout_us = self._default_timeout_us
        requested = parameters.get("timeout")
        if requested is not None:
            if type(requested) is not int or requested < 0:
                raise InvalidInput("'timeout' must be a non-negative integer of microseconds")
            if self._timeout_override and requested:
                timeout_us = requested
        deadline_ns = time.perf_counter_ns() + timeout_us * 1000 if timeout_us else None
        return priority or self._default_level, deadline_ns
