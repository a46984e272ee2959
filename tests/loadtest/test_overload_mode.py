"""Smoke test of `bench overload` against the real digits server: a second of load, the report
files and their fields. It checks the tool, not the server (the figures of a full run are a
benchmark, docs/benchmarks.md). Plus the pieces that need no server."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import orjson
import pytest

from loadtest import overload, payloads
from tests.loadtest.conftest import assert_figure, bench

needs_wrk = pytest.mark.usefixtures("wrk")  # fails, never skips, without it


@needs_wrk
@pytest.mark.integration
def test_bench_overload_writes_its_report(digits_url: str, tmp_path: Path) -> None:
    bench("overload", "--url", digits_url, "--duration", "1", "--factor", "1.5", "--capacity-duration", "1",
          "--settle", "0.2", "--deadline-ms", "2000", "--out", str(tmp_path))
    record = json.loads((tmp_path / "overload.json").read_text())
    assert record["mode"] == "overload" and record["machine"]["cpu_model"] is not None
    assert "loadtest.bench overload" in record["command_line"]
    result = record["results"]["overload"]
    assert record["results"]["capacity_run"]["req_s"] == result["capacity_req_s"] > 0
    assert result["sent"] > 0 and result["counts"]["accepted"] > 0
    assert sum(result["counts"].values()) == result["sent"] - result["unsent"] - result["cut_by_the_drain"]
    assert set(result["latency_ms"]) == {"accepted", "refused_429", "deadline_504"}
    assert result["live_after"] is True
    assert record["parameters"]["server_pid"] is not None  # found from the port
    assert result["rss_mib"]["samples"] > 0 and result["rss_mib"]["peak"] >= result["rss_mib"]["idle"] > 0
    assert record["results"]["timeline"]["t_s"] and record["results"]["rss_series"]
    markdown = assert_figure(tmp_path, "overload")
    assert "| refused (429) |" in markdown and "of capacity" in markdown


def test_with_deadline_adds_the_timeout_parameter() -> None:
    json_request = payloads.build_request("digits")
    body = orjson.loads(overload.with_deadline(json_request, 250).body)
    assert body["parameters"] == {"timeout": 250_000} and body["inputs"][0]["name"] == "image"
    binary = payloads.build_request("digits", items=2, binary=True)
    changed = overload.with_deadline(binary, 1.5)
    length = int(changed.headers[payloads.HEADER_LENGTH])
    assert orjson.loads(changed.body[:length])["parameters"] == {"timeout": 1500}
    assert changed.body[length:] == binary.body[int(binary.headers[payloads.HEADER_LENGTH]):]


def test_the_listening_process_and_its_memory_are_found() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert overload.listening_pid(port) == os.getpid()
    assert overload.status_kib(os.getpid(), "VmRSS") > 0
    with overload.RssSampler(os.getpid(), interval_s=0.01) as sampler:
        time.sleep(0.2)
    assert len(sampler.samples) >= 3 and all(kib > 0 for _, kib in sampler.samples)
