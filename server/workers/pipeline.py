"""What an instance runs for a batch: merge the requests, run the engine, split the results.

Requests arrive as engine-ready feeds. Merging concatenates them along the batch dim; tensors
declared paddable (token tensors, inputs with a pad_value) are padded to the batch's longest,
and a model with batch buckets gets the batch padded up to one of them (the sizes a compiled
engine was built for). Token tensors go up to their sequence bucket for an engine compiled per
shape (`Engine.compiles_per_shape`) and for a model of one bucket (one fixed length); other
engines run the batch's own length: a bucket's padding is compute they would spend for nothing
(a text of 17 tokens padded to 32 costs about twice).
Outputs are renamed to the names clients know, cast to the declared datatype, and cut back per
request.

A batch of large inputs (an image model's: 75 MB for 124 ResNet images) is merged into an array
the instance keeps and reuses (`MergeBuffers`): a new array that large is new memory from the
system each time (past glibc's 32 MiB mmap threshold), and its pages cost a fault each on first
touch, which made merging 1.7x as slow as copying into memory already mapped, on the instance's
thread, between one batch and the next.
"""

from __future__ import annotations

import time
from itertools import accumulate, pairwise

import numpy as np

from server.config import ModelConfig
from server.engines.base import Engine
from server.engines.signature import check_results
from server.engines.spec import EngineIO
from server.errors import EngineError
from server.protocol.datatypes import numpy_dtype
from server.workers.result import BatchResult


def paddable_inputs(config: ModelConfig, token_pads: dict[str, int]) -> dict[str, float]:
    """Engine tensor name -> pad value, for every tensor a batch may pad."""
    pads: dict[str, float] = {name: value for name, value in token_pads.items()}
    for tensor in config.inputs:
        if tensor.pad_value is not None:
            pads[tensor.source_name] = tensor.pad_value
    return pads


# A merged input at least this large goes into the instance's reused buffer: glibc maps an
# allocation this large afresh each time (its mmap threshold rises with use, to 32 MiB at most),
# while smaller ones come from its free lists at no page cost (loadtest/merging.py: the same time
# either way up to 18 MiB of images, 1.7x as long new from 37 MiB).
REUSE_MIN_BYTES = 32 << 20


class MergeBuffers:
    """One reused byte buffer per input, grown to the largest merge seen (at least doubling), of
    which each large merge takes a view. One instance's thread uses it, one batch at a time: a
    merge is overwritten by the next batch's, so the engine's outputs that share its memory are
    copied out before the batch is answered (`settled`)."""

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}

    def array(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        buffer = self._buffers.get(name)
        if buffer is None or buffer.nbytes < nbytes:
            size = nbytes if buffer is None else max(nbytes, 2 * buffer.nbytes)
            buffer = self._buffers[name] = np.empty(size, dtype=np.uint8)
        return buffer[:nbytes].view(dtype).reshape(shape)

    def settled(self, array: np.ndarray) -> np.ndarray:
        """`array`, copied if it may share memory with a buffer (an engine that hands back its
        input, or a view of it, as an output)."""
        if any(np.may_share_memory(array, b) for b in self._buffers.values()):
            return array.copy()
        return array

    @property
    def held(self) -> bool:
        return bool(self._buffers)


class ModelPipeline:
    def __init__(self, config: ModelConfig, engine: Engine, pads: dict[str, float],
                 reuse_min_bytes: int = REUSE_MIN_BYTES) -> None:
        self.engine = engine
        self._merges = MergeBuffers()
        self._reuse_min_bytes = reuse_min_bytes
        self._io = EngineIO.from_config(config)
        self._batched = config.batched
        self._pads = pads
        # Token tensors padded up to their sequence bucket: the shapes a compiled engine was
        # prepared for, or the one length a single bucket declares (the artifact's sequence dim
        # may be fixed to it: server/engines/signature.py); any other engine takes the batch's
        # longest text as it is.
        buckets = (config.tokenize.sequence_buckets or []) if config.tokenize else []
        self._pad_to_bucket = bool(buckets) and (engine.compiles_per_shape or len(buckets) == 1)
        self._tokenize = config.tokenize
        self._buckets = config.batch_buckets or []
        self._outputs = [(t.name, t.source_name, numpy_dtype(t.datatype)) for t in config.outputs]
        self._model = config.name

    @property
    def pads_to_bucket(self) -> bool:
        """Whether token tensors go up to their sequence bucket (then a batch of texts costs
        the same whatever lengths it holds within the bucket)."""
        return self._pad_to_bucket

    @property
    def batched(self) -> bool:
        """Whether feeds carry a leading batch dim (so a batch can be cut into smaller ones)."""
        return self._batched

    def run_batch(self, feeds: list[dict[str, np.ndarray]], *, verify: bool = False) -> BatchResult:
        """Run the requests' feeds as one batch. `verify` (warm-up) checks the engine's own
        outputs against the declared ones before they are cast, since an artifact's static
        signature may leave dims or ranks open."""
        start = time.perf_counter_ns()
        sizes = [len(next(iter(f.values()))) for f in feeds] if self._batched else [1]
        merged = self._merge(feeds, sum(sizes)) if self._batched else feeds[0]
        infer_start = time.perf_counter_ns()
        results = self.engine.run(merged)
        output_start = time.perf_counter_ns()
        rows = len(next(iter(merged.values()))) if self._batched else None
        if verify:
            check_results(self._io, results, rows)
        outputs = {}
        for name, source, dtype in self._outputs:
            array = results[source]
            if self._merges.held and array.dtype == dtype:  # a cast copies anyway
                array = self._merges.settled(array)
            if rows is not None and (array.ndim == 0 or len(array) != rows):
                # cut back per request, it would hand one client another's rows, or none
                raise EngineError(f"model '{self._model}' returned output '{name}' of shape {list(array.shape)} "
                                  f"for a batch of {rows} items: a batching model's outputs carry the batch as "
                                  f"their first dim")
            outputs[name] = array if array.dtype == dtype else array.astype(dtype)
        per_request = split(outputs, sizes) if self._batched else [outputs]
        end = time.perf_counter_ns()
        return BatchResult(per_request, infer_start - start, output_start - infer_start, end - output_start)

    def _merge(self, feeds: list[dict[str, np.ndarray]], total: int) -> dict[str, np.ndarray]:
        rows = self._bucket(total)
        merged = {}
        for name in feeds[0]:
            parts = [f[name] for f in feeds]
            if name in self._pads:
                merged[name] = self._padded(parts, self._pads[name], rows)
            elif len(parts) == 1 and len(parts[0]) == rows:
                merged[name] = parts[0]
            else:
                merged[name] = self._concatenated(name, parts, rows)
        return merged

    def _concatenated(self, name: str, parts: list[np.ndarray], rows: int) -> np.ndarray:
        """The parts one after the other (or one part short of its bucket), then copies of the
        last row up to `rows`: into the instance's reused buffer when that is large (see the
        module's docstring)."""
        first = parts[0]
        item = first.shape[1:]
        small = first.dtype.itemsize * rows * int(np.prod(item, dtype=np.int64)) < self._reuse_min_bytes
        # BYTES items are pointers (a byte buffer cannot be viewed as them); parts that differ are
        # numpy's to refuse, or to promote, as before
        if small or first.dtype.hasobject or any(p.shape[1:] != item or p.dtype != first.dtype for p in parts):
            return _fill_rows(first if len(parts) == 1 else np.concatenate(parts), rows)
        out = self._merges.array(name, (rows, *item), first.dtype)
        total = sum(len(p) for p in parts)
        np.concatenate(parts, out=out[:total])
        if total < rows:
            out[total:] = out[total - 1]
        return out

    def _bucket(self, items: int) -> int:
        return next((b for b in self._buckets if b >= items), items)

    def _padded(self, parts: list[np.ndarray], value: float, rows: int) -> np.ndarray:
        """Pad every variable dim to the longest of the batch (to its sequence bucket where the
        engine needs bucket shapes: see __init__)."""
        shape = [max(p.shape[d] for p in parts) for d in range(1, parts[0].ndim)]
        if shape and self._pad_to_bucket:
            assert self._tokenize is not None
            shape[0] = self._tokenize.bucket(shape[0])
        if len(parts) == 1 and list(parts[0].shape[1:]) == shape:
            return _fill_rows(parts[0], rows)
        out = np.full((rows, *shape), value, dtype=parts[0].dtype)
        offset = 0
        for part in parts:
            out[(slice(offset, offset + len(part)), *(slice(0, n) for n in part.shape[1:]))] = part
            offset += len(part)
        if offset < rows:  # bucket rows: copies of a real row, so the engine sees valid data
            out[offset:] = out[offset - 1]
        return out


def _fill_rows(array: np.ndarray, rows: int) -> np.ndarray:
    if len(array) >= rows:
        return array
    return np.concatenate([array, np.repeat(array[-1:], rows - len(array), axis=0)])


def split(outputs: dict[str, np.ndarray], sizes: list[int]) -> list[dict[str, np.ndarray]]:
    """Cut the batch's outputs back into one dict per request (views, no copies); rows past
    the requests' total (bucket padding) are dropped. Requests of one item each (the common
    case) get their rows by iterating a view, in C: np.split took a microsecond a request."""
    if len(sizes) == 1:
        return [{name: array[: sizes[0]] for name, array in outputs.items()}]
    names = list(outputs)
    if all(size == 1 for size in sizes):
        count = len(sizes)
        columns = [list(outputs[name][:count, np.newaxis]) for name in names]
    else:
        bounds = list(pairwise(accumulate(sizes, initial=0)))
        columns = [[array[start:stop] for start, stop in bounds] for array in outputs.values()]
    if len(names) == 1:
        name = names[0]
        return [{name: rows} for rows in columns[0]]
    return [dict(zip(names, rows, strict=True)) for rows in zip(*columns, strict=True)]
