"""One embeddings call as data-plane requests.

A list of texts goes as multi-item requests of up to the model's batch cap each: per-text
requests would batch too, but a list of 2048 would take 2048 places in a queue bounded at a few
hundred (429 for the rest) and pay admission 2048 times, while one request per cap-sized chunk
fills a batch by itself and takes one place. The texts are ordered by length first (as
sentence-transformers does), so a chunk holds texts of like length: a chunk is padded to its
longest text, and sorting keeps that padding small. A model with `max_batch_tokens` also gets
chunks within it, their tokens told from their bytes before they are tokenized (as a v2 request
over the budget is cut: server/scheduler/chunking.py); one within the budget runs for what a
batch may cost.

The chunks go concurrently, up to two per instance at a time: enough for every instance to run
one while the next waits formed behind it (a chunk fills a batch, so more in the queue would
batch no better), and few enough that one long list neither fills the model's queue nor keeps
other callers' requests waiting behind all of it. Every chunk shares the model's queue, so
batches take in v2 requests as well, and the other way round.
"""

from __future__ import annotations

import numpy as np

from server.dataplane import DataPlane, Output
from server.model import ModelVersion
from server.scheduler.chunking import chunks, gathered, in_flight, tokens_at_most
from server.scheduler.request import RequestRecord


def chunk_size(model: ModelVersion) -> int:
    """Items per request: the batch cap warm-up measured (where a bigger batch stops paying),
    within max_batch_size; 1 for a model that does not batch."""
    config = model.config
    if not config.batched:
        return 1
    cap = model.stats.batch_cap or config.max_batch_size
    return max(1, min(cap, config.max_batch_size))


async def embed(
    plane: DataPlane, model: ModelVersion, texts: list[bytes], record: RequestRecord, received_ns: int | None = None
) -> np.ndarray:
    """The vectors of `texts`, in their order; `record` gets the tokens read, the version, and
    the longest queue and compute times of the chunks. The first failure fails the call, and
    the chunks still waiting are cancelled (dropped before compute)."""
    config = model.config
    output = config.embedding_output()
    assert config.tokenize is not None and output is not None
    batching = config.dynamic_batching
    plan = chunks([tokens_at_most(t, config.tokenize) for t in texts], chunk_size(model),
                  batching.max_batch_tokens if batching is not None else None)
    text_input = config.tokenize.input

    async def run(_: int, part: list[int], part_record: RequestRecord) -> list[Output]:
        tensor = _tensor(texts, part, config.batched)
        return await plane.start_call(model, {text_input: ("BYTES", tensor)}, {}, [output.name], part_record,
                                      received_ns).answer()  # every chunk's deadline counts from the call's arrival

    answers = await gathered(plan, run, in_flight(len(model.instances)), record)
    vectors = np.empty((len(texts), output.dims[0]), dtype=np.float32)
    for part, outputs in zip(plan, answers, strict=True):
        vectors[part] = outputs[0][2].reshape(len(part), -1)
    record.model_version = model.version
    return vectors


def _tensor(texts: list[bytes], part: list[int], batched: bool) -> np.ndarray:
    """The BYTES input of one chunk: [n, 1] for a batching model, [1] for one that does not."""
    array = np.empty((len(part), 1) if batched else (1,), dtype=object)
    array.reshape(-1)[:] = [texts[i] for i in part]
    return array
