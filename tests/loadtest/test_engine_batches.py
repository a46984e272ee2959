"""`bench engine --in-flight N`: the batches a batcher could form at best from N requests at a
time, through the server's own tokenizer and pipeline; and every minilm mode times the texts the
load sends. Checks the batches and the texts, not the engine's speed."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from loadtest import bench, mlp, payloads
from loadtest.engine import in_flight_batches, sweep
from tests.integration.conftest import linked_repository


def test_each_group_of_requests_in_flight_is_sorted_by_length_and_cut_into_batches() -> None:
    texts = ["ccc", "a", "bb", "dddd", "eeeee"]
    batches = in_flight_batches(texts, 4, 2, len)
    assert batches[:2] == [["a", "bb"], ["ccc", "dddd"]], "the first four sent, shortest first"
    assert batches[2:4] == [["a", "bb"], ["ccc", "eeeee"]], "the next four sent (eeeee, then the cycle again)"
    assert all(len(batch) == 2 for batch in batches) and len(batches) == 2 * len(texts)
    sent = Counter(text for batch in batches for text in batch)
    assert sent == Counter(texts[i % len(texts)] for i in range(4 * len(texts))), "every text as often as sent"
    for first in range(len(texts)):
        group = batches[2 * first] + batches[2 * first + 1]
        assert [len(t) for t in group] == sorted(len(t) for t in group)


def test_a_batch_size_that_does_not_divide_the_requests_in_flight_is_refused() -> None:
    with pytest.raises(ValueError, match="not a multiple of batch size 3"):
        in_flight_batches(["a", "b"], 4, 3, len)


def test_in_flight_is_for_texts_only(tmp_path: Path) -> None:
    mlp.write_mlp_model(tmp_path)
    with pytest.raises(ValueError, match="minilm only"):
        sweep("mlp", tmp_path, [1], 0.1, 1, in_flight=4)
    args = bench.build_parser().parse_args(["engine", "--model", "minilm", "--in-flight", "64", "--out", str(tmp_path)])
    assert args.in_flight == 64
    with pytest.raises(SystemExit):  # two ways of grouping texts: one at a time
        bench.build_parser().parse_args(["engine", "--model", "minilm", "--in-flight", "64", "--length-sorted",
                                         "--out", str(tmp_path)])


def test_the_texts_timed_are_the_texts_the_load_sends() -> None:
    for bodies in (8, 32, 50):
        sent = [json.loads(r.body)["inputs"][0]["data"][0] for r in payloads.build_requests("minilm", 1, False, bodies)]
        assert payloads.texts_sent(bodies) == sent
    assert len(set(payloads.texts_sent())) == 32 < len(payloads.SENTENCES), "the default load leaves texts out"


def test_in_flight_runs_the_servers_own_path_on_the_loads_texts(tmp_path: Path) -> None:
    repository = linked_repository(tmp_path / "models", ("minilm",))
    [result] = sweep("minilm", repository, [2], 0.2, 1, in_flight=4, bodies=8)
    report = result.as_dict()
    assert report["batch_size"] == 2 and report["runs"] >= 5 and report["items_s"] > 0
    assert report["tokenize_ms_p50"] > 0  # each request tokenized, as admission does, inside the timed run
    assert 0 <= report["padding_share"] < 0.5
