"""Admission: a decoded request is checked against the model's declared inputs, turned into
engine-ready tensors and given its priority and deadline before it may queue, so a bad
request costs its sender a clear 400 and costs nobody else anything."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from server.config import ModelConfig
from server.errors import InvalidInput
from server.preprocess import TextTokenizer
from server.scheduler.chunking import chunks, tokens_at_most

# The request parameters admission reads; the only ones a front end passes on to the server
# process (a client's own parameters, nested or large as they may be, are not read here).
REQUEST_OPTIONS = ("priority", "timeout")
# Text of more bytes than this (UTF-8 check, tokenizing), or more BYTES items than
# INLINE_ITEMS, is prepared on a worker thread, not the event loop: ~0.5 ms at most inline.
INLINE_TEXT_BYTES = 4096
INLINE_ITEMS = 256


@dataclass
class Admitted:
    feed: dict[str, np.ndarray]
    batch_size: int
    shape_key: Hashable
    longest: int  # the sequence bucket of its longest text (0: not a text model)
    length: int  # its longest text in tokens (0: not a text model)
    priority: int
    deadline_ns: int | None
    padded: tuple[tuple[int, ...], ...] = ()  # each padded input's dims past the batch dim (the padding bound's)


@dataclass(frozen=True)
class _Declared:
    """A model's inputs as check_declared compares them, built once per config: the hot path
    then allocates nothing per input but the loop."""

    names: frozenset[str]
    inputs: tuple[tuple[str, str, list[int], tuple[tuple[int, int], ...]], ...]  # name, datatype, shape, fixed dims


_plans: dict[int, tuple[ModelConfig, _Declared]] = {}


def _declared_plan(config: ModelConfig) -> _Declared:
    cached = _plans.get(id(config))
    if cached is not None and cached[0] is config:
        return cached[1]
    inputs = []
    for tensor in config.inputs:
        shape = config.api_shape(tensor)
        inputs.append((tensor.name, tensor.datatype, shape, tuple((i, d) for i, d in enumerate(shape) if d != -1)))
    plan = _Declared(frozenset(t.name for t in config.inputs), tuple(inputs))
    if len(_plans) > 256:  # configs of unloaded models: never many, never kept for long
        _plans.clear()
    _plans[id(config)] = (config, plan)
    return plan


def check_declared(config: ModelConfig, declared: dict[str, tuple[str, list[int]]]) -> int:
    """The request's batch size (1 for unbatched models), from names, datatypes and shapes alone:
    every check here costs the same for one item as for a million, so it runs before any."""
    plan = _declared_plan(config)
    if not plan.names.issuperset(declared):
        unknown = sorted(set(declared) - plan.names)
        known = ", ".join(t.name for t in config.inputs)
        raise InvalidInput(f"unexpected input {unknown[0]!r} for model '{config.name}' (inputs: {known})")
    batch_size = -1
    batched = config.batched
    for name, datatype, expected, fixed in plan.inputs:
        given = declared.get(name)
        if given is None:
            raise InvalidInput(f"model '{config.name}' expects input '{name}', which is missing")
        if given[0] != datatype:
            raise InvalidInput(f"input '{name}' has datatype {given[0]}, model '{config.name}' expects {datatype}")
        shape = given[1]
        if len(shape) != len(expected):
            raise InvalidInput(f"input '{name}' has shape {list(shape)}, model '{config.name}' expects {expected}")
        for i, dim in fixed:  # a loop, not any() over a generator: every call comes here
            if shape[i] != dim:
                raise InvalidInput(f"input '{name}' has shape {list(shape)}, model '{config.name}' expects {expected}")
        if batched:
            if batch_size != -1 and shape[0] != batch_size:
                sizes = sorted({declared[n][1][0] for n, *_ in plan.inputs})
                raise InvalidInput(f"inputs disagree on the batch size: {sizes}")
            batch_size = shape[0]
    if not batched:
        return 1
    if not 1 <= batch_size <= config.max_batch_size:
        raise InvalidInput(
            f"batch size {batch_size} is outside 1..{config.max_batch_size} (max_batch_size of '{config.name}');"
            " split the request"
        )
    return batch_size


def validate_inputs(
    config: ModelConfig, inputs: dict[str, tuple[str, np.ndarray]]
) -> tuple[dict[str, np.ndarray], int]:
    """The inputs in config order and the request's batch size (1 for unbatched models)."""
    batch_size = _checked(config, inputs)
    check_item_bytes(config, inputs)
    return _texts_decoded(config, inputs), batch_size


def _checked(config: ModelConfig, inputs: dict[str, tuple[str, np.ndarray]]) -> int:
    return check_declared(config, {name: (datatype, list(array.shape)) for name, (datatype, array) in inputs.items()})


def bytes_items(config: ModelConfig, inputs: dict[str, tuple[str, np.ndarray]]) -> int:
    """How many BYTES items the request holds, without looking at one (sizes of arrays)."""
    return sum(inputs[t.name][1].size for t in config.inputs if t.datatype == "BYTES")


def check_item_bytes(config: ModelConfig, inputs: dict[str, tuple[str, np.ndarray]]) -> int:
    """Refuse a BYTES item over max_item_bytes before it is decoded or tokenized; the total of
    the items' bytes (one len() each, no decoding)."""
    limit = config.max_item_bytes
    total = 0
    for tensor in config.inputs:
        if tensor.datatype != "BYTES":
            continue
        for i, item in enumerate(inputs[tensor.name][1].reshape(-1)):
            size = len(item)
            if size > limit:
                raise InvalidInput(
                    f"input '{tensor.name}' item {i} is {size} bytes, over the model's max_item_bytes of {limit}"
                )
            total += size
    return total


def _texts_decoded(config: ModelConfig, inputs: dict[str, tuple[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The inputs in config order, the text to tokenize decoded to str and other BYTES checked
    as UTF-8: per-item work, after every cheap check."""
    text_input = config.tokenize.input if config.tokenize else None
    validated: dict[str, np.ndarray] = {}
    for tensor in config.inputs:
        array = inputs[tensor.name][1]
        if tensor.name == text_input:
            array = _decoded_text(array, tensor.name)
        elif tensor.datatype == "BYTES":
            _check_text(array, tensor.name)
        validated[tensor.name] = array
    return validated


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
        self._padded_in_order = [t.name for t in config.inputs if t.pad_value is not None]  # the padding bound's
        self._numbers_only = all(t.datatype != "BYTES" for t in config.inputs)  # nothing to decode or tokenize
        self._batched = config.batched
        # Each input in config order: its name, the engine's name for it, whether it keys the batch
        # (a padded input joins a batch of any length).
        self._feeds = [(t.name, t.source_name, t.name not in self._padded) for t in config.inputs]
        batching = config.dynamic_batching
        self._levels = batching.levels if batching else 1
        self._default_level = batching.default_level if batching else 1
        policy = batching.default_queue_policy if batching else None
        self._default_timeout_us = policy.default_timeout_microseconds if policy else 0
        self._timeout_override = policy.allow_timeout_override if policy else True
        # A request of more texts than its model's token budget can take at their longest is cut
        # into chunks (server/scheduler/chunking.py): for a batching text model with a budget
        # whose outputs have fixed dims (chunks of other lengths would not join back).
        budget = batching.max_batch_tokens if batching else None
        fixed = all(d >= 0 for t in config.outputs for d in t.dims)
        text = next((t for t in config.inputs if config.tokenize and t.name == config.tokenize.input), None)
        one_a_row = text is not None and list(text.dims) == [1]  # a row's text is its item
        in_order = bool(batching and batching.preserve_ordering)  # a request's later chunks would queue behind others
        self._budget = budget if one_a_row and config.batched and budget and fixed and not in_order else None
        self._most_a_text = config.tokenize.bucket(config.tokenize.max_length) if config.tokenize else 0

    def chunked(
        self, inputs: dict[str, tuple[str, np.ndarray]], parameters: dict[str, Any], received_ns: int | None = None,
        checked_batch_size: int | None = None,
    ) -> list[list[int]] | None:
        """The rows of a request whose texts may pass the model's token budget, in chunks within
        it (the batcher runs a request whole, however long); None for a request within it, most
        of them told by their batch size alone. Refuses (400) what the cheap checks refuse, once
        for the request, not once a chunk."""
        budget, tokenize = self._budget, self._config.tokenize
        text = inputs.get(tokenize.input) if budget is not None and tokenize is not None else None
        if budget is None or tokenize is None or text is None:
            return None  # (no text input: admission says so)
        rows = len(text[1]) if checked_batch_size is None else checked_batch_size  # checked once it counts
        if rows * self._most_a_text <= budget:
            return None
        batch_size = _checked(self._config, inputs) if checked_batch_size is None else checked_batch_size
        self._options(parameters, received_ns)
        check_item_bytes(self._config, inputs)
        texts = inputs[tokenize.input][1].reshape(-1)
        plan = chunks([tokens_at_most(text, tokenize) for text in texts], batch_size, budget)
        return plan if len(plan) > 1 else None

    def admit_or_offload(
        self, inputs: dict[str, tuple[str, np.ndarray]], parameters: dict[str, Any], received_ns: int | None = None,
        checked_batch_size: int | None = None,
    ) -> Admitted | Callable[[], Admitted]:
        """Cheap checks first (options, shapes, batch size, bytes per item), then the per-item
        work (UTF-8, tokenizing): done here when small, so most requests are admitted without a
        task or a suspension of their own; else that work, for the caller to run on a worker
        thread. A `timeout` counts from `received_ns` (when the front end took the request in;
        None: now). `checked_batch_size`: what check_declared found for these inputs' shapes
        (None: check)."""
        priority, deadline_ns = self._options(parameters, received_ns)
        batch_size = _checked(self._config, inputs) if checked_batch_size is None else checked_batch_size
        if self._numbers_only:  # no per-item work: admitted here
            arrays = {name: inputs[name][1] for name, _, _ in self._feeds}
            return self._admitted(arrays, batch_size, None, priority, deadline_ns)
        if bytes_items(self._config, inputs) > INLINE_ITEMS:
            return functools.partial(self._prepared, inputs, batch_size, priority, deadline_ns, True)
        if check_item_bytes(self._config, inputs) > INLINE_TEXT_BYTES:
            return functools.partial(self._prepared, inputs, batch_size, priority, deadline_ns, False)
        return self._prepared(inputs, batch_size, priority, deadline_ns, False)

    def _prepared(
        self,
        inputs: dict[str, tuple[str, np.ndarray]],
        batch_size: int,
        priority: int,
        deadline_ns: int | None,
        check_bytes: bool,
    ) -> Admitted:
        """Decode and tokenize checked inputs (pure: safe on a worker thread)."""
        if check_bytes:
            check_item_bytes(self._config, inputs)
        arrays = _texts_decoded(self._config, inputs)
        texts = self._texts(arrays)
        tokens = self._tokenizer.encode(texts) if texts is not None and self._tokenizer is not None else None
        return self._admitted(arrays, batch_size, tokens, priority, deadline_ns)

    def admit_now(self, inputs: dict[str, np.ndarray], batch_size: int) -> Admitted:
        """Synchronous admission of already validated inputs (warm-up and profiling)."""
        texts = self._texts(inputs)
        tokens = self._tokenizer.encode(texts) if texts is not None and self._tokenizer is not None else None
        return self._admitted(inputs, batch_size, tokens, self._default_level, None)

    def tokens_in(self, feed: dict[str, np.ndarray]) -> int:
        """The tokens an admitted text request holds, padding left out (0 for other models):
        counted from the tokenizer's own tensors, so the text is never tokenized twice."""
        spec = self._config.tokenize
        if spec is None or spec.input_ids not in feed:
            return 0
        if spec.attention_mask and spec.attention_mask in feed:
            return int(feed[spec.attention_mask].sum())
        return int(np.count_nonzero(feed[spec.input_ids] != spec.pad_id))

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
        for name, source_name, keys in self._feeds:
            if name == self._text_input:
                assert tokens is not None
                feed.update(tokens)
                continue
            array = arrays[name]
            feed[source_name] = array
            if keys:
                key.append((name, array.shape[1:] if self._batched else array.shape))
        longest = length = 0
        if tokens:
            assert self._config.tokenize is not None
            length = next(iter(tokens.values())).shape[1]
            longest = self._config.tokenize.bucket(length)
            if self._bucketed:  # only texts of the same length bucket share a batch
                key.append(("sequence", (longest,)))
        padded = tuple(arrays[name].shape[1:] for name in self._padded_in_order) if self._padded_in_order else ()
        return Admitted(feed, batch_size, tuple(key), longest, length, priority, deadline_ns, padded)

    def _options(self, parameters: dict[str, Any], received_ns: int | None) -> tuple[int, int | None]:
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
        if not timeout_us:
            return priority or self._default_level, None
        deadline_ns = (received_ns or time.perf_counter_ns()) + timeout_us * 1000
        return priority or self._default_level, deadline_ns
