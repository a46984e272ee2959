"""Models load side by side; a batch profile times alone, and neither waits forever."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from server.load_gate import LoadGate


def in_thread(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def test_builds_overlap_a_profile_waits_for_them_and_later_builds_wait_for_the_profile() -> None:
    gate = LoadGate(wait_s=30)
    events: list[str] = []
    first_built, release_first = threading.Event(), threading.Event()
    second_inside = threading.Event()

    def build(name: str, inside: threading.Event, release: threading.Event | None) -> None:
        with gate.building(name):
            events.append(f"{name} builds")
            inside.set()
            if release is not None:
                release.wait(10)
            events.append(f"{name} built")

    def profile() -> None:
        with gate.alone("m/1"):
            events.append("profile")
            time.sleep(0.05)
            events.append("profiled")

    in_thread(build, "a", first_built, release_first)
    assert first_built.wait(5)
    profiler = in_thread(profile)
    time.sleep(0.05)
    late = in_thread(build, "b", second_inside, None)  # asked for while the profile waits
    time.sleep(0.05)
    assert events == ["a builds"], "the profile waits for the build in progress; the new build waits for it"
    release_first.set()
    profiler.join(5)
    late.join(5)
    assert events == ["a builds", "a built", "profile", "profiled", "b builds", "b built"]


def test_two_builds_run_side_by_side() -> None:
    gate = LoadGate(wait_s=30)
    both = threading.Barrier(2, timeout=5)

    def build(name: str) -> None:
        with gate.building(name):
            both.wait()  # breaks (and the join finds it alive or raising) unless both are inside at once

    threads = [in_thread(build, name) for name in ("a", "b")]
    for thread in threads:
        thread.join(10)
    assert not both.broken


def test_a_build_that_never_ends_keeps_no_profile_waiting_forever(caplog: pytest.LogCaptureFixture) -> None:
    gate = LoadGate(wait_s=0.2)
    stuck, inside = threading.Event(), threading.Event()

    def build() -> None:
        with gate.building("hung"):
            inside.set()
            stuck.wait(10)

    in_thread(build)
    assert inside.wait(5)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING), gate.alone("m/1"):
        waited = time.monotonic() - started
    stuck.set()
    assert 0.2 <= waited < 5
    assert "times its batch ladder beside them" in caplog.text and "warmup.batch_cap" in caplog.text
