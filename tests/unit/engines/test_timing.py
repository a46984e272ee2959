"""The one timing loop behind the build reports' speed and the benchmarks' engine ceiling."""

from __future__ import annotations

from server.engines.timing import time_runs


def test_warmup_runs_are_not_timed_and_every_timed_run_is_counted() -> None:
    calls: list[int] = []
    timed = time_runs(lambda i: calls.append(i) or i * 10, 0.0, min_runs=4, warmup=2, keep=True)
    assert calls == [0, 1, 0, 1, 2, 3]  # two warm-up runs, then four timed ones numbered from 0
    assert len(timed.latencies_s) == 4 and timed.returned == [0, 10, 20, 30]
    assert timed.elapsed_s >= sum(timed.latencies_s) > 0


def test_outputs_are_dropped_as_they_come_unless_kept() -> None:
    """A build times an engine for seconds: holding every output would hold gigabytes."""
    import weakref

    class Output:
        pass

    alive: list[weakref.ref[Output]] = []

    def run(_: int) -> Output:
        output = Output()
        alive.append(weakref.ref(output))
        return output

    timed = time_runs(run, 0.0, min_runs=5, warmup=0)
    assert timed.returned == [] and all(ref() is None for ref in alive)


def test_runs_stop_at_max_runs_before_the_time_is_up() -> None:
    timed = time_runs(lambda i: None, 60.0, max_runs=7, warmup=0)
    assert len(timed.latencies_s) == 7


def test_runs_go_on_until_the_time_is_up() -> None:
    timed = time_runs(lambda i: None, 0.05, min_runs=1, warmup=0)
    assert timed.elapsed_s >= 0.05 and len(timed.latencies_s) > 1
