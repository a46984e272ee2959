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
from server.scheduler.chunking import chunks

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


def check_declared(
    config: ModelConfig, declared: dict[str, tuple[str, list[int]]], most_rows: int | None = None,
) -> int:
    """The request's batch size (1 for unbatched models), from names, datatypes and shapes alone:
    every check here costs the same for one item as for a million, so it runs before any.
    `most_rows`: the bound on the batch size (None: max_batch_size)."""
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
    most = config.max_batch_size if most_rows is None else most_rows
    if not 1 <= batch_size <= most:
        why = f" (max_batch_size of '{config.name}'); split the request" if most_rows is None else ""
        raise InvalidInput(f"batch size {batch_size} is outside 1..{most}{why}")
    return batch_size


def validate_inputs(
    config: ModelConfig, inputs: dict[str, tuple[str, np.ndarray]]
) -> tuple[dict[str, np.ndarray], int]:
    """The inputs in config order and the request's batch size (1 for unbatched models)."""
    batch_size = _checked(config, inputs)
    check_item_bytes(config, inputs)
    return _texts_decoded(config, inputs), batch_size


def _checked(config: ModelConfig, inputs: dict[str, tuple[str, np.ndarray]], most_rows: int | None = None) -> int:
    declared = {name: (datatype, list(array.shape)) for name, (datatype, array) in inputs.items()}
    return check_declared(config, declared, most_rows)


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
        # into chunks by its texts' tokens, once they are tokenized (server/scheduler/chunking.py):
        # a batching text model of one text a row, whose outputs have fixed dims (chunks of other
        # lengths would not join back; the config refuses others for padded batching anyway),
        # may be; with a budget, and not preserve_ordering (a request's later chunks would queue
        # behind others), its requests over the budget are.
        budget = batching.max_batch_tokens if batching else None
        fixed = all(d >= 0 for t in config.outputs for d in t.dims)
        text = next((t for t in config.inputs if config.tokenize and t.name == config.tokenize.input), None)
        one_a_row = text is not None and list(text.dims) == [1]  # a row's text is its item
        in_order = bool(batching and batching.preserve_ordering)
        self.splittable = one_a_row and config.batched and fixed
        self._budget = budget if self.splittable and budget and not in_order else None
        self._most_a_text = config.tokenize.bucket(config.tokenize.max_length) if config.tokenize else 0

    def rows_of_list(self, inputs: dict[str, tuple[str, np.ndarray]]) -> int:
        """The rows of a list a front end takes whole (OpenAI's embeddings input, up to 2048
        texts), its inputs checked as any request's but for max_batch_size: it runs in parts."""
        return _checked(self._config, inputs, most_rows=1 << 31)  # (the front end bounds them)

    def may_pass_budget(self, inputs: dict[str, tuple[str, np.ndarray]], checked_batch_size: int | None) -> bool:
        """Whether a request's texts could pass the model's token budget at their longest, told
        by its rows alone (most requests are not: they are admitted as they are); one that
        could is tokenized whole, then cut by its texts' tokens (`split`)."""
        tokenize = self._config.tokenize
        if self._budget is None or tokenize is None:
            return False
        text = inputs.get(tokenize.input)
        if text is None:
            return False  # (admission says so)
        rows = len(text[1]) if checked_batch_size is None else checked_batch_size  # checked once it counts
        return rows * self._most_a_text > self._budget

    def split(self, admitted: Admitted, items: int | None = None) -> list[tuple[list[int], Admitted]] | None:
        """An admitted text request cut into parts by its texts' tokens: ordered by length (so a
        part holds texts of like length, padded to its own longest), each of at most `items`
        rows (None: any) and, with a budget, within it; each part's rows and what it queues.
        None when it goes whole (no cut needed, or a model it cannot be cut for)."""
        spec = self._config.tokenize
        if not self.splittable or spec is None or (items is None and self._budget is None):
            return None
        lengths = self._lengths(admitted.feed)
        plan = chunks([spec.bucket(n) for n in lengths], items or admitted.batch_size, self._budget)
        if len(plan) < 2:
            return None
        return [(rows, self._part(admitted, rows, max(1, *(lengths[r] for r in rows)))) for rows in plan]

    def _lengths(self, feed: dict[str, np.ndarray]) -> list[int]:
        """Each row's tokens up to its padding (on the right): its attention mask's sum. A model
        without a mask gets the request's width for every row: a real token may share the pad's
        id ([SEP], for one), so nothing else says where a row's padding begins."""
        spec = self._config.tokenize
        assert spec is not None
        if spec.attention_mask and spec.attention_mask in feed:
            return feed[spec.attention_mask].sum(axis=1).tolist()  # type: ignore[no-any-return]
        ids = feed[spec.input_ids]
        return [ids.shape[1]] * len(ids)

    def _part(self, admitted: Admitted, rows: list[int], length: int) -> Admitted:
        """The rows of an admitted request, its token tensors cut to their own longest (the
        tokenizer pads on the right)."""
        spec = self._config.tokenize
        assert spec is not None and self._tokenizer is not None
        tokens = self._tokenizer.outputs
        index = np.asarray(rows)
        feed = {name: np.ascontiguousarray(array[index, :length]) if name in tokens else array[index]
                for name, array in admitted.feed.items()}
        longest = spec.bucket(length)
        key = admitted.shape_key
        if self._bucketed:  # its sequence bucket, the key's last entry, is its own
            key = (*key[:-1], ("sequence", (longest,)))  # type: ignore[index]
        return Admitted(feed, len(rows), key, longest, length, admitted.priority, admitted.deadline_ns, admitted.padded)

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
