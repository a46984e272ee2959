"""Admission: a decoded request is checked against the model's declared inputs before it may
queue, so a bad request costs its sender a clear 400 and costs nobody else anything."""

from __future__ import annotations

import numpy as np

from server.config import ModelConfig
from server.errors import InvalidInput


def validate_inputs(
    config: ModelConfig, inputs: dict[str, tuple[str, np.ndarray]]
) -> tuple[dict[str, np.ndarray], int]:
    """The inputs in config order and the request's batch size (1 for unbatched models)."""
    unknown = sorted(set(inputs) - {t.name for t in config.inputs})
    if unknown:
        expected = ", ".join(t.name for t in config.inputs)
        raise InvalidInput(f"unexpected input {unknown[0]!r} for model '{config.name}' (inputs: {expected})")
    text_input = config.preprocess.tokenize.input if config.preprocess and config.preprocess.tokenize else None
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
        validated[tensor.name] = _decoded_text(array, tensor.name) if tensor.name == text_input else array
    if len(batch_sizes) > 1:
        raise InvalidInput(f"inputs disagree on the batch size: {sorted(batch_sizes)}")
    batch_size = batch_sizes.pop() if batch_sizes else 1
    if config.batched and not 1 <= batch_size <= config.max_batch_size:
        raise InvalidInput(
            f"batch size {batch_size} is outside 1..{config.max_batch_size} (max_batch_size of '{config.name}')"
        )
    return validated, batch_size


def _decoded_text(array: np.ndarray, name: str) -> np.ndarray:
    """UTF-8 check at the door, so one bad string cannot fail a whole batch later."""
    decoded = np.empty(array.shape, dtype=object)
    flat = decoded.reshape(-1)
    for i, item in enumerate(array.reshape(-1)):
        try:
            flat[i] = item.decode() if isinstance(item, bytes) else str(item)
        except UnicodeDecodeError as exc:
            raise InvalidInput(f"input '{name}' item {i} is not valid UTF-8") from exc
    return decoded
