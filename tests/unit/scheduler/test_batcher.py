"""The batcher with fake instances whose batches finish when the test says so."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from server.errors import DeadlineExceeded, EngineError, QueueFull
from server.scheduler.batcher import Batcher, QueueSettings
from server.scheduler.policy import BatchPolicy
from server.scheduler.request import InferenceRequest
from server.stats import ModelStatistics
from server.workers.result import BatchResult
from tests.unit.waiting import eventually

LIVE: list[FakeInstance] = []


@pytest.fixture(autouse=True)
async def release_everything():
    """Let every batch a test left blocked finish before its event loop closes."""
    yield
    for _ in range(100):  # a released batch lets the next one form: release until none is left
        blocked = [gate for fake in LIVE for gate in fake._gates if not gate.is_set()]
        if not blocked:
            break
        for gate in blocked:
            gate.set()
        await settle()
    LIVE.clear()
    await settle()


class FakeInstance:
    """Doubles `x`; each batch blocks until released, so tests control the interleaving."""

    def __init__(self, label: str = "fake") -> None:
        LIVE.append(self)
        self.label = label
        self.batches: list[list[dict[str, np.ndarray]]] = []
        self._gates: list[asyncio.Event] = []
        self.fail_next = False

    async def run(self, feeds: list[dict[str, np.ndarray]]) -> BatchResult:
        gate = asyncio.Event()
        self.batches.append(feeds)
        self._gates.append(gate)
        await gate.wait()
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        return BatchResult([{"y": f["x"] * 2} for f in feeds])

    def release(self, index: int = -1) -> None:
        self._gates[index].set()

    def sizes(self) -> list[list[int]]:
        return [[len(f["x"]) for f in batch] for batch in self.batches]


def request(values: list[float], *, key="a", longest=0, length=0, priority=1, deadline_ns=None,
            padded=()) -> InferenceRequest:
    x = np.array(values, dtype=np.float32).reshape(-1, 1)
    return InferenceRequest(
        {"x": x}, len(values), asyncio.get_running_loop().create_future(),
        shape_key=key, longest=longest, length=length, priority=priority, deadline_ns=deadline_ns, padded=padded,
    )


def batcher(instances, *, max_batch=8, preferred=(), delay_ms=0, budget=None, **settings) -> tuple[Batcher, ModelStatistics]:
    stats = ModelStatistics()
    policy = BatchPolicy(max_batch, tuple(preferred), delay_ms * 1_000_000, budget)
    return Batcher(policy, QueueSettings(**settings), instances, stats), stats


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_an_idle_instance_takes_a_request_at_once() -> None:
    fake = FakeInstance()
    b, stats = batcher([fake], delay_ms=50)
    r = request([1.0])
    b.submit(r)
    await settle()
    assert fake.sizes() == [[1]]
    fake.release()
    assert (await r.future)["y"].tolist() == [[2.0]]
    assert stats.dispatch_reasons == {"idle": 1}


async def test_the_next_batch_forms_while_one_runs_and_results_split_exactly() -> None:
    fake = FakeInstance()
    b, stats = batcher([fake], delay_ms=50)
    first = request([1.0])
    b.submit(first)
    await settle()
    waiting = [request([2.0]), request([3.0, 4.0]), request([5.0])]
    for r in waiting:
        b.submit(r)
    await settle()
    assert fake.sizes() == [[1]] and b.queue_depth == 3
    fake.release(0)
    await settle()
    assert fake.sizes() == [[1], [1, 2, 1]]  # one batch of all three, no delay wasted
    fake.release(1)
    results = [(await r.future)["y"].ravel().tolist() for r in waiting]
    assert results == [[4.0], [6.0, 8.0], [10.0]]
    assert stats.execution_count == 2 and stats.inference_count == 5


async def test_a_batch_never_exceeds_the_cap() -> None:
    fake = FakeInstance()
    b, stats = batcher([fake], max_batch=4)
    b.submit(request([0.0]))
    await settle()
    for _ in range(3):
        b.submit(request([1.0, 1.0]))
    await settle()
    fake.release(0)
    await settle()
    assert fake.sizes()[1] == [2, 2]
    assert stats.dispatch_reasons["full"] == 1
    fake.release(1)
    await settle()
    assert fake.sizes()[2] == [2]


async def test_preferred_size_dispatches_without_waiting() -> None:
    busy, free = FakeInstance("busy"), FakeInstance("free")
    b, stats = batcher([free, busy], preferred=(2,), delay_ms=10_000)
    b.submit(request([0.0]))  # goes to one instance: now something runs
    await settle()
    b.submit(request([1.0]))
    await settle()
    assert len(busy.batches) + len(free.batches) == 1  # waiting for the window or a preferred size
    b.submit(request([2.0]))
    await settle()
    assert sorted(len(i.batches) for i in (busy, free)) == [1, 1]
    assert stats.dispatch_reasons["preferred"] == 1


async def test_the_delay_window_applies_only_behind_a_busy_instance() -> None:
    """On a clock of the test's own: a machine that stalls 40 ms cannot close the window early."""
    first, second = FakeInstance("a"), FakeInstance("b")
    now = [time.perf_counter_ns()]
    stats = ModelStatistics()
    b = Batcher(BatchPolicy(8, (), 40_000_000, None), QueueSettings(), [first, second], stats, clock=lambda: now[0])
    b.submit(request([0.0]))
    await settle()
    b.submit(request([1.0]))
    await settle()
    await asyncio.sleep(0.06)  # the window's wake-up finds it still open on this clock
    assert b.queue_depth == 1  # one instance is busy: the window is spent
    now[0] += 50_000_000
    await eventually(lambda: b.queue_depth == 0, "the window closed and the idle instance took the request")
    assert stats.dispatch_reasons == {"idle": 1, "delay": 1}


async def test_higher_priority_goes_first() -> None:
    fake = FakeInstance()
    b, _ = batcher([fake], max_batch=1, levels=2)
    b.submit(request([0.0]))
    await settle()
    low, high = request([1.0], priority=2), request([2.0], priority=1)
    b.submit(low)
    b.submit(high)
    fake.release(0)
    await settle()
    assert fake.batches[1][0]["x"].item() == 2.0
    fake.release(1)
    await settle()
    assert fake.batches[2][0]["x"].item() == 1.0


async def test_priorities_share_a_batch_high_first() -> None:
    fake = FakeInstance()
    b, _ = batcher([fake], max_batch=8, levels=3)
    b.submit(request([0.0]))
    await settle()
    for value, level in ((3.0, 3), (1.0, 1), (2.0, 2)):
        b.submit(request([value], priority=level))
    fake.release(0)
    await settle()
    assert [f["x"].item() for f in fake.batches[1]] == [1.0, 2.0, 3.0]


async def test_a_request_whose_deadline_passes_while_queued_never_runs() -> None:
    fake = FakeInstance()
    b, stats = batcher([fake])
    b.submit(request([0.0]))
    await settle()
    doomed = request([1.0], deadline_ns=time.perf_counter_ns() + 20_000_000)
    kept = request([2.0])
    b.submit(doomed)
    b.submit(kept)
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(doomed.future, 1.0)
    assert b.queue_depth == 1
    fake.release(0)
    await settle()
    assert [f["x"].item() for f in fake.batches[1]] == [2.0]
    assert stats.failures["deadline"] == 1


async def test_a_request_whose_deadline_would_pass_before_its_batch_finishes_never_runs() -> None:
    """Batches here take 10 s (a fake clock): at the next dispatch, a request with 5 s left is
    answered DeadlineExceeded at once instead of being run and answered late; one with 20 s left,
    and one without a deadline, run. (The real timers are set 15 s and more ahead: they never fire.)"""
    fake = FakeInstance()
    now = [0]
    stats = ModelStatistics()
    b = Batcher(BatchPolicy(8, (), 0, None), QueueSettings(), [fake], stats, clock=lambda: now[0])
    b.submit(request([0.0]))
    await settle()
    late = request([1.0], deadline_ns=15_000_000_000)
    in_time = request([2.0], deadline_ns=30_000_000_000)
    whenever = request([3.0])
    for r in (late, in_time, whenever):
        b.submit(r)
    await settle()
    now[0] = 10_000_000_000  # the first batch took 10 s
    fake.release(0)
    await settle()
    with pytest.raises(DeadlineExceeded, match="would pass before its batch could finish"):
        await asyncio.wait_for(late.future, 1.0)
    assert [f["x"].item() for f in fake.batches[1]] == [2.0, 3.0]
    assert stats.failures["deadline"] == 1
    fake.release(1)
    assert (await in_time.future)["y"].item() == 4.0


async def test_an_old_slow_batch_does_not_refuse_every_request_that_follows() -> None:
    """One batch took 10 s (a stall, a held engine), then nothing ran for 20 s: a request with
    5 s left runs, and measures again, instead of being refused on that one batch forever."""
    fake = FakeInstance()
    now = [0]
    stats = ModelStatistics()
    b = Batcher(BatchPolicy(8, (), 0, None), QueueSettings(), [fake], stats, clock=lambda: now[0])
    b.submit(request([0.0]))
    await settle()
    now[0] = 10_000_000_000
    fake.release(0)
    await settle()
    now[0] = 30_000_000_000
    later = request([1.0], deadline_ns=now[0] + 5_000_000_000)
    b.submit(later)
    await settle()
    assert [f["x"].item() for f in fake.batches[1]] == [1.0]
    now[0] += 100_000_000
    fake.release(1)
    assert (await later.future)["y"].item() == 2.0
    assert stats.failures["deadline"] == 0


async def test_a_batch_that_finishes_after_a_deadline_answers_that_request_with_the_deadline_error() -> None:
    """A batch slower than expected: the request whose deadline passed meanwhile gets
    DeadlineExceeded, never a late result; its neighbours in the batch get theirs."""
    fake = FakeInstance()
    now = [0]
    stats = ModelStatistics()
    b = Batcher(BatchPolicy(8, (), 0, None), QueueSettings(), [fake], stats, clock=lambda: now[0])
    short = request([1.0], deadline_ns=15_000_000_000)  # real timers 15 s and more ahead never fire
    long = request([2.0], deadline_ns=30_000_000_000)
    whenever = request([3.0])
    b.submit(short)
    await settle()
    b.submit(long)
    b.submit(whenever)
    now[0] = 1_000_000_000
    fake.release(0)
    assert (await short.future)["y"].item() == 2.0  # done at 1 s, in time
    await settle()
    assert fake.sizes()[1] == [1, 1]
    now[0] = 31_000_000_000  # this batch took 30 s
    fake.release(1)
    with pytest.raises(DeadlineExceeded, match="finished 1000 ms after its deadline"):
        await asyncio.wait_for(long.future, 1.0)
    assert (await whenever.future)["y"].item() == 6.0
    assert stats.failures["deadline"] == 1
    assert stats.success.count == 2
    assert stats.inference_count == 2  # the late one is a failure, not an inference served


async def test_a_request_already_past_its_deadline_never_runs_even_on_an_idle_model() -> None:
    fake = FakeInstance()
    now = [10_000_000_000]
    stats = ModelStatistics()
    b = Batcher(BatchPolicy(8, (), 0, None), QueueSettings(), [fake], stats, clock=lambda: now[0])
    expired = request([1.0], deadline_ns=now[0] - 1)  # its body took longer than its timeout
    b.submit(expired)
    with pytest.raises(DeadlineExceeded, match="deadline passed before it could run"):
        await asyncio.wait_for(expired.future, 1.0)
    assert fake.batches == [] and stats.failures["deadline"] == 1


async def test_a_full_queue_refuses_at_once() -> None:
    fake = FakeInstance()
    b, stats = batcher([fake], max_queue_size=2)
    b.submit(request([0.0]))
    await settle()
    b.submit(request([1.0]))
    b.submit(request([2.0]))
    with pytest.raises(QueueFull):
        b.submit(request([3.0]))
    assert stats.failures["queue_full"] == 1
    fake.release(0)
    await settle()
    b.submit(request([4.0]))  # room again once the queue moved


async def test_every_failed_request_counts_in_fail_as_triton_counts_it() -> None:
    """`fail` is every failed request, whatever `failures` says it was: a refusal, a cancel, a
    deadline in the queue (with the time it waited)."""
    fake = FakeInstance()
    b, stats = batcher([fake], max_queue_size=2)
    b.submit(request([0.0]))
    await settle()
    gone, late = request([1.0]), request([2.0], deadline_ns=time.perf_counter_ns() + 1_000_000)
    b.submit(gone)
    b.submit(late)
    with pytest.raises(QueueFull):
        b.submit(request([3.0]))
    gone.future.cancel()
    with pytest.raises(DeadlineExceeded):
        await late.future
    assert dict(stats.failures) == {"queue_full": 1, "cancelled": 1, "deadline": 1}
    assert stats.fail.count == 3 and stats.fail.ns >= 1_000_000  # the late one waited its millisecond
    fake.release(0)
    await settle()


async def test_a_cancelled_request_is_dropped_before_compute() -> None:
    fake = FakeInstance()
    b, stats = batcher([fake])
    b.submit(request([0.0]))
    await settle()
    gone, stays = request([1.0]), request([2.0])
    b.submit(gone)
    b.submit(stays)
    gone.future.cancel()
    await settle()
    assert b.queue_depth == 1 and stats.failures["cancelled"] == 1
    fake.release(0)
    await settle()
    assert [f["x"].item() for f in fake.batches[1]] == [2.0]


async def test_an_answered_request_takes_the_queues_callback_off_its_future(monkeypatch) -> None:
    """The queue watches a request's future for a caller that cancels it. Once the request is
    answered, that callback comes off: it would only run a loop turn later to find the request
    done, and it holds the request. A cancelled one is still dropped through it."""
    fake = FakeInstance()
    b, stats = batcher([fake])
    seen: list[InferenceRequest] = []
    original = b._on_future_done
    monkeypatch.setattr(b, "_on_future_done", lambda r: (seen.append(r), original(r)))
    answered = [request([1.0]), request([2.0])]
    for r in answered:
        b.submit(r)
    await settle()
    fake.release(0)
    await settle()
    fake.release(1)
    assert [(await r.future)["y"].item() for r in answered] == [2.0, 4.0]
    await settle()
    assert seen == [] and all(r.watch is None for r in answered)
    b.submit(request([0.0]))
    await settle()
    cancelled = request([3.0])
    b.submit(cancelled)
    cancelled.future.cancel()
    await settle()
    assert seen == [cancelled] and cancelled.watch is None and stats.failures["cancelled"] == 1


async def test_a_withdrawn_request_is_dropped_only_while_queued() -> None:
    """A client gone: its queued request is dropped at once, so no batch can take it even
    before the future's callbacks run; one already computing runs to its end and resolves,
    since its inputs may be read until then."""
    fake = FakeInstance()
    b, stats = batcher([fake])
    running = request([0.0])
    b.submit(running)
    await settle()
    queued = request([1.0])
    b.submit(queued)
    assert b.withdraw(queued.future) and queued.future.cancelled()
    assert b.queue_depth == 0 and stats.failures["cancelled"] == 1
    assert not b.withdraw(running.future) and not running.future.done()
    assert not b.withdraw(asyncio.get_running_loop().create_future())  # not one of its requests
    fake.release(0)
    assert (await running.future)["y"].tolist() == [[0.0]]
    await settle()
    assert len(fake.batches) == 1 and stats.failures["cancelled"] == 1


async def test_a_drain_cancelled_leaves_its_batches_running() -> None:
    fake = FakeInstance()
    b, _ = batcher([fake])
    running = request([1.0])
    b.submit(running)
    await settle()
    drain = asyncio.create_task(b.drain())
    await settle()
    drain.cancel()
    await settle()
    assert drain.cancelled() and not running.future.done()
    fake.release(0)
    assert (await running.future)["y"].tolist() == [[2.0]]


async def test_only_compatible_shapes_share_a_batch() -> None:
    fake = FakeInstance()
    b, _ = batcher([fake])
    b.submit(request([0.0]))
    await settle()
    for key in ("a", "b", "a", "b"):
        b.submit(request([1.0], key=key))
    fake.release(0)
    await settle()
    assert fake.sizes()[1] == [1, 1]
    fake.release(1)
    await settle()
    assert fake.sizes()[2] == [1, 1]


async def test_the_token_budget_caps_a_text_batch() -> None:
    fake = FakeInstance()
    b, stats = batcher([fake], budget=100)
    b.submit(request([0.0], longest=10))
    await settle()
    for longest in (30, 20, 30, 30):
        b.submit(request([1.0], longest=longest))
    fake.release(0)
    await settle()
    assert fake.sizes()[1] == [1, 1, 1]  # 3 x 30 tokens fit; a 4th would make 120
    assert stats.dispatch_reasons["full"] == 1


async def test_a_request_that_would_pad_the_batch_past_the_bound_heads_the_next_one() -> None:
    """A padded input of a million values behind requests of four: each row beside it would be
    padded to a million (the padding bound, policy.py). The batch before it goes at once, as a
    full one does, without waiting for its window; it heads the next, with what fits beside it."""
    fake = FakeInstance()
    b, _ = batcher([fake], max_batch=8, delay_ms=10_000)
    b.submit(request([9.0]))  # holds the instance
    await settle()
    b.submit(request([0.0], padded=((4,),)))
    b.submit(request([0.5], padded=((4,),)))
    b.submit(request([1.0], padded=((1 << 20,),)))  # with two rows of four: three rows of a million
    for value in (2.0, 3.0, 4.0):
        b.submit(request([value], padded=((4,),)))
    fake.release(0)
    await settle()
    assert [float(f["x"][0, 0]) for f in fake.batches[1]] == [0.0, 0.5]  # went at once, not in 10 s
    fake.release(1)
    await settle()
    assert [float(f["x"][0, 0]) for f in fake.batches[2]] == [1.0, 2.0]  # two rows: within twice what they brought
    fake.release(2)
    await settle()
    assert [float(f["x"][0, 0]) for f in fake.batches[3]] == [3.0, 4.0]


async def test_texts_join_the_oldest_nearest_its_length_first() -> None:
    """In arrival order the batch after the first would be 9, 3, 2 (padded to 9: 27 tokens, 13
    of them padding); nearest the oldest's 9 tokens it is 9, 8, 10 (30 tokens, 3 padding)."""
    fake = FakeInstance()
    b, _ = batcher([fake], max_batch=3)
    b.submit(request([0.0], length=5))
    await settle()
    for length in (9, 3, 2, 8, 10, 16):
        b.submit(request([float(length)], length=length))
    fake.release(0)
    await settle()
    assert [f["x"].item() for f in fake.batches[1]] == [9.0, 8.0, 10.0]
    fake.release(1)
    await settle()
    assert [f["x"].item() for f in fake.batches[2]] == [3.0, 2.0, 16.0], "the oldest left always goes first"


async def test_lengths_are_compared_within_a_window_of_the_oldest() -> None:
    fake = FakeInstance()
    b, _ = batcher([fake], max_batch=2)  # a window of LENGTH_WINDOW x 2 = 8 requests behind the oldest
    b.submit(request([0.0], length=5))
    await settle()
    for length in (30, 45, 50, 55, 60, 65, 70, 75, 80, 29):
        b.submit(request([float(length)], length=length))
    fake.release(0)
    await settle()
    assert [f["x"].item() for f in fake.batches[1]] == [30.0, 45.0], "29 is past the window"


async def test_length_never_outranks_priority() -> None:
    fake = FakeInstance()
    b, _ = batcher([fake], max_batch=2, levels=2)
    b.submit(request([0.0], length=5))
    await settle()
    b.submit(request([1.0], length=10, priority=1))
    b.submit(request([2.0], length=10, priority=2))
    b.submit(request([3.0], length=30, priority=1))
    fake.release(0)
    await settle()
    assert [f["x"].item() for f in fake.batches[1]] == [1.0, 3.0]


async def test_other_models_batch_in_arrival_order() -> None:
    fake = FakeInstance()
    b, _ = batcher([fake], max_batch=3)
    b.submit(request([0.0]))
    await settle()
    for value in (1.0, 2.0, 3.0, 4.0):
        b.submit(request([value]))
    fake.release(0)
    await settle()
    assert [f["x"].item() for f in fake.batches[1]] == [1.0, 2.0, 3.0]


async def test_a_failing_batch_fails_only_its_requests() -> None:
    fake = FakeInstance()
    b, stats = batcher([fake], max_batch=1)
    bad, good = request([1.0]), request([2.0])
    b.submit(bad)
    await settle()
    b.submit(good)
    fake.fail_next = True
    fake.release(0)
    with pytest.raises(EngineError, match="boom"):
        await bad.future
    await settle()
    fake.release(1)
    assert (await good.future)["y"].item() == 4.0
    assert stats.failures["engine_error"] == 1


async def test_without_merging_every_request_runs_alone() -> None:
    fake = FakeInstance()
    b, _ = batcher([fake], merge=False)
    b.submit(request([0.0]))
    await settle()
    b.submit(request([1.0]))
    b.submit(request([2.0]))
    fake.release(0)
    await settle()
    assert fake.sizes()[1] == [1]


async def test_preserve_ordering_holds_later_results() -> None:
    slow, fast = FakeInstance("slow"), FakeInstance("fast")
    b, _ = batcher([fast, slow], max_batch=1, preserve_ordering=True)
    first, second = request([1.0]), request([2.0])
    b.submit(first)
    b.submit(second)
    await settle()
    second_instance = fast if fast.batches and fast.batches[0][0]["x"].item() == 2.0 else slow
    first_instance = slow if second_instance is fast else fast
    assert b.requests_running == 2 and b.requests_held == 0
    second_instance.release(0)
    await settle()
    assert not second.future.done()  # finished, but held until the first is answered
    assert b.requests_running == 1 and b.requests_held == 1
    first_instance.release(0)
    await settle()
    assert first.future.done() and second.future.done()
    assert b.requests_running == 0 and b.requests_held == 0


async def test_a_result_held_for_ordering_past_its_deadline_is_answered_late() -> None:
    """No result comes after its deadline, held behind an earlier request or not. On a clock of
    the test's own: a machine that stalls 50 ms cannot make the batch itself finish late."""
    slow, fast = FakeInstance("slow"), FakeInstance("fast")
    now = [time.perf_counter_ns()]
    stats = ModelStatistics()
    b = Batcher(BatchPolicy(1, (), 0, None), QueueSettings(preserve_ordering=True), [fast, slow], stats,
                clock=lambda: now[0])
    first = request([1.0])
    b.submit(first)
    await settle()
    second = request([2.0], deadline_ns=now[0] + 50_000_000)
    b.submit(second)
    await settle()
    second_instance = fast if fast.batches[0][0]["x"].item() == 2.0 else slow
    first_instance = slow if second_instance is fast else fast
    second_instance.release(0)  # done within its deadline, held behind the first
    await settle()
    now[0] += 100_000_000  # its deadline passes while it is held
    first_instance.release(0)
    await settle()
    assert (await first.future)["y"].tolist() == [[2.0]]
    with pytest.raises(DeadlineExceeded, match="held behind an earlier one"):
        await second.future
    assert stats.failures["deadline"] == 1 and stats.success.count == 1


async def test_drain_runs_what_is_queued() -> None:
    fake = FakeInstance()
    b, _ = batcher([fake], max_batch=1)
    requests = [request([float(i)]) for i in range(3)]
    for r in requests:
        b.submit(r)
    draining = asyncio.create_task(b.drain())
    for i in range(3):
        await settle()
        fake.release(i)
    await asyncio.wait_for(draining, 1.0)
    assert all(r.future.done() and not r.future.exception() for r in requests)


async def test_success_time_and_the_request_histogram_read_one_clock_from_receipt() -> None:
    """The statistics' success duration and the request histogram (/metrics) count the same
    requests over the same span, from receipt (before admission) to results; failures in neither."""
    fake = FakeInstance()
    b, stats = batcher([fake])
    received = time.perf_counter_ns() - 5_000_000  # admission took 5 ms before queueing
    ok = request([1.0])
    ok.received_ns = received
    b.submit(ok)
    await settle()
    fake.release()
    await ok.future
    bad = request([2.0])
    fake.fail_next = True
    b.submit(bad)
    await settle()
    fake.release()
    with pytest.raises(EngineError):
        await bad.future
    assert stats.success.count == stats.request_seconds.count == 1 and stats.fail.count == 1
    assert stats.success.ns >= 5_000_000
    assert stats.request_seconds.sum == pytest.approx(stats.success.ns / 1e9, rel=1e-12)
    assert stats.queue.ns < stats.success.ns - 4_000_000  # the queue's clock starts at arrival, not receipt
