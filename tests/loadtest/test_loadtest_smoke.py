"""Smoke tests of the load-test tooling (loadtest/): each tool runs for a second or two against
the real server and must produce its files with real figures. They check the tools, not the
server's speed: no threshold on a number here.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest import payloads
from tests.loadtest.conftest import ROOT, assert_figure
from tests.loadtest.conftest import bench as _bench
from tests.loadtest.conftest import run_command as _run

pytestmark = pytest.mark.integration


def test_payloads_round_trip_shapes() -> None:
    """Binary bodies: JSON header of the declared length, then the raw tensor bytes."""
    request = payloads.build_request("digits", items=3, binary=True)
    length = int(request.headers[payloads.HEADER_LENGTH])
    header = json.loads(request.body[:length])
    assert header["inputs"][0]["shape"] == [3, 1, 8, 8]
    assert len(request.body) - length == header["inputs"][0]["parameters"]["binary_data_size"] == 3 * 64 * 4
    text = payloads.build_request("minilm", items=2, binary=True)
    raw = text.body[int(text.headers[payloads.HEADER_LENGTH]):]
    first = int.from_bytes(raw[:4], "little")
    assert raw[4:4 + first].decode() == payloads.SENTENCES[0]
    wrong = b'{"outputs":[{"name":"probabilities","shape":[1,10]}]}'
    assert "shape" in payloads.check_response("digits", 2, 200, {}, wrong)


def test_locust_headless_run(digits_url: str, tmp_path: Path) -> None:
    """locust exits non-zero on any failed request (its --exit-code-on-error), and the CSV,
    written once a second, must show requests and no failures."""
    prefix = tmp_path / "run"
    _run(sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--headless", "-u", "2", "-r", "2",
         "-t", "3s", "--host", digits_url, "--csv", str(prefix), "--only-summary",
         env={"BATCHLINE_LT_MODEL": "digits", "BATCHLINE_LT_BINARY": "1", "BATCHLINE_LT_ITEMS": "2"})
    rows = {row["Name"]: row for row in csv.DictReader((tmp_path / "run_stats.csv").open())}
    total = rows["Aggregated"]
    assert int(total["Request Count"]) > 0
    assert int(total["Failure Count"]) == 0, (tmp_path / "run_failures.csv").read_text()
    assert "digits binary x2" in rows


def test_bench_engine_digits(tmp_path: Path) -> None:
    _bench("engine", "--model", "digits", "--batch-sizes", "1,8", "--duration", "0.2", "--out", str(tmp_path))
    record = json.loads((tmp_path / "engine.json").read_text())
    assert [r["batch_size"] for r in record["results"]] == [1, 8]
    assert all(r["items_s"] > 0 and r["latency_ms"]["p99"] >= r["latency_ms"]["p50"] > 0 for r in record["results"])
    assert record["headline"]["engine_ceiling_items_s"] == max(r["items_s"] for r in record["results"])
    assert record["machine"]["libraries"]["torch"] and "engine --model digits" in record["command_line"]
    assert "engine ceiling" in assert_figure(tmp_path, "engine")


@pytest.mark.usefixtures("wrk")
def test_bench_closed_wrk(digits_url: str, tmp_path: Path) -> None:
    _bench("closed", "--url", digits_url, "--concurrency", "1,4", "--duration", "2", "--warmup", "0",
           "--out", str(tmp_path))
    record = json.loads((tmp_path / "closed.json").read_text())
    levels = record["results"]
    assert [level["concurrency"] for level in levels] == [1, 4]
    for level in levels:
        assert level["requests"] > 0 and level["req_s"] > 0 and level["error_count"] == 0
        assert level["latency_samples"] == level["requests"]  # every reply timed by the Lua script
        assert 0 < level["latency_ms"]["p50"] <= level["latency_ms"]["p99"]
    markdown = assert_figure(tmp_path, "closed")
    assert f"{levels[0]['req_s']:,.1f}" in markdown and "p99 ms" in markdown


def test_bench_closed_without_wrk_says_how_to_install(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "loadtest.bench", "closed", "--out", str(tmp_path)],
                          check=False, cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": str(tmp_path)})
    assert done.returncode != 0
    assert "apt-get install -y wrk" in done.stderr


def test_bench_open_loop(digits_url: str, tmp_path: Path) -> None:
    _bench("open", "--url", digits_url, "--rates", "50,200", "--duration", "1", "--out", str(tmp_path))
    record = json.loads((tmp_path / "open.json").read_text())
    assert [r["offered_rate"] for r in record["results"]] == [50, 200]
    assert all(r["ok"] > 0 and r["error_count"] == 0 and r["validated_replies"] > 0 for r in record["results"])
    assert all(r["steady"]["achieved_req_s"] > 0 and r["aborted"] is None for r in record["results"])
    assert assert_figure(tmp_path, "open").count("\n|") >= 4


def test_wrk_histogram_percentiles_follow_wrk() -> None:
    """The Lua script's "us:count" histogram → percentiles with wrk's rank rule, in ms."""
    from loadtest import wrk

    counts = wrk.parse_histogram("100:98,2000:1,900:1")
    assert counts.sum() == 100 and counts[900] == 1
    summary = wrk.summarize(counts)
    # wrk's rank is round(p/100·n + 0.5): of 100 samples, p99 is the 100th
    assert summary["p50"] == summary["p90"] == 0.1 and summary["p99"] == 2.0 and summary["max"] == 2.0
    assert wrk.percentile_us(counts, 98) == 900
    assert summary["mean"] == round((98 * 100 + 900 + 2000) / 100 / 1000, 3)
