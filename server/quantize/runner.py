"""Run one model version exactly as the server would: the same engine class, the same tokenizer.

Evaluating a build through the serving engine (not a hand-made session) means the gate measures
what will actually answer requests, including the torch engine's precision cast.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from server.config import ModelConfig
from server.devices import Device
from server.engines import create_engine
from server.engines.registry import ENGINES
from server.preprocess import TextTokenizer
from server.protocol.datatypes import numpy_dtype
from server.quantize.data import EmbeddingData, EvalData, TensorData
from server.quantize.progress import Track, untracked


def with_threads(config: ModelConfig, threads: int) -> ModelConfig:
    """The config with its engine pinned to `threads` threads, as `--engine-threads` pins it
    when serving: a build is timed as it will serve."""
    return ENGINES[config.engine].with_threads(config, threads)


def build_device(engine: str, device: str) -> Device:
    """Where a build runs: GPU 0 for `gpu` and for TensorRT plans (they run on GPUs only), else the CPU."""
    return Device("GPU", 0) if device == "gpu" or ENGINES[engine].gpu_only else Device("CPU")


class Runner:
    """One engine instance on the build's device plus the model's tokenizer, if it has one."""

    def __init__(self, config: ModelConfig, version_dir: Path, device: str = "cpu") -> None:
        self.config = config
        self.device = build_device(config.engine, device)
        self.engine = create_engine(config, version_dir, self.device)
        self.tokenizer = TextTokenizer(config.tokenize, version_dir) if config.tokenize else None
        self.output = config.outputs[0].source_name
        # what clients would send: an FP16-input build (keep_io_types: false) gets FP16 arrays
        self._input_dtypes = {t.source_name: numpy_dtype(t.datatype) for t in config.inputs if t.datatype != "BYTES"}
        self._source_names = {t.name: t.source_name for t in config.inputs}

    def close(self) -> None:
        self.engine.close()

    def run(self, feed: dict[str, np.ndarray], output: str | None = None) -> np.ndarray:
        """One batch through the engine; the output named (API name; default the first) as float32."""
        tensor = self.config.output(output) if output is not None else None
        name = tensor.source_name if tensor is not None else self.output
        return np.asarray(self.engine.run(feed)[name], dtype=np.float32)

    def feed(self, data: EvalData, batch: int, sequence_length: int | None = None) -> dict[str, np.ndarray]:
        """A benchmark batch of `batch` items drawn (cycled) from the evaluation data."""
        if isinstance(data, TensorData):
            index = np.arange(batch) % data.count
            return self.items({name: array[index] for name, array in data.inputs.items()}, sequence_length)
        texts = [data.sentences[i % len(data.sentences)] for i in range(batch)]
        return self._tokens(texts, sequence_length)

    def items(self, arrays: dict[str, np.ndarray], sequence_length: int | None = None) -> dict[str, np.ndarray]:
        """The engine's feed for items given as the model's inputs (API names): numbers typed as
        the config says, the text of a tokenizing model tokenized."""
        if self.tokenizer is not None:
            assert self.config.tokenize is not None
            texts = [t.decode("utf-8", "replace") if isinstance(t, bytes) else str(t)
                     for t in np.asarray(arrays[self.config.tokenize.input]).reshape(-1)]
            return self._tokens(texts, sequence_length)
        return self._typed({self._source_names[name]: np.ascontiguousarray(array) for name, array in arrays.items()})

    def outputs(self, data: EvalData, texts: list[str] | None = None, batch: int = 16,
                track: Track = untracked, description: str = "evaluating") -> np.ndarray:
        """The judged output for every evaluation item (or `texts`), in order."""
        if isinstance(data, TensorData):
            if not self.config.batched:  # one item at a time, without a batch axis
                return np.stack([self.run(self.items({n: a[i] for n, a in data.inputs.items()}), data.output)
                                 for i in track(range(data.count), description)])
            step = min(batch if self.tokenizer is not None else 64, self.config.max_batch_size)
            parts = [self.run(self.items({n: a[i : i + step] for n, a in data.inputs.items()}), data.output)
                     for i in track(range(0, data.count, step), description)]
            return np.concatenate(parts)
        items = texts if texts is not None else data.sentences
        order = sorted(range(len(items)), key=lambda i: len(items[i]))  # like lengths share a batch
        result = np.empty((len(items), self.config.outputs[0].dims[-1]), dtype=np.float32)
        for start in track(range(0, len(order), batch), description):
            chosen = order[start : start + batch]
            result[chosen] = self.run(self._tokens([items[i] for i in chosen]))
        return result

    def _typed(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: v.astype(self._input_dtypes[k], copy=False) if k in self._input_dtypes else v for k, v in feed.items()}

    def _tokens(self, texts: list[str], sequence_length: int | None = None) -> dict[str, np.ndarray]:
        assert self.tokenizer is not None, "a text model needs preprocess.tokenize"
        tensors = self.tokenizer.encode(texts)
        if sequence_length is None:
            return tensors
        pads = self.tokenizer.outputs
        fixed = {}
        for name, array in tensors.items():
            array = array[:, :sequence_length]
            if array.shape[1] < sequence_length:
                pad = np.full((array.shape[0], sequence_length - array.shape[1]), pads[name], array.dtype)
                array = np.concatenate([array, pad], axis=1)
            fixed[name] = np.ascontiguousarray(array)
        return fixed


def evaluate(config: ModelConfig, version_dir: Path, data: EvalData, track: Track = untracked,
             label: str = "", device: str = "cpu") -> dict[str, np.ndarray]:
    """Every output the quality gate needs from one model version."""
    runner = Runner(config, version_dir, device)
    try:
        if isinstance(data, EmbeddingData):
            return {
                "sentences": runner.outputs(data, track=track, description=f"{label}sentences"),
                "triplets": runner.outputs(data, data.triplet_texts, track=track, description=f"{label}triplets"),
            }
        return {"output": runner.outputs(data, track=track, description=f"{label}held-out items")}
    finally:
        runner.close()
