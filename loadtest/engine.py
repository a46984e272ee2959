"""The engine alone, no server: items/s and latency per batch size ("the engine ceiling").

The server can never beat its engine, so this is the bar the HTTP numbers are read against.
  minilm: the texts `bench closed` sends (those of its --bodies request bodies, 32 by default)
          through an ONNX Runtime session on CPUExecutionProvider, graph optimisation "all",
          plus the `tokenizers` Tokenizer of tokenizer.json, truncation 256, padding to the
          batch's longest text (or, --length-sorted, batches of neighbouring lengths);
          tokenization is timed with the run. Its own session, since batch formation is what is
          measured. --in-flight N: the server's own path instead (each request tokenized as
          admission does, the server's pipeline and engine), on the batches the server's batcher
          forms when N clients send these texts (each batch size a cap).
  digits, mlp: the server's own engine for the folder's config (server/engines: torch in any
          precision, or an ONNX Runtime variant), called directly with the given threads.
A folder is read as the server reads it: its config.yaml, its highest version folder and the
config's model_filename (so built precision variants, loadtest/variants.py, load too).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loadtest import mlp, payloads
from loadtest.payloads import digits_images
from server.config import ModelConfig, load_model_config
from server.engines.base import Engine
from server.engines.registry import artifact_file
from server.engines.timing import time_runs
from server.layout import config_path, found_version_dir, version_numbers
from server.scheduler.batcher import LENGTH_WINDOW

MAX_RUNS_PER_BATCH = 100_000


@dataclass
class BatchResult:
    batch_size: int
    runs: int
    elapsed_s: float
    latencies_s: list[float]
    tokenize_s: list[float]
    extra: dict[str, Any] = field(default_factory=dict)
    items: int | None = None  # items the runs held, where batches are not all batch_size (None: they are)

    def as_dict(self) -> dict[str, Any]:
        ms = np.array(self.latencies_s) * 1000
        out: dict[str, Any] = {
            "batch_size": self.batch_size,
            "runs": self.runs,
            "elapsed_s": round(self.elapsed_s, 3),
            "items_s": round((self.batch_size * self.runs if self.items is None else self.items) / self.elapsed_s, 1),
            "latency_ms": {
                "p50": round(float(np.percentile(ms, 50)), 3),
                "p99": round(float(np.percentile(ms, 99)), 3),
                "min": round(float(ms.min()), 3),
            },
        }
        if self.tokenize_s:
            out["tokenize_ms_p50"] = round(float(np.median(self.tokenize_s)) * 1000, 3)
        return out | self.extra


ONNX_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
              "tensor(int64)": np.int64, "tensor(int32)": np.int32}


@dataclass(frozen=True)
class ModelFiles:
    """A model folder as the server reads it."""

    folder: Path
    config: ModelConfig
    version_dir: Path
    artifact: Path

    def find(self, filename: str) -> Path:
        """A file of the version folder; else of the build source's (a variant may share it)."""
        path = self.version_dir / filename
        if not path.is_file() and self.config.build is not None:
            fallback = model_files(self.folder.parent / self.config.build.source).version_dir / filename
            if fallback.is_file():
                return fallback
        return path


def model_files(folder: Path) -> ModelFiles:
    config = load_model_config(config_path(folder))
    versions = version_numbers(folder)
    if not versions:
        raise FileNotFoundError(f"{folder} holds no version folder; build it first")
    version = found_version_dir(folder, versions[-1])
    return ModelFiles(folder, config, version, artifact_file(config, version))


Runner = Callable[[int], float | None]  # runs batch number i; returns seconds spent tokenizing
# A runner may carry `extra`: figures about its inputs (e.g. padding) to put into the report.
Loader = Callable[[int], Runner]  # batch size -> runner; the model is loaded once per sweep


def _onnx_session(path: Path, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def minilm_loader(model_dir: Path, threads: int, length_sorted: bool = False, texts: list[str] | None = None) -> Loader:
    """Its own session and tokenizer on batches of `texts` (default: those `bench closed` sends)."""
    from tokenizers import Tokenizer

    files = model_files(model_dir)
    session = _onnx_session(files.artifact, threads)
    tokenize = files.config.tokenize
    if tokenize is None:
        raise ValueError(f"{model_dir} is not a text model (no preprocess.tokenize)")
    tokenizer = Tokenizer.from_file(str(files.find(tokenize.tokenizer)))
    tokenizer.enable_truncation(max_length=tokenize.max_length)
    tokenizer.enable_padding()
    types = {i.name: ONNX_TYPES.get(i.type, np.int64) for i in session.get_inputs()}
    feeds = set(types)

    # length_sorted: batches of neighbours in token length, the best a length-aware batcher can
    # form from this payload (the server's sequence buckets approach it).
    sent = payloads.texts_sent() if texts is None else texts
    lengths = {text: len(tokenizer.encode(text).ids) for text in sent}
    ordered = sorted(sent, key=lengths.__getitem__) if length_sorted else list(sent)

    def prepare(batch_size: int) -> Runner:
        batches = [[ordered[(b * batch_size + i) % len(ordered)] for i in range(batch_size)]
                   for b in range(len(ordered))]

        def run(index: int) -> float:
            start = time.perf_counter()
            encodings = tokenizer.encode_batch(batches[index % len(batches)])
            feed = {"input_ids": np.array([e.ids for e in encodings], dtype=types.get("input_ids", np.int64))}
            if "attention_mask" in feeds:
                feed["attention_mask"] = np.array([e.attention_mask for e in encodings], dtype=types["attention_mask"])
            if "token_type_ids" in feeds:
                feed["token_type_ids"] = np.array([e.type_ids for e in encodings], dtype=types["token_type_ids"])
            tokenized = time.perf_counter()
            session.run(None, feed)  # every output, as the server's engine runs them
            return tokenized - start

        run.extra = _padding(batches, lengths)  # type: ignore[attr-defined]
        return run

    return prepare


def served_text_loader(model_dir: Path, threads: int, texts: list[str], in_flight: int) -> Loader:
    """The server's own path for a text model, on the batches its batcher forms when `in_flight`
    clients send `texts` (in_flight_batches), each batch size a cap: each request tokenized alone,
    as admission tokenizes it, then the server's pipeline for the batch (token tensors padded to
    the batch's longest and merged, the server's engine for the config, outputs cut per request).
    What admission and an instance run, minus HTTP and the queue: the ceiling a served run at
    `in_flight` clients is read against."""
    from server.model import texts_by_length
    from server.preprocess import TextTokenizer
    from server.workers.pipeline import ModelPipeline, paddable_inputs

    files, config, engine = _server_engine(model_dir, threads)
    spec = config.tokenize
    if spec is None:
        raise ValueError(f"{model_dir} is not a text model (no preprocess.tokenize)")
    found = files.find(spec.tokenizer)  # in the version folder, or the build source's
    tokenizer = TextTokenizer(spec, found.parents[len(Path(spec.tokenizer).parts) - 1])
    pipeline = ModelPipeline(config, engine, paddable_inputs(config, tokenizer.outputs))
    lengths = {text: tokenizer.encode([text])[spec.input_ids].shape[1] for text in texts}
    bucket = spec.bucket if spec.sequence_buckets else None  # as admission keys a batch
    by_length = texts_by_length(config, [pipeline])  # as the model's queue orders them

    def prepare(batch_size: int) -> Runner:
        batches = in_flight_batches(texts, in_flight, batch_size, lengths.__getitem__, bucket, by_length)

        def run(index: int) -> float:
            start = time.perf_counter()
            feeds = [tokenizer.encode([text]) for text in batches[index % len(batches)]]
            tokenized = time.perf_counter()
            pipeline.run_batch(feeds)
            return tokenized - start

        run.extra = _padding(batches, lengths) | {  # type: ignore[attr-defined]
            "mean_batch": round(sum(map(len, batches)) / len(batches), 1)}
        run.batch_items = [len(batch) for batch in batches]  # type: ignore[attr-defined]
        return run

    return prepare


def in_flight_batches(
    texts: list[str], in_flight: int, batch_size: int, length: Callable[[str], int],
    bucket: Callable[[int], int] | None = None, by_length: bool = True,
) -> list[list[str]]:
    """The batches the server's batcher forms when `in_flight` clients each walk `texts` from a
    text of their own (client i from text i, as `bench closed`'s connections start), sending the
    next as soon as the last is answered: the oldest request waiting and, of the LENGTH_WINDOW x
    batch_size oldest of its length bucket (`bucket`; None: one for all), those nearest its
    length (the oldest first among equals; `by_length` off: in arrival order), up to
    `batch_size`; then their clients send again.
    len(texts) * in_flight // batch_size batches (at least one), the first once every client has sent."""
    if in_flight < 1 or batch_size < 1:
        raise ValueError("clients in flight and the batch size must be at least 1")
    if bucket is None:
        def bucket(_: int) -> int:
            return 0

    def text(request: tuple[int, int]) -> str:
        return texts[(request[0] + request[1]) % len(texts)]

    waiting = [(client, 0) for client in range(in_flight)]  # (client, its requests before), oldest first
    batches = []
    for _ in range(max(1, len(texts) * in_flight // batch_size)):
        oldest = length(text(waiting[0]))
        same = [i for i in range(1, len(waiting)) if bucket(length(text(waiting[i]))) == bucket(oldest)]
        if by_length:
            same = sorted(same[:LENGTH_WINDOW * batch_size], key=lambda i: abs(length(text(waiting[i])) - oldest))
        chosen = [0, *same[:batch_size - 1]]
        batches.append([text(waiting[i]) for i in chosen])
        taken = set(chosen)
        waiting = [w for i, w in enumerate(waiting) if i not in taken] + [(c, k + 1) for c, k in (waiting[i] for i in chosen)]
    return batches


def _padding(batches: list[list[str]], lengths: dict[str, int]) -> dict[str, float]:
    """Padding to a batch's longest text costs compute: how much of the batches' tokens it is."""
    real = sum(lengths[text] for batch in batches for text in batch)
    padded = sum(len(batch) * max(lengths[text] for text in batch) for batch in batches)
    return {"padding_share": round(1 - real / padded, 3), "tokens_per_batch": round(padded / len(batches), 1)}


def _batches(samples: np.ndarray, batch_size: int) -> list[np.ndarray]:
    return [np.ascontiguousarray(samples[(np.arange(batch_size) + b * batch_size) % len(samples)]) for b in range(8)]


def image_loader(model_dir: Path, threads: int, length_sorted: bool = False) -> Loader:
    """digits' held-out images through the server's own engine for the model."""
    return _server_engine_loader(model_dir, threads, digits_images(model_dir.parent))


def mlp_loader(model_dir: Path, threads: int, length_sorted: bool = False) -> Loader:
    """The MLP benchmark's inputs (loadtest/mlp.py) through the server's own engine for the model."""
    return _server_engine_loader(model_dir, threads, mlp.items(1024, 0))


def _server_engine(model_dir: Path, threads: int) -> tuple[ModelFiles, ModelConfig, Engine]:
    """The server's own engine for the model's config (torch, any precision, or ONNX Runtime),
    with `threads` threads, on the CPU."""
    from server.devices import Device
    from server.engines import create_engine
    from server.quantize.runner import with_threads

    files = model_files(model_dir)
    config = with_threads(files.config, threads)  # as a build's timing pins them
    return files, config, create_engine(config, files.version_dir, Device("CPU"))


def _server_engine_loader(model_dir: Path, threads: int, samples: np.ndarray) -> Loader:
    """The server's engine called directly: exactly what an instance runs, minus the server."""
    _, config, engine = _server_engine(model_dir, threads)
    name = config.inputs[0].source_name

    def prepare(batch_size: int) -> Runner:
        batches = _batches(samples, batch_size)

        def run(index: int) -> None:
            engine.run({name: batches[index % len(batches)]})

        return run

    return prepare


# (payload, engine) -> loader: which inputs to feed, and how the server's engine runs the artifact
LOADERS: dict[tuple[str, str], Callable[[Path, int, bool], Loader]] = {
    ("minilm", "onnxruntime"): minilm_loader,
    ("digits", "torch"): image_loader,
    ("digits", "onnxruntime"): image_loader,
    ("mlp", "onnxruntime"): mlp_loader,
}


def measure(run: Runner, batch_size: int, duration_s: float, max_runs: int = MAX_RUNS_PER_BATCH) -> BatchResult:
    """Warm up, then run back to back until `duration_s` or `max_runs`, whichever comes first
    (at least 5 runs, so a p99 exists even for slow batches)."""
    timed = time_runs(run, duration_s, max_runs=max_runs, keep=True)  # each run returns its tokenize seconds
    tokenize = [spent for spent in timed.returned if spent is not None]
    return BatchResult(batch_size, len(timed.latencies_s), timed.elapsed_s, timed.latencies_s, tokenize)


def sweep(
    model: str, repository: Path, batch_sizes: list[int], duration_s: float, threads: int, length_sorted: bool = False,
    folder: Path | None = None, in_flight: int | None = None, bodies: int = payloads.DEFAULT_BODIES,
) -> list[BatchResult]:
    """`model` names the payload (digits | minilm | mlp); `folder` the model folder to load (default:
    repository/model; a variant of it, e.g. repository/minilm-onnxruntime-int8, takes the same payload).
    minilm's texts are those of `bodies` request bodies, as `bench closed --bodies` sends them."""
    folder = folder or repository / model
    engine = model_files(folder).config.engine
    if in_flight is not None:
        if model != "minilm":
            raise ValueError("--in-flight groups texts by length: minilm only")
        prepare = served_text_loader(folder, threads, payloads.texts_sent(bodies), in_flight)
    elif (model, engine) not in LOADERS:
        known = ", ".join(f"{m} on {e}" for m, e in LOADERS)
        raise ValueError(f"no engine-alone loader for {model} on {engine}; known: {known}")
    elif model == "minilm":
        prepare = minilm_loader(folder, threads, length_sorted, payloads.texts_sent(bodies))
    else:
        prepare = LOADERS[(model, engine)](folder, threads, length_sorted)
    return run_sizes(prepare, batch_sizes, duration_s)


def run_sizes(prepare: Loader, batch_sizes: list[int], duration_s: float) -> list[BatchResult]:
    """`measure` each batch size's runner; where its batches are of their own sizes (at most the
    batch size: `batch_items`), the items its timed runs held."""
    results = []
    for size in batch_sizes:
        run = prepare(size)
        result = measure(run, size, duration_s)
        result.extra.update(getattr(run, "extra", {}))
        sizes = getattr(run, "batch_items", None)
        if sizes is not None:  # timed run i ran batch i (mod len), as time_runs numbers them
            result.items = sum(sizes[i % len(sizes)] for i in range(result.runs))
        results.append(result)
    return results
