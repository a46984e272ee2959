"""A request of many texts cut into chunks within its model's token budget (max_batch_tokens).

A batch is cut to the budget only between requests: the batcher always runs the request at its
head whole. One request of 64 texts at 256 tokens (8x minilm's budget) ran alone for 6-8 s on one
core, and held every other caller's text behind it for that long. So such a request runs as
chunks, ordered by length first (as sentence-transformers does, so a chunk holds texts of like
length and little padding), each within the budget; OpenAI's /v1 cuts its lists the same way.
"""

from __future__ import annotations

from server.config import Tokenize


def tokens_at_most(text: bytes, tokenize: Tokenize) -> int:
    """What a text counts at most toward a batch's token budget: a token a byte, with the two
    special tokens a sentence takes (BERT's, and most others'), truncated to `max_length`, and
    padded to its sequence bucket, as the batcher counts it. Ordinary text takes a token per
    four or five bytes, so its chunks hold fewer texts than the budget would; two such chunks in
    the queue share a batch up to it."""
    return tokenize.bucket(min(len(text) + 2, tokenize.max_length))


def chunks(sizes: list[int], size: int, max_tokens: int | None = None) -> list[list[int]]:
    """Indexes of the texts, ordered by `sizes` (their tokens at most; stable), cut into runs of
    at most `size` texts and, with `max_tokens`, of at most that many tokens padded to the run's
    longest (a run of one text goes whatever its tokens)."""
    order = sorted(range(len(sizes)), key=sizes.__getitem__)
    if max_tokens is None:
        return [order[start:start + size] for start in range(0, len(order), size)]
    plan: list[list[int]] = []
    run: list[int] = []
    for index in order:  # each text is the run's longest yet: the order is by length
        if run and (len(run) >= size or (len(run) + 1) * sizes[index] > max_tokens):
            plan.append(run)
            run = []
        run.append(index)
    if run:
        plan.append(run)
    return plan
