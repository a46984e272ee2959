"""What one instance runs for a batch: pre-processing, the engine, and the mapping of names.

Clients speak the config's tensor names; the engine may call its tensors otherwise
(`engine_name`), and text models take strings that are tokenized here, over the whole batch,
on the instance's thread rather than the event loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from server.config import ModelConfig, Tokenize
from server.engines.base import Engine
from server.errors import EngineError
from server.protocol.datatypes import numpy_dtype


class TextTokenizer:
    """Batched tokenization with truncation, padded to the longest text of the batch."""

    def __init__(self, spec: Tokenize, version_dir: Path) -> None:
        path = version_dir / spec.tokenizer
        if not path.is_file():
            raise EngineError(f"tokenizer file {path} is missing")
        self._tokenizer = Tokenizer.from_file(str(path))
        self._tokenizer.enable_truncation(max_length=spec.max_length)
        self._tokenizer.enable_padding()
        self._spec = spec

    def __call__(self, texts: list[str]) -> dict[str, np.ndarray]:
        encodings = self._tokenizer.encode_batch(texts)
        tensors = {self._spec.input_ids: np.array([e.ids for e in encodings], dtype=np.int64)}
        if self._spec.attention_mask:
            tensors[self._spec.attention_mask] = np.array(
                [e.attention_mask for e in encodings], dtype=np.int64
            )
        if self._spec.token_type_ids:
            tensors[self._spec.token_type_ids] = np.array([e.type_ids for e in encodings], dtype=np.int64)
        return tensors


@dataclass
class StageTimes:
    """Nanoseconds spent per stage of one batch, as Triton's statistics name them."""

    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0


class ModelPipeline:
    def __init__(self, config: ModelConfig, engine: Engine, version_dir: Path) -> None:
        self.engine = engine
        self._inputs = [(t.name, t.source_name) for t in config.inputs]
        self._outputs = [(t.name, t.source_name, numpy_dtype(t.datatype)) for t in config.outputs]
        tokenize = config.preprocess.tokenize if config.preprocess else None
        self._text_input = tokenize.input if tokenize else None
        self._tokenizer = TextTokenizer(tokenize, version_dir) if tokenize else None

    def run(self, inputs: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], StageTimes]:
        """Run one batch given by API tensor names; return outputs by API names."""
        times = StageTimes()
        start = time.perf_counter_ns()
        feed: dict[str, np.ndarray] = {}
        for name, source in self._inputs:
            if name == self._text_input:
                feed.update(self._tokenizer([str(t) for t in inputs[name].reshape(-1)]))
            else:
                feed[source] = inputs[name]
        infer_start = time.perf_counter_ns()
        times.compute_input_ns = infer_start - start
        results = self.engine.run(feed)
        output_start = time.perf_counter_ns()
        times.compute_infer_ns = output_start - infer_start
        outputs = {}
        for name, source, dtype in self._outputs:
            array = results[source]
            outputs[name] = array if array.dtype == dtype else array.astype(dtype)
        times.compute_output_ns = time.perf_counter_ns() - output_start
        return outputs, times
