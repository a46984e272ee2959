"""The link between a front-end process and the server process, over a real Unix socket: frames
cut anywhere reassemble, tensors cross inline or in shared memory and come back equal, typed
errors cross as themselves, a cancelled call is cancelled on the far side and its slots freed,
a lost server process fails the calls waiting on it, and a call started with no coroutine is
answered through its future (a withdrawn one stopped there)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

from server import link, link_frames
from server.arena import MIN_SLOT, Arena
from server.errors import DeadlineExceeded, InvalidInput, QueueFull, ServerBusy, Unavailable
from server.link import LinkClient, PlaneLink
from server.link_frames import (
    Frame,
    FrameReader,
    error_from,
    error_header,
    frame_bytes,
    free_slots,
    pack_tensors,
    unpack_tensors,
)
from server.protocol.datatypes import BYTES, DATATYPES, numpy_dtype
from server.scheduler.request import RequestRecord
from tests.unit.waiting import eventually


class FakeModel:
    version = 3


class FakePlane:
    """The data plane as the link uses it: doubles every input, or raises what it is told."""

    def __init__(self) -> None:
        self.raise_next: BaseException | None = None
        self.hold = asyncio.Event()
        self.hold.set()
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.computing = False  # a withdrawn call runs on (its batch was handed to an instance)
        self.withdrawn = 0
        self.seen: list[dict[str, Any]] = []

    def admit(self, name: str, version: str | None) -> FakeModel:
        if name == "missing":
            raise Unavailable("no model 'missing'")
        return FakeModel()

    def check_inputs(self, model: FakeModel, declared: dict[str, tuple[str, list[int]]]) -> int:
        return next(iter(declared.values()))[1][0]

    def start_call(self, model: FakeModel, inputs: dict[str, tuple[str, np.ndarray]], parameters: dict[str, Any],
                   outputs: list[str] | None, record: RequestRecord | None, received_ns: int | None,
                   batch_size: int | None) -> FakeCall:
        return FakeCall(asyncio.ensure_future(
            self._run(model, inputs, parameters, outputs, record, received_ns, batch_size)), self)

    async def _run(self, model: FakeModel, inputs: dict[str, tuple[str, np.ndarray]], parameters: dict[str, Any],
                   outputs: list[str] | None, record: RequestRecord | None, received_ns: int | None,
                   batch_size: int | None) -> list[tuple[str, str, np.ndarray]]:
        self.seen.append({"parameters": parameters, "outputs": outputs, "batch_size": batch_size,
                          "received_ns": received_ns})
        self.started.set()
        try:
            await self.hold.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        if self.raise_next is not None:
            error, self.raise_next = self.raise_next, None
            raise error
        if record is not None:
            record.queue_ns, record.compute_ns = 5, 7
        return [(f"{name}_doubled", datatype, array * 2 if datatype != "BYTES" else array)
                for name, (datatype, array) in inputs.items()]


class FakeCall(NamedTuple):
    """A started call as the link reads it: a future, `outputs` (here the results as they are)
    and `withdraw`, which drops the call unless its plane says it is computing."""

    future: asyncio.Future[list[tuple[str, str, np.ndarray]]]
    plane: FakePlane

    def outputs(self, results: list[tuple[str, str, np.ndarray]]) -> list[tuple[str, str, np.ndarray]]:
        return results

    def withdraw(self) -> None:
        self.plane.withdrawn += 1
        if not self.plane.computing:
            self.future.cancel()


async def _raw(*arguments: Any) -> tuple[bytes, int | None]:
    return b'{"raw": true}', None


Linked = tuple[LinkClient, FakePlane, list[PlaneLink]]


@contextlib.asynccontextmanager
async def link_pair(path: Path) -> AsyncIterator[Linked]:
    """A front end's link to a server process's ends (one per connection) over `path`."""
    plane = FakePlane()
    ends: list[PlaneLink] = []

    def end() -> PlaneLink:
        ends.append(PlaneLink(plane, _raw))  # type: ignore[arg-type]
        return ends[-1]

    server = await asyncio.get_running_loop().create_unix_server(end, str(path))
    lost = asyncio.Event()
    client = await LinkClient.connect(str(path), lost.set)
    client.lost_event = lost  # type: ignore[attr-defined]
    try:
        yield client, plane, ends
    finally:
        client.close()
        server.close()
        await server.wait_closed()


@pytest.fixture
async def linked(tmp_path: Path) -> AsyncIterator[Linked]:
    async with link_pair(tmp_path / "link.sock") as pair:
        yield pair


def test_frames_cut_anywhere_reassemble() -> None:
    stream = b"".join(bytes(p) for p in frame_bytes({"i": 1, "k": "infer"}, [b"abc", b"de"]))
    stream += b"".join(bytes(p) for p in frame_bytes({"i": 2}))
    for cut in range(len(stream) + 1):
        reader = FrameReader()
        frames = reader.feed(stream[:cut]) + reader.feed(stream[cut:])
        assert [f.header for f in frames] == [{"i": 1, "k": "infer"}, {"i": 2}]
        assert bytes(frames[0].payload) == b"abcde" and bytes(frames[1].payload) == b""


@pytest.mark.parametrize("datatype", [d for d in DATATYPES if d != BYTES])
@pytest.mark.parametrize("shape", [[2, 3], [], [0, 4], [MIN_SLOT]])  # the last, a slot in the arena
def test_every_numeric_tensor_crosses_as_it_was_sent(datatype: str, shape: list[int]) -> None:
    arena = Arena.create(8 * MIN_SLOT * 8, "batchline-test")  # the largest: MIN_SLOT of 8 bytes
    try:
        array = (np.arange(int(np.prod(shape))) % 3).astype(numpy_dtype(datatype)).reshape(shape)
        metas, payload, slots = pack_tensors([("t", datatype, array)], arena)
        assert bool(slots) == (array.nbytes >= MIN_SLOT)
        crossed_as: dict[bool, np.ndarray] = {}
        for copy in (False, True):
            [(name, crossed_type, crossed)] = unpack_tensors(metas, memoryview(b"".join(payload)), arena, copy)
            assert (name, crossed_type, crossed.dtype, crossed.shape) == ("t", datatype, array.dtype, array.shape)
            np.testing.assert_array_equal(crossed, array)
            crossed_as[copy] = crossed
        if slots:  # the sender reuses a freed slot: a copy keeps what was sent, a view does not
            arena.slot(slots[0], array.nbytes)[:] = b"\x01" * array.nbytes
            assert np.array_equal(crossed_as[True], array) and not np.array_equal(crossed_as[False], array)
        free_slots(arena, slots)
    finally:
        arena.forget_file()


def test_a_bool_crosses_as_zero_or_one_whatever_byte_it_was_held_in() -> None:
    held = np.array([0, 2, 1], dtype=np.uint8).view(np.bool_)
    metas, payload, _ = pack_tensors([("b", "BOOL", held)], None)
    [(_, _, crossed)] = unpack_tensors(metas, memoryview(b"".join(payload)), None, copy=False)
    assert crossed.view(np.uint8).tolist() == [0, 1, 1]


def test_a_stream_out_of_step_is_refused() -> None:
    with pytest.raises(ValueError, match="out of step"):
        FrameReader().feed(b"\xff\xff\xff\xff\0\0\0\0")


def test_typed_errors_cross_as_themselves() -> None:
    busy = error_from(error_header(1, ServerBusy("too many", retry_after_s=4.0))["e"])
    assert type(busy) is ServerBusy and busy.message == "too many" and busy.retry_after == "4"
    assert type(error_from(error_header(1, DeadlineExceeded("late"))["e"])) is DeadlineExceeded
    unknown = error_from(error_header(1, KeyError("x"))["e"])  # not a server error: no detail leaks
    assert type(unknown) is RuntimeError and "x" not in str(unknown)


def test_an_error_quoting_a_huge_name_crosses_cut_short() -> None:
    long = error_from(error_header(1, InvalidInput("no input " + "x" * (2 * link_frames.MAX_MESSAGE_CHARS)))["e"])
    assert type(long) is InvalidInput and len(long.message) == link_frames.MAX_MESSAGE_CHARS + 3


def test_a_header_that_cannot_cross_is_refused_as_it_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    deep: list[Any] = []
    for _ in range(300):  # orjson reads 1,024 levels and writes 254
        deep = [deep]
    with pytest.raises(InvalidInput, match="cannot be passed on to the server process"):
        frame_bytes({"p": {"deep": deep}})
    monkeypatch.setattr(link_frames, "MAX_HEADER_BYTES", 100)
    with pytest.raises(InvalidInput, match="at most 100 can be passed on"):
        frame_bytes({"p": {"note": "x" * 100}})


async def test_a_call_whose_header_cannot_cross_is_refused_and_the_link_serves_on(
    linked: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its own call gets a 400 (a header the server process's reader would refuse would close
    the link, failing every call on it); slots it took are freed, and output slots still to be
    given back go with the next frame."""
    client, _, ends = linked
    monkeypatch.setattr(link_frames, "MAX_HEADER_BYTES", 4096)
    client._released = [7]
    large = np.ones((1, MIN_SLOT // 4), np.float32)
    with pytest.raises(InvalidInput, match="parameters and names take"):
        await client.infer("m", None, [("x", "FP32", large)], {}, ["y" * 5000], None, 0)
    assert client._released == [7] and client._arena is not None and client._arena.allocate(1) == 0
    client._arena.free(0)
    client._released = []  # no such slot was taken on the far side
    _, outputs = await client.infer("m", None, [("x", "FP32", large)], {}, None, None, 0)
    np.testing.assert_array_equal(outputs[0][2], large * 2)
    assert not client.lost and ends[0].transport is not None


async def test_small_tensors_cross_inline_and_large_ones_in_shared_memory(linked: Any) -> None:
    client, plane, ends = linked
    small = np.arange(6, dtype=np.float32).reshape(2, 3)
    large = np.arange(MIN_SLOT // 4 * 2, dtype=np.float32).reshape(2, -1)  # 128 KiB: a slot each way
    words = np.array([[b"a"], [b"\xffbytes"]], dtype=object)
    record = RequestRecord(request_id="r1")
    deep: list[Any] = []
    for _ in range(300):  # a client's own parameter, nested past what the link's encoder writes
        deep = [deep]
    served, outputs = await client.infer(
        "m", "3", [("small", "FP32", small), ("large", "FP32", large), ("words", "BYTES", words)],
        {"priority": 1, "mine": deep, "note": "x" * (link_frames.MAX_HEADER_BYTES + 1)}, ["small_doubled"], record, 123)
    assert served == 3
    answer = {name: (datatype, array) for name, datatype, array in outputs}
    np.testing.assert_array_equal(answer["small_doubled"][1], small * 2)
    np.testing.assert_array_equal(answer["large_doubled"][1], large * 2)
    assert answer["words_doubled"][0] == "BYTES" and answer["words_doubled"][1].tolist() == words.tolist()
    assert plane.seen == [{"parameters": {"priority": 1}, "outputs": ["small_doubled"], "batch_size": 2,
                           "received_ns": 123}]
    assert (record.request_id, record.model_version, record.queue_ns, record.compute_ns) == ("r1", 3, 5, 7)
    # `large` crossed in a slot each way: the input's freed when the answer came, the output's once read
    inputs, outputs_arena = client._arena, ends[0]._arena
    assert inputs is not None and outputs_arena is not None
    assert inputs._top == outputs_arena._top == large.nbytes  # one slot carved on each side, no more
    assert inputs.allocate(large.nbytes) == 0
    await asyncio.sleep(0.05)
    assert outputs_arena.allocate(large.nbytes) == 0


async def test_errors_come_back_typed(linked: Any) -> None:
    client, plane, _ = linked
    with pytest.raises(Unavailable, match="no model 'missing'"):
        await client.infer("missing", None, [("x", "FP32", np.zeros((1, 2), np.float32))], {}, None, None, 0)
    plane.raise_next = QueueFull("full", retry_after_s=3.0)
    with pytest.raises(QueueFull, match="full") as raised:
        await client.infer("m", None, [("x", "FP32", np.zeros((1, 2), np.float32))], {}, None, None, 0)
    assert raised.value.retry_after == "3"
    plane.raise_next = InvalidInput("bad")
    with pytest.raises(InvalidInput, match="bad"):
        await client.infer("m", None, [("x", "FP32", np.zeros((1, 2), np.float32))], {}, None, None, 0)


async def held_call(client: LinkClient, plane: FakePlane, array: np.ndarray) -> asyncio.Task[Any]:
    """A call of `array`, running in the server process, held there until `plane.hold` is set."""
    plane.hold.clear()
    call = asyncio.create_task(client.infer("m", None, [("x", "FP32", array)], {}, None, None, 0))
    await asyncio.wait_for(plane.started.wait(), 5)
    return call


async def test_a_cancelled_call_is_cancelled_there_and_its_slots_freed(linked: Any) -> None:
    client, plane, ends = linked
    call = await held_call(client, plane, np.ones((1, MIN_SLOT // 4), np.float32))
    assert client._arena is not None and client._arena.allocate(1) == MIN_SLOT  # slot 0 still held
    call.cancel()
    await asyncio.wait_for(plane.cancelled.wait(), 5)
    with pytest.raises(asyncio.CancelledError):
        await call
    for _ in range(100):
        if not client._pending:
            break
        await asyncio.sleep(0.01)
    assert not client._pending and not ends[0]._calls
    assert client._arena.allocate(1) == 0  # freed once the server process answered the cancellation


async def test_a_call_cancelled_while_computing_holds_its_slots_until_it_ends(linked: Any) -> None:
    """Its inputs may be read until its batch ends: the server process answers it only then,
    and the front end reuses its input slot only then."""
    client, plane, ends = linked
    plane.computing = True
    call = await held_call(client, plane, np.ones((1, MIN_SLOT // 4), np.float32))
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call  # its caller is free at once
    await eventually(lambda: plane.withdrawn == 1, "the server process is told")
    await asyncio.sleep(0.05)
    assert not plane.cancelled.is_set() and ends[0]._calls and client._pending
    assert client._arena is not None and client._arena.allocate(1) == MIN_SLOT  # slot 0 still held
    plane.hold.set()  # its batch ends
    await eventually(lambda: not client._pending and not ends[0]._calls, "the call is answered")
    assert client._arena.allocate(1) == 0  # freed once answered


async def test_calls_fail_when_the_server_process_is_gone(linked: Any) -> None:
    client, plane, ends = linked
    call = await held_call(client, plane, np.zeros((1, 2), np.float32))
    ends[0].transport.close()
    with pytest.raises(Unavailable, match="server process is gone"):
        await call
    await asyncio.wait_for(client.lost_event.wait(), 5)
    with pytest.raises(Unavailable):
        await client.infer("m", None, [("x", "FP32", np.zeros((1, 2), np.float32))], {}, None, None, 0)


async def test_a_raw_call_is_answered_by_the_server_process(linked: Any) -> None:
    client, _, _ = linked
    assert await client.infer_raw("m", None, b"{}", None, None, 0) == (b'{"raw": true}', None)


async def test_without_shared_memory_everything_goes_inline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def no_room(size: int, prefix: str = "") -> Arena:
        raise OSError("no space left on device")

    monkeypatch.setattr(link.Arena, "create", staticmethod(no_room))
    async with link_pair(tmp_path / "inline.sock") as (client, _, _):
        large = np.ones((1, MIN_SLOT // 2), np.float32)
        _, outputs = await client.infer("m", None, [("x", "FP32", large)], {}, None, None, 0)
        np.testing.assert_array_equal(outputs[0][2], large * 2)
        assert client._arena is None and client._peer_arena is None


class Recorded:
    """A transport that keeps what is written to it."""

    def __init__(self) -> None:
        self.written = b""

    def writelines(self, parts: list[bytes]) -> None:
        self.written += b"".join(bytes(p) for p in parts)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


async def test_a_call_cancelled_before_it_starts_is_still_answered() -> None:
    """Its call and its cancellation in one read: the call never starts, and its answer
    (which frees the front end's input slots) must come all the same."""
    plane = FakePlane()
    end = PlaneLink(plane, _raw)  # type: ignore[arg-type]
    transport = Recorded()
    end.connection_made(transport)  # type: ignore[arg-type]
    x = np.zeros((1, 2), np.float32)
    metas = [["x", "FP32", [1, 2], "i", 0, x.nbytes]]
    stream = b"".join(bytes(p) for p in frame_bytes({"k": "infer", "i": 7, "m": "m", "v": None, "in": metas, "p": {},
                                                     "o": None, "t": 0}, [x.tobytes()]))
    stream += b"".join(bytes(p) for p in frame_bytes({"k": "cancel", "i": 7}))
    end.data_received(stream)
    await eventually(lambda: bool(transport.written), "the cancelled call is answered")
    answers = FrameReader().feed(transport.written)
    assert [a.header for a in answers] == [{"i": 7, "e": ["Cancelled", "the call was cancelled", None]}]
    assert not end._calls and not plane.seen  # never ran


async def test_outputs_answered_as_their_caller_is_cancelled_are_released(linked: Any) -> None:
    client, plane, ends = linked
    large = np.ones((1, MIN_SLOT // 4), np.float32)
    call = await held_call(client, plane, large)
    answered = asyncio.get_running_loop().create_future()
    original = client.frame_received

    def answer_then_cancel(frame: Frame) -> None:
        original(frame)  # the answer lands ...
        if "out" in frame.header:
            call.cancel()  # ... and its caller is cancelled before it reads it
            answered.set_result(frame.header)

    client.frame_received = answer_then_cancel  # type: ignore[method-assign]
    plane.hold.set()
    header = await asyncio.wait_for(answered, 5)
    with pytest.raises(asyncio.CancelledError):
        await call
    assert header["out"][0][3] == "s"  # its output was in a slot ...
    await asyncio.sleep(0.05)
    assert ends[0]._arena is not None and ends[0]._arena.allocate(large.nbytes) == 0  # ... given back


async def test_outputs_go_inline_when_the_front_end_cannot_map_the_server_arena(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    attach = link.Arena.attach

    def only_inputs(path: str) -> Arena:
        if "batchline-out" in path:
            raise OSError("permission denied")
        return attach(path)

    monkeypatch.setattr(link.Arena, "attach", staticmethod(only_inputs))
    async with link_pair(tmp_path / "half.sock") as (client, _, ends):
        large = np.ones((1, MIN_SLOT // 2), np.float32)
        _, outputs = await client.infer("m", None, [("x", "FP32", large)], {}, None, None, 0)
        np.testing.assert_array_equal(outputs[0][2], large * 2)
        assert ends[0]._arena is None and client._arena is not None  # inputs still in shared memory
    leftovers = [name for name in os.listdir("/dev/shm") if name.startswith(f"batchline-out-{os.getpid()}-")]
    assert not leftovers


def test_whole_frames_are_views_and_a_split_one_is_copied_once(monkeypatch: pytest.MonkeyPatch) -> None:
    big = bytes(range(256)) * 64
    stream = b"".join(bytes(p) for p in frame_bytes({"i": 1}, [big])) + b"".join(bytes(p) for p in frame_bytes({"i": 2}))
    frames = FrameReader().feed(stream)
    assert [f.header for f in frames] == [{"i": 1}, {"i": 2}] and frames[0].payload.obj is stream, "no copy"
    huge = b"".join(bytes(p) for p in frame_bytes({"i": 3}, [bytes(200_000)]))
    small_after_huge = huge + b"".join(bytes(p) for p in frame_bytes({"i": 4}, [b"tiny"]))
    large, small = FrameReader().feed(small_after_huge)
    assert large.payload.obj is small_after_huge, "a payload that is most of what was read is a view"
    assert small.payload.obj is not small_after_huge and bytes(small.payload) == b"tiny", (
        "a small payload is copied: a view would keep the whole read alive while it waits")
    reader = FrameReader()
    joined = 0
    real_bytes = bytes

    def counted(source: object = b"") -> bytes:
        nonlocal joined
        joined += isinstance(source, bytearray)
        return real_bytes(source)  # type: ignore[call-overload]

    monkeypatch.setattr("server.link_frames.bytes", counted, raising=False)
    pieces = [stream[i:i + 100] for i in range(0, len(stream), 100)]
    frames = [frame for piece in pieces for frame in reader.feed(piece)]
    assert [f.header for f in frames] == [{"i": 1}, {"i": 2}] and bytes(frames[0].payload) == big
    # once for the first frame, when its last piece comes; once for the second, which that piece cut
    assert joined == 2, f"the pending bytes were joined {joined} times for {len(pieces)} pieces"


async def test_a_started_call_is_answered_through_its_future_its_outputs_copied_out(linked: Any) -> None:
    """What a front end's inline answer reads: no coroutine, the answer decoded as it lands."""
    client, _, ends = linked
    large = np.ones((1, MIN_SLOT // 4), np.float32)
    call = client.start("m", None, [("x", "FP32", large)], {}, None, None, 0)
    version, outputs = await asyncio.wait_for(call.future, 5)
    assert version == 3 and outputs[0][:2] == ("x_doubled", "FP32")
    np.testing.assert_array_equal(outputs[0][2], large * 2)
    assert not client._pending and client._arena is not None and client._arena.allocate(1) == 0, "inputs freed"
    await asyncio.sleep(0.05)
    assert ends[0]._arena is not None and ends[0]._arena.allocate(large.nbytes) == 0, "its output slot given back"
    np.testing.assert_array_equal(outputs[0][2], large * 2)  # a copy: the slot's reuse does not touch it


async def test_a_withdrawn_call_is_stopped_there_and_its_late_answer_released_unread(linked: Any) -> None:
    client, plane, ends = linked
    plane.computing = True  # it runs to its end there, and is answered then
    plane.hold.clear()
    large = np.ones((1, MIN_SLOT // 4), np.float32)
    call = client.start("m", None, [("x", "FP32", large)], {}, None, None, 0)
    await asyncio.wait_for(plane.started.wait(), 5)
    call.withdraw()
    assert call.future.cancelled()
    await eventually(lambda: plane.withdrawn == 1, "the server process is told")
    plane.hold.set()
    await eventually(lambda: not client._pending and not ends[0]._calls, "the call is answered")
    assert client._arena is not None and client._arena.allocate(1) == 0, "its input slot freed once answered"
    await asyncio.sleep(0.05)
    assert ends[0]._arena is not None and ends[0]._arena.allocate(large.nbytes) == 0, "its output given back unread"


async def test_a_started_calls_error_is_its_futures(linked: Any) -> None:
    client, plane, _ = linked
    plane.raise_next = InvalidInput("bad")
    call = client.start("m", None, [("x", "FP32", np.zeros((1, 2), np.float32))], {}, None, None, 0)
    with pytest.raises(InvalidInput, match="bad"):
        await asyncio.wait_for(call.future, 5)
    call.withdraw()  # after its answer: nothing to stop
    await asyncio.sleep(0.05)
    assert not client._pending
