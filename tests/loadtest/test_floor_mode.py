"""`bench floor` and its bare app: the app answers what a v2 client of the MLP expects, each
server round is read against the floor of its own round, and a short run measures both sides.
It checks the tools, not the server's speed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from loadtest import floor, localserver, payloads
from tests.integration.conftest import require_tool
from tests.loadtest.conftest import assert_figure, bench


def test_the_bare_app_parses_the_body_and_answers_the_mlp_shape(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    command = [sys.executable, "-m", "loadtest.bareapp", "--port-file", str(port_file)]
    request = payloads.build_request("mlp", 3, False)
    with localserver.started_process(command, port_file, log_path=tmp_path / "log", wait_path="/",
                                     startup_timeout_s=60) as app:
        answer = httpx.post(app.url + request.path, content=request.body, headers=request.headers)
        assert payloads.check_response("mlp", 3, answer.status_code, dict(answer.headers), answer.content) is None
        assert answer.json()["model_name"] == "mlp"
        assert httpx.get(app.url + "/").status_code == 200


def _level(round_number: int, side: str, concurrency: int, req_s: float) -> dict[str, object]:
    return {"round": round_number, "side": side, "concurrency": concurrency, "req_s": req_s,
            "p50_ms": 1.0, "p99_ms": 2.0, "cpu_us_per_request": 50.0, "wrk_cpu_us_per_request": None, "errors": 0}


def test_each_server_round_is_read_against_its_own_floor() -> None:
    levels = [_level(1, "floor", 64, 20_000.0), _level(1, "batchline", 64, 10_000.0),
              _level(2, "floor", 64, 25_000.0), _level(2, "batchline", 64, 10_000.0), _level(2, "batchline", 8, 4_000.0),
              _level(3, "floor", 64, 10_000.0), _level(3, "batchline", 64, 6_000.0)]
    assert floor.ratios(levels) == [None, 0.5, None, 0.4, None, None, 0.6]  # no floor at 8 clients: no ratio
    assert floor.median_ratios(levels) == {64: 0.5}
    assert floor.fanout.median_rates(levels, by="side")[("floor", 64)] == 20_000.0
    assert floor.ratio_summary(levels) == [
        ("at 64 clients the server serves 0.50, 0.40, 0.60 of the floor's rate by round, median 0.50 "
        "(where the floor served 23,097 req/s: 11,548 req/s)")]
    rows = floor.table_rows(levels)
    assert rows[1][floor.HEADERS.index("of floor")] == 0.5 and rows[0][floor.HEADERS.index("of floor")] == ""
    assert rows[0][floor.HEADERS.index("wrk us/request")] == ""  # a figure wrk did not give is left blank


@pytest.mark.parametrize("cpu", [None, 1])
def test_wrk_is_pinned_only_when_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cpu: int | None) -> None:
    commands = []
    output = ("Latency Distribution\n     50%  1.00ms\n     99%  2.00ms\n"
              "  5000 requests in 5.00s, 1.00MB read\nRequests/sec:   1000.00\nTransfer/sec:  1.00MB\n")

    def run(command: list[str], **_: object) -> object:
        commands.append(command)
        return floor.fanout.subprocess.CompletedProcess(command, 0, output, "")

    monkeypatch.setattr(floor.fanout.wrk_runs, "wrk_path", lambda: "wrk")
    monkeypatch.setattr(floor.fanout.subprocess, "run", run)
    level = floor.fanout.wrk("http://127.0.0.1:1/", tmp_path / "s.lua", 8, 1, 1, cpu)
    assert level["requests"] == 5000
    assert commands[0][:3] == (["taskset", "-c", "1"] if cpu is not None else ["wrk", "-t", "1"])


def test_a_short_run_measures_both_sides_on_one_core(tmp_path: Path) -> None:
    require_tool("wrk", "wrk")
    out = tmp_path / "floor"
    bench("floor", "--out", str(out), "--rounds", "1", "--concurrency", "4", "--duration", "1", "--warmup", "0",
          "--server-cpu", "0", "--generator-cpu", "0", timeout=600)  # one CPU: any machine has it
    record = json.loads((out / "floor.json").read_text())
    assert [level["side"] for level in record["results"]] == ["floor", "batchline"]
    for level in record["results"]:
        assert level["req_s"] > 0 and level["errors"] == 0, level
        assert level["cpu_us_per_request"] > 0 and level["wrk_cpu_us_per_request"] > 0, level
    assert record["headline"]["of_floor@4"] > 0
    assert "of floor" in assert_figure(out, "floor")
