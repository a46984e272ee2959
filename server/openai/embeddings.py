"""One embeddings call as data-plane requests.

A list of texts goes as one call that the model runs in parts of up to its batch cap each:
per-text requests would batch too, but a list of 2048 would take 2048 places in a queue bounded
at a few hundred (429 for the rest) and pay admission 2048 times, while one part per cap fills a
batch by itself. The model tokenizes the list once, orders its texts by tokens (as
sentence-transformers orders by length), so a part holds texts of like length, padded to its
own longest, and keeps each part within its `max_batch_tokens`; parts go two an instance at a
time and share the model's queue with v2 requests (server/scheduler/chunking.py). A model that
does not batch gets one text a call, two an instance in flight.
"""

from __future__ import annotations

import numpy as np

from server.dataplane import DataPlane, Output
from server.model import ModelVersion
from server.scheduler.chunking import gathered, in_flight
from server.scheduler.request import RequestRecord


def chunk_size(model: ModelVersion) -> int:
    """Items a part: the batch cap warm-up measured (where a bigger batch stops paying),
    within max_batch_size; 1 for a model that does not batch."""
    config = model.config
    if not config.batched:
        return 1
    cap = model.stats.batch_cap or config.max_batch_size
    return max(1, min(cap, config.max_batch_size))


async def embed(
    plane: DataPlane, model: ModelVersion, texts: list[bytes], record: RequestRecord, received_ns: int | None = None
) -> np.ndarray:
    """The vectors of `texts`, in their order; `record` gets the tokens read and the longest
    queue and compute times of the parts. The first failure fails the call, and the parts
    still waiting are cancelled (dropped before compute). Every part's deadline counts from
    the call's arrival (`received_ns`)."""
    config = model.config
    output = config.embedding_output()
    assert config.tokenize is not None and output is not None
    text_input = config.tokenize.input
    if model.splits_rows:
        column = np.empty((len(texts), 1), dtype=object)
        column[:, 0] = texts
        # No local holds the call: a failure's traceback holds this frame, and the call's future
        # holds the failure (a cycle, and the texts in it until a rare full collection).
        ((_, _, vectors),) = await plane.start_call(model, {text_input: ("BYTES", column)}, {}, [output.name],
                                                     record, received_ns, items_a_part=chunk_size(model)).answer()
        return vectors.reshape(len(texts), -1)

    async def run(_: int, part: list[int], part_record: RequestRecord) -> list[Output]:
        (index,) = part
        tensor = np.empty((1, 1) if config.batched else (1,), dtype=object)
        tensor.reshape(-1)[0] = texts[index]
        return await plane.start_call(model, {text_input: ("BYTES", tensor)}, {}, [output.name], part_record,
                                      received_ns).answer()

    answers = await gathered([[i] for i in range(len(texts))], run, in_flight(len(model.instances)), record)
    return np.concatenate([outputs[0][2].reshape(1, -1) for outputs in answers])
