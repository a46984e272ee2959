"""`bench fanout` and its GPU stand-in: a batch holds the one device for its wall time without
spending CPU, several processes take turns on it, and a short run of the mode measures all three
layouts. It checks the tools, not the server's speed."""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from pathlib import Path

import pytest

from loadtest import fanout, standin
from tests.integration.conftest import require_tool
from tests.loadtest.conftest import assert_figure, bench


def test_the_stand_in_device_costs_wall_time_not_cpu_one_batch_at_a_time(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(standin, "FIXED_US", 50_000.0)
    monkeypatch.setattr(standin, "ITEM_US", 1_000.0)
    devices = [standin.Device(tmp_path / "device.lock") for _ in range(2)]  # two processes' views of one device
    cpu: list[float] = []

    def run(device: standin.Device) -> None:
        # each run's own thread's CPU: threads earlier tests left in this process use some too
        before = time.thread_time()
        device.run(10)
        cpu.append(time.thread_time() - before)

    started = time.monotonic()
    runs = [threading.Thread(target=run, args=(device,)) for device in devices]
    for thread in runs:
        thread.start()
    for thread in runs:
        thread.join()
    elapsed = time.monotonic() - started
    assert elapsed >= 2 * 0.060  # 60 ms each, one after the other
    assert sum(cpu) < 0.05, cpu  # asleep, not spinning


def test_the_static_script_sends_one_mlp_request() -> None:
    script = fanout.static_body_script()
    assert 'wrk.method = "POST"' in script and "function" not in script  # no Lua per request
    body = json.loads(json.loads(script.split("wrk.body = ", 1)[1].split("\n", 1)[0]))
    assert body["inputs"][0]["shape"] == [1, 256] and len(body["inputs"][0]["data"]) == 256


def test_costs_are_read_per_level() -> None:
    before = ({"items": 10, "batches": 2, "requests": 10}, {1: 100, 2: 50})
    after = ({"items": 74, "batches": 4, "requests": 74}, {1: 164, 2: 82, 3: 5})
    costs = fanout.measured_costs(before, after, front_ends=frozenset({2, 3}))
    assert costs["mean_batch"] == 32
    assert costs["cpu_us_per_request"] == [10000.0, 5000.0, 781.2]  # a process that came later counts from its start
    assert (costs["cpu_us_per_request_servers"], costs["cpu_us_per_request_front_ends"]) == (10000.0, 5781.2)


def test_cpu_time_is_read_as_the_process_counts_it() -> None:
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # some CPU to count
        pass
    used = resource.getrusage(resource.RUSAGE_SELF)
    ticks = fanout.cpu_ticks([os.getpid()])[os.getpid()]
    assert abs(ticks / fanout.CLOCK_TICKS - (used.ru_utime + used.ru_stime)) < 0.1


def test_idle_time_is_read_from_the_whole_machine() -> None:
    first, started = fanout.idle_ticks(), time.monotonic()
    time.sleep(0.3)
    idle_cores = (fanout.idle_ticks() - first) / fanout.CLOCK_TICKS / (time.monotonic() - started)  # a sleep may overrun
    assert 0 <= idle_cores <= (os.cpu_count() or 1) + 0.5  # at most every core idle, with the ticks' rounding


def _level(round_number: int, layout: str, concurrency: int, req_s: float) -> dict[str, object]:
    return {"round": round_number, "layout": layout, "concurrency": concurrency, "req_s": req_s}


def test_each_round_is_compared_with_its_own_single_process() -> None:
    levels = [_level(1, "single", 64, 100.0), _level(1, "workers", 64, 150.0), _level(1, "workers", 256, 90.0),
              _level(2, "single", 64, 200.0), _level(2, "workers", 64, 240.0),
              _level(3, "single", 64, 50.0), _level(3, "workers", 64, 80.0)]
    assert fanout.ratios(levels) == [1.0, 1.5, None, 1.0, 1.2, 1.0, 1.6]  # no single at 256: no ratio
    assert fanout.median_rates(levels)[("workers", 64)] == 150.0
    assert fanout.ratio_summary(levels) == ["workers at 64 clients: x single 1.50, 1.20, 1.60 by round, median 1.50"]
    assert fanout.ratio_summary(levels[:3]) == []  # one round: the table says it all


def test_wrk_output_without_a_request_count_gives_no_cost_a_request(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """A figure divided by a count wrk did not print would be made up: the table leaves it blank."""
    report = ("Latency Distribution\n     50%  1.00ms\n     99%  2.00ms\n"
              "  {count}Requests/sec:   1000.00\nTransfer/sec:  1.00MB\n")
    outputs = iter([report.format(count="5000 requests in 5.00s, 1.00MB read\n"), report.format(count="")])
    monkeypatch.setattr(fanout.wrk_runs, "wrk_path", lambda: "wrk")
    monkeypatch.setattr(fanout.subprocess, "run",
                        lambda command, **_: fanout.subprocess.CompletedProcess(command, 0, next(outputs), ""))
    counted, uncounted = (fanout.wrk("http://127.0.0.1:1/", tmp_path / "s.lua", 8, 1, 1) for _ in range(2))
    assert counted["wrk_cpu_us_per_request"] is not None and counted["p99_ms"] == 2.0
    assert uncounted["wrk_cpu_us_per_request"] is None
    row = fanout.table_rows([uncounted | _level(1, "single", 8, 1000.0) | {
        "mean_batch": 1.0, "cpu_us_per_request_total": 1.0, "cpu_us_per_request_front_ends": 0.0,
        "idle_cores": 0.0, "processes": 1}])[0]
    assert row[fanout.HEADERS.index("wrk us/request")] == ""


def test_a_short_run_measures_every_layout(tmp_path: Path) -> None:
    require_tool("wrk", "wrk")
    out = tmp_path / "fanout"
    bench("fanout", "--out", str(out), "--concurrency", "4", "--duration", "1", "--warmup", "0",
          "--fixed-us", "200", "--item-us", "5", timeout=600)
    record = json.loads((out / "fanout.json").read_text())
    assert [level["layout"] for level in record["results"]] == ["single", "workers", "replicas"]
    for level in record["results"]:
        assert level["req_s"] > 0 and level["errors"] == 0 and level["mean_batch"] >= 1, level
        assert level["wrk_cpu_us_per_request"] > 0 and 0 <= level["idle_cores"] <= (os.cpu_count() or 1) + 0.5, level
    assert [level["processes"] for level in record["results"]] == [1, 3, 2]
    assert "x single" in assert_figure(out, "fanout")


def test_rounds_take_every_layout_in_turn(tmp_path: Path) -> None:
    require_tool("wrk", "wrk")
    out = tmp_path / "fanout"
    bench("fanout", "--out", str(out), "--layouts", "single", "--rounds", "2", "--concurrency", "2", "--duration", "1",
          "--warmup", "0", "--fixed-us", "200", "--item-us", "5", timeout=600)
    record = json.loads((out / "fanout.json").read_text())
    assert [(level["round"], level["layout"]) for level in record["results"]] == [(1, "single"), (2, "single")]
    assert record["parameters"]["rounds"] == 2 and "single@2_req_s" in record["headline"]
