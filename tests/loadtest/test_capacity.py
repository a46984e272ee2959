"""The capacity finder (loadtest/capacity.py) against queues whose answer is known.

The fake server (loadtest/fakeserver.py) serves one request at a time for a fixed S: with the
finder's Poisson arrivals it is an M/D/1 queue. Its p99 capacity is known analytically in the
long run (Erlang's M/D/1 waiting-time distribution), and exactly, for the finite steps the
finder takes, by replaying the very arrival draws it sent through Lindley's recursion.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from loadtest import capacity, fakeserver, openloop, payloads
from tests.loadtest.conftest import assert_figure, bench

SERVICE_S = 0.002  # 500 requests/s at most


def md1_wait_cdf(t: float, rate: float, service_s: float) -> float:
    """P(wait <= t) in a stationary M/D/1 queue (Erlang): (1-ρ) Σ_{k<=t/S} (λ(kS-t))^k/k! e^{-λ(kS-t)}."""
    total = 0.0
    for k in range(math.floor(t / service_s) + 1):
        x = rate * (k * service_s - t)
        total += x**k / math.factorial(k) * math.exp(-x)
    return (1 - rate * service_s) * total


def md1_capacity(service_s: float, p99_s: float) -> float:
    """The highest rate whose p99 sojourn (wait + S) is at most p99_s, by bisection."""
    lo, hi = 0.0, (1 - 1e-9) / service_s
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if md1_wait_cdf(p99_s - service_s, mid, service_s) >= 0.99 else (lo, mid)
    return lo


def simulated(service_s: float, step_s: float, p99_ms: float, seed: int = 0, settle: float = 0.1,
              tolerance: float = 0.03) -> capacity.Measure:
    """A step measured on the M/D/1 queue itself: the client's arrival draws, Lindley's recursion."""

    def measure(rate: float, purpose: str) -> capacity.Step:
        result = openloop.RateResult(rate=rate, duration_s=step_s, steady_from_s=settle * step_s)
        result.schedule_s = openloop.schedule(rate, step_s, seed)
        result.ok_arrivals_s = list(result.schedule_s)
        result.latencies_s = fakeserver.simulate(result.schedule_s, service_s)
        result.sent = result.ok = len(result.schedule_s)
        record = result.as_dict(1)
        sustained, reason = capacity.judge(record, p99_ms, tolerance)
        return capacity.Step(0, purpose, rate, sustained, reason, record)

    return measure


def test_search_brackets_then_bisects_within_precision() -> None:
    calls: list[float] = []

    def measure(rate: float, purpose: str) -> capacity.Step:
        calls.append(rate)
        return capacity.Step(len(calls), purpose, rate, rate <= 730, "")

    found = capacity.search(measure, start=100, min_rate=1, max_rate=1e5, growth=2, precision=0.02, max_steps=20)
    assert calls[:4] == [100, 200, 400, 800]  # bracketing up to the first failure
    assert found.capacity is not None and found.failed_above is not None
    assert found.capacity <= 730 < found.failed_above <= found.capacity * 1.02

    down = capacity.search(measure, start=5000, min_rate=1, max_rate=1e5, growth=2, precision=0.02, max_steps=20)
    assert down.steps[1].rate == 2500 and down.capacity is not None and down.capacity <= 730
    capped = capacity.search(measure, start=100, min_rate=1, max_rate=1e5, growth=2, precision=0.02, max_steps=3)
    assert len(capped.steps) == 3 and "max-steps" in capped.stopped
    hopeless = capacity.search(lambda r, p: capacity.Step(0, p, r, False, ""), 10, 2, 100, 2, 0.05, 10)
    assert hopeless.capacity is None and "min-rate" in hopeless.stopped


def test_search_on_long_simulated_steps_finds_the_analytic_md1_capacity() -> None:
    """60 s steps make the p99 of each step close to the stationary one."""
    expected = md1_capacity(SERVICE_S, 0.020)
    assert 380 < expected < 395  # 2 ms service, p99 <= 20 ms: ρ ≈ 0.77
    found = capacity.search(simulated(SERVICE_S, 60.0, 20), 200, 1, 10000, 2, 0.02, 14)
    assert found.capacity == pytest.approx(expected, rel=0.03)


def _probe(url: str, p99_ms: float, step_s: float) -> capacity.ServerProbe:
    requests = payloads.build_requests("digits", 1, False, 8)
    return capacity.ServerProbe(url, "digits", requests, p99_ms, step_s, pause_s=0.2, scrape_interval_s=0.25)


def test_finder_on_the_fake_server_tight_target() -> None:
    """p99 <= 20 ms at 2 ms per request: the finder must land within 10% of what the M/D/1 queue
    gives for the same arrivals, and of the long-run (analytic) capacity."""
    step_s = 2.0
    expected = capacity.search(simulated(SERVICE_S, step_s, 20), 200, 1, 10000, 2, 0.05, 14).capacity
    analytic = md1_capacity(SERVICE_S, 0.020)
    with fakeserver.running(SERVICE_S * 1000) as url:
        probe = _probe(url, 20, step_s)
        found = capacity.search(probe, 200, 1, 10000, 2, 0.05, 14)
    path = [(s.rate, s.sustained, s.reason) for s in found.steps]
    assert found.capacity is not None and expected is not None, path
    assert found.capacity == pytest.approx(expected, rel=0.10), path
    assert found.capacity == pytest.approx(analytic, rel=0.10), path
    at = next(s for s in found.steps if s.sustained and s.rate == found.capacity)
    assert at.signals["source"] == "metrics"
    # the busy share the fake server exports is the utilisation ρ = rate x S
    assert at.signals["busy_fraction"] == pytest.approx(at.run["steady"]["achieved_req_s"] * SERVICE_S, rel=0.15)
    assert at.signals["queue_depth_mean"] > 0 and at.signals["queue_per_compute"] > 0


def test_finder_on_the_fake_server_generous_target_finds_one_over_s() -> None:
    """With p99 <= 500 ms, keeping up is what binds: capacity ≈ 1/S. No /metrics: the statistics
    extension must do."""
    with fakeserver.running(SERVICE_S * 1000, metrics=False) as url:
        found = capacity.search(_probe(url, 500, 3.0), 200, 1, 10000, 2, 0.05, 14)
    path = [(s.rate, s.sustained, s.reason) for s in found.steps]
    assert found.capacity == pytest.approx(1 / SERVICE_S, rel=0.10), path
    at = next(s for s in found.steps if s.sustained and s.rate == found.capacity)
    assert at.signals["source"] == "stats" and at.signals["busy_fraction"] is None
    assert at.signals["queue_per_compute"] > 1  # near saturation, requests wait longer than they run


@pytest.mark.integration
def test_bench_capacity_on_the_real_server(digits_url: str, tmp_path: Path) -> None:
    """The CLI end to end, briefly: report files, signals from /metrics, the recommendation."""
    bench("capacity", "--url", digits_url, "--p99-ms", "100", "--start-rate", "100", "--max-steps", "2",
          "--step-duration", "1", "--warmup", "0", "--pause", "0.2", "--out", str(tmp_path))
    record = json.loads((tmp_path / "capacity.json").read_text())
    steps = record["results"]["steps"]
    assert [s["rate"] for s in steps] == [100, 200] and all(s["run"]["ok"] > 0 for s in steps)
    assert record["headline"]["capacity_req_s"] in (None, 100, 200)
    assert steps[0]["signals"]["source"] == "metrics" and steps[0]["signals"]["busy_fraction"] is not None
    if record["headline"]["capacity_req_s"]:
        assert record["results"]["margin_step"]["purpose"] == "margin"
        assert record["headline"]["recommendation"]["target_req_s_per_replica"] > 0
    assert record["machine"]["cpu_model"] is not None and "capacity --url" in record["command_line"]
    markdown = assert_figure(tmp_path, "capacity")
    assert "Autoscaling target" in markdown and "batchline_queue_duration_seconds_sum" in markdown
