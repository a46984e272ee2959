"""`bench engine --in-flight N`: the batches a batcher could form at best from N requests at a
time, through the server's own tokenizer and pipeline; and every minilm mode times the texts the
load sends. Checks the batches and the texts, not the engine's speed."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from loadtest import bench, mlp, payloads
from loadtest.engine import in_flight_batches, run_sizes, sweep
from server.engines.timing import WARMUP_RUNS
from server.scheduler.batcher import LENGTH_WINDOW
from tests.integration.conftest import linked_repository


def test_the_oldest_waiting_takes_those_nearest_its_length_and_their_clients_send_again() -> None:
    texts = ["a", "bbbbbbbbb", "ccc", "dd", "eeeeeeee", "ffffffffff"]
    batches = in_flight_batches(texts, 4, 2, len)  # clients 0-3 start at a, bbbbbbbbb, ccc, dd
    assert batches[0] == ["a", "dd"], "the oldest, and the nearest its length"
    assert batches[1] == ["bbbbbbbbb", "bbbbbbbbb"], "client 0 sent its next text, which is client 1's"
    assert batches[2] == ["ccc", "ccc"], "of two as near, the older: client 1's, not client 0's"
    assert len(batches) == len(texts) * 4 // 2 and all(len(batch) == 2 for batch in batches)
    sent = Counter(text for batch in batches for text in batch)
    assert max(sent.values()) - min(sent.values()) <= 4, "every text about as often as the clients send it"


def test_lengths_are_compared_within_the_servers_window() -> None:
    texts = ["x" * n for n in (30, 45, 50, 55, 60, 65, 70, 75, 80, 29)]
    assert LENGTH_WINDOW * 2 == 8
    assert in_flight_batches(texts, 10, 2, len)[0] == [texts[0], texts[1]], "29 is past the 8 behind the oldest"


def test_texts_of_another_length_bucket_never_share_a_batch() -> None:
    texts = ["aa", "bbbbbb", "cc", "dddddd", "eee"]
    batches = in_flight_batches(texts, 5, 4, len, bucket=lambda n: 4 if n <= 4 else 8)
    assert batches[0] == ["aa", "cc", "eee"], "a batch short of its cap rather than a text of another bucket"
    assert all(len({len(t) <= 4 for t in batch}) == 1 for batch in batches)
    assert in_flight_batches(texts, 5, 4, len)[0] == ["aa", "cc", "eee", "bbbbbb"], "without buckets, one for all"
    assert in_flight_batches(texts, 5, 4, len, by_length=False)[0] == texts[:4], "where the server keeps arrival order"


def test_items_are_counted_as_the_timed_runs_held_them() -> None:
    called: list[int] = []

    def prepare(batch_size: int):
        def run(index: int) -> None:
            called.append(index)

        run.batch_items = [1, 2, 3]  # type: ignore[attr-defined]
        return run

    [result] = run_sizes(prepare, [3], 0.05)
    timed = called[WARMUP_RUNS:]
    assert timed == list(range(result.runs))
    assert result.items == sum([1, 2, 3][i % 3] for i in timed)
    assert result.as_dict()["items_s"] == round(result.items / result.elapsed_s, 1)


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
    assert result.items is not None and result.runs <= result.items <= 2 * result.runs  # each batch as it ran
    assert report["tokenize_ms_p50"] > 0  # each request tokenized, as admission does, inside the timed run
    assert 0 <= report["padding_share"] < 0.5
