"""The registry of clients' shared-memory regions: what it opens, reads and writes, what it
refuses (an object made smaller among it), what its copies hold, and that an unregistered region
stays readable for whoever still holds it."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import threading
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from server import shared_memory
from server.errors import InvalidInput, ServerBusy, Unsupported
from server.protocol.shared_memory import RegionRef, region_ref
from server.shared_memory import SystemSharedMemory, write_outputs


def _object(folder: Path, key: str, data: bytes) -> None:
    (folder / key).write_bytes(data)


@pytest.fixture
def regions(tmp_path: Path) -> SystemSharedMemory:
    return SystemSharedMemory(allowed=True, max_input_bytes=1 << 20, folder=str(tmp_path))


def _read(regions: SystemSharedMemory, ref: RegionRef, what: str = "input 'x'") -> memoryview:
    """One input's copy, as a request of one input in shared memory reads it."""
    return regions.read_inputs([(ref, what)])[0]


def _window_bytes(folder: Path, key: str) -> bytes:
    return (folder / key).read_bytes()


def test_a_region_is_registered_read_written_and_unregistered(regions: SystemSharedMemory, tmp_path: Path) -> None:
    _object(tmp_path, "input0", bytes(range(64)))
    regions.register("in", "/input0", offset=16, byte_size=32)
    assert regions.status(None) == [{"name": "in", "key": "/input0", "offset": 16, "byte_size": 32}]
    assert regions.status("in") == regions.status(None)
    assert bytes(_read(regions, RegionRef("in", 8, offset=4), "input 'x'")) == bytes(range(20, 28))
    targets = regions.output_targets({"y": RegionRef("in", 4)})
    assert write_outputs([("y", "UINT8", np.full(4, 255, np.uint8))], targets) == {"y": ("in", 4)}
    assert _window_bytes(tmp_path, "input0")[16:20] == b"\xff\xff\xff\xff"  # written into the client's object
    regions.unregister("in")
    assert regions.status(None) == []
    with pytest.raises(InvalidInput, match="no shared-memory region 'in'"):
        _read(regions, RegionRef("in", 4), "input 'x'")
    regions.unregister("in")  # again: not an error, as in Triton


def test_output_targets_are_the_windows_of_every_output_or_a_refusal(regions: SystemSharedMemory, tmp_path: Path) -> None:
    _object(tmp_path, "out", bytes(32))
    regions.register("r", "out", 0, 32)
    targets = regions.output_targets({"y": RegionRef("r", 16), "z": RegionRef("r", 8, offset=16)})
    assert {name: (window.region.name, window.start, window.byte_size) for name, window in targets.items()} == {
        "y": ("r", 0, 16), "z": ("r", 16, 8)}
    write_outputs([("z", "INT8", np.full(8, 7, np.int8))], targets)
    assert _window_bytes(tmp_path, "out") == bytes(16) + b"\x07" * 8 + bytes(8), "z's window starts at its offset"
    assert regions.output_targets({}) == {}
    with pytest.raises(InvalidInput, match="no shared-memory region 'gone'"):
        regions.output_targets({"y": RegionRef("r", 16), "z": RegionRef("gone", 8)})
    with pytest.raises(InvalidInput, match="output 'y'"):
        regions.output_targets({"y": RegionRef("r", 64)})  # past the region's end


def test_a_region_is_read_from_its_own_offset_in_its_object(regions: SystemSharedMemory, tmp_path: Path) -> None:
    data = np.arange(5000, dtype=np.uint32).tobytes()
    _object(tmp_path, "big", data)
    regions.register("r", "big", offset=4 * 4100 + 4, byte_size=16)
    assert np.frombuffer(_read(regions, RegionRef("r", 16), "x"), np.uint32).tolist() == [4101, 4102, 4103, 4104]


def test_unregistering_leaves_a_held_region_readable_and_writable(regions: SystemSharedMemory, tmp_path: Path) -> None:
    _object(tmp_path, "obj", np.arange(4, dtype=np.float32).tobytes())
    regions.register("r", "obj", 0, 16)
    array = np.frombuffer(_read(regions, RegionRef("r", 16), "input 'x'"), np.float32)  # a request's input
    targets = regions.output_targets({"y": RegionRef("r", 16)})  # a request's output target
    regions.unregister(None)
    assert array.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert write_outputs([("y", "FP32", np.full(4, 7, np.float32))], targets) == {"y": ("r", 16)}
    assert np.frombuffer(_window_bytes(tmp_path, "obj"), np.float32).tolist() == [7.0] * 4
    with pytest.raises(InvalidInput, match="no shared-memory region"):
        _read(regions, RegionRef("r", 16), "input 'x'")


def test_an_input_is_the_requests_own_copy_capped_at_the_body_limit(
        regions: SystemSharedMemory, tmp_path: Path) -> None:
    _object(tmp_path, "obj", bytes(2 << 20))
    regions.register("r", "obj", 0, 2 << 20)
    array = np.frombuffer(_read(regions, RegionRef("r", 16), "input 'x'"), np.float32)
    array[0] = 1.0  # an engine working in place changes its copy, not the client's memory
    (tmp_path / "obj").write_bytes(b"\x01" * (2 << 20))  # nor does the client change what the request read
    assert array.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert _window_bytes(tmp_path, "obj")[:16] == b"\x01" * 16
    with pytest.raises(InvalidInput, match="input 'x': 2097152 bytes of shared memory is over the server's limit"):
        _read(regions, RegionRef("r", 2 << 20), "input 'x'")
    assert regions.output_targets({"y": RegionRef("r", 2 << 20)})["y"].byte_size == 2 << 20  # outputs: the region's


def test_an_object_made_smaller_after_registering_is_refused_not_touched(
        regions: SystemSharedMemory, tmp_path: Path) -> None:
    """Its region was mapped once, and a read or write past the object's new end ended the
    server (SIGBUS); reads and writes through its file are refused instead."""
    _object(tmp_path, "obj", bytes(64))
    regions.register("r", "obj", 0, 64)
    targets = regions.output_targets({"y": RegionRef("r", 16, offset=32)})
    os.truncate(tmp_path / "obj", 40)
    with pytest.raises(InvalidInput, match="shared-memory object 'obj' no longer holds 64 bytes: it was made smaller"):
        _read(regions, RegionRef("r", 32, offset=32), "input 'x'")
    with pytest.raises(InvalidInput, match="no longer holds 48 bytes"):
        write_outputs([("y", "FP32", np.ones(4, np.float32))], targets)
    assert (tmp_path / "obj").stat().st_size == 40, "a refused write does not grow the object"
    assert bytes(_read(regions, RegionRef("r", 8, offset=32), "input 'x'")) == bytes(8)  # what it still holds
    os.truncate(tmp_path / "obj", 64)  # grown again: served again
    assert write_outputs([("y", "FP32", np.ones(4, np.float32))], targets) == {"y": ("r", 16)}


def test_copies_of_inputs_in_flight_are_bounded(tmp_path: Path) -> None:
    regions = SystemSharedMemory(allowed=True, max_input_bytes=1 << 20, max_copied_bytes=100, folder=str(tmp_path))
    _object(tmp_path, "obj", bytes(range(256)))
    regions.register("r", "obj", 0, 256)
    alone = _read(regions, RegionRef("r", 200), "input 'x'")  # over the bound, but alone: let in
    assert regions.copied_bytes == 200
    with pytest.raises(ServerBusy, match="inputs copied from shared memory .* hold 200 bytes"):
        _read(regions, RegionRef("r", 1), "input 'x'")
    del alone  # the request's arrays are gone: so is what they held
    both = regions.read_inputs([(RegionRef("r", 60), "input 'x'"), (RegionRef("r", 60, offset=60), "input 'y'")])
    assert [len(copy) for copy in both] == [60, 60] and regions.copied_bytes == 64 + 60  # one request: let in
    assert bytes(both[1]) == bytes(range(60, 120))
    assert np.frombuffer(both[1], np.uint8).ctypes.data % 16 == 0  # aligned as numpy aligns its arrays
    del both
    held = [_read(regions, RegionRef("r", 60), "input 'x'"),
            np.frombuffer(_read(regions, RegionRef("r", 40), "input 'x'"), np.float32)]
    assert regions.copied_bytes == 100
    with pytest.raises(ServerBusy):
        _read(regions, RegionRef("r", 1), "input 'x'")
    held.pop()  # an array over a copy holds it too, until it goes
    assert regions.copied_bytes == 60
    assert _read(regions, RegionRef("r", 40), "input 'x'").nbytes == 40


def test_a_copy_freed_by_a_collection_in_a_thread_that_holds_the_registry_gives_its_bytes_back(
        regions: SystemSharedMemory, tmp_path: Path) -> None:
    """A request's arrays in a reference cycle are freed by a garbage collection, which may run
    in any thread at any allocation, one holding the registry's lock among them."""
    _object(tmp_path, "obj", bytes(64))
    regions.register("r", "obj", 0, 64)
    cycle: list[Any] = [_read(regions, RegionRef("r", 64), "input 'x'")]
    cycle.append(cycle)
    del cycle
    collected = threading.Event()

    def collect() -> None:
        with regions._lock:  # as a registration refused under it allocates, and a collection can run there
            gc.collect()
        collected.set()

    threading.Thread(target=collect, daemon=True).start()
    assert collected.wait(5), "the collection waited for the lock its own thread held"
    assert regions.copied_bytes == 0


def test_a_region_holds_its_objects_file_until_the_last_request_lets_go(
        regions: SystemSharedMemory, tmp_path: Path) -> None:
    def files_open_on(path: Path) -> int:
        """This process's descriptors of `path` (others' opened meanwhile do not count)."""
        found = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                found += os.readlink(f"/proc/self/fd/{fd}") == str(path)
        return found

    obj = tmp_path / "obj"
    _object(tmp_path, "obj", bytes(64))
    regions.register("r", "obj", 0, 64)
    assert files_open_on(obj) == 1
    targets = regions.output_targets({"y": RegionRef("r", 4)})
    regions.unregister("r")
    assert files_open_on(obj) == 1  # a request still holds it
    del targets
    assert files_open_on(obj) == 0
    with pytest.raises(InvalidInput, match="does not fit"):
        regions.register("r", "obj", 60, 8)
    assert files_open_on(obj) == 0  # a refused registration keeps nothing open


def test_a_file_error_is_a_refusal_that_names_the_object(
        regions: SystemSharedMemory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _object(tmp_path, "obj", bytes(64))
    regions.register("r", "obj", 0, 64)
    targets = regions.output_targets({"y": RegionRef("r", 4)})

    def failing(*_: Any) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(shared_memory.os, "preadv", failing)
    monkeypatch.setattr(shared_memory.os, "pwrite", failing)
    with pytest.raises(InvalidInput, match="cannot read shared-memory object 'obj': Input/output error"):
        _read(regions, RegionRef("r", 8))
    with pytest.raises(InvalidInput, match="cannot write shared-memory object 'obj'"):
        write_outputs([("y", "FP32", np.ones(1, np.float32))], targets)


def test_regions_leave_most_of_the_open_file_limit_to_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared_memory.resource, "getrlimit", lambda _: (1024, 4096))
    assert shared_memory.regions_allowed() == 256
    monkeypatch.setattr(shared_memory.resource, "getrlimit", lambda _: (1 << 20, 1 << 20))
    assert shared_memory.regions_allowed() == shared_memory.MAX_REGIONS


def test_references_past_the_region_are_refused(regions: SystemSharedMemory, tmp_path: Path) -> None:
    _object(tmp_path, "obj", bytes(64))
    regions.register("r", "obj", 0, 32)
    with pytest.raises(InvalidInput, match="input 'x': 8 bytes at offset 28 run past the end of shared-memory region 'r'"):
        _read(regions, RegionRef("r", 8, offset=28), "input 'x'")
    assert _read(regions, RegionRef("r", 4, offset=28), "input 'x'").nbytes == 4
    with pytest.raises(InvalidInput, match="output 'y': 8 bytes at offset 28 run past"):
        regions.output_targets({"y": RegionRef("r", 8, offset=28)})


@pytest.mark.parametrize(
    ("key", "offset", "size", "message"),
    [
        ("/missing", 0, 8, "no shared-memory object '/missing'"),
        ("../escape", 0, 8, "is not a shared-memory key"),
        ("a/b", 0, 8, "is not a shared-memory key"),
        ("/..", 0, 8, "is not a shared-memory key"),
        ("", 0, 8, "is not a shared-memory key"),
        ("/obj", 0, 0, "positive 'byte_size'"),
        ("/obj", -1, 8, "non-negative 'offset'"),
        ("/obj", 60, 8, "holds 64 bytes; a region of 8 bytes at offset 60 does not fit"),
    ],
)
def test_registrations_that_cannot_hold_are_refused(
    regions: SystemSharedMemory, tmp_path: Path, key: str, offset: int, size: int, message: str
) -> None:
    _object(tmp_path, "obj", bytes(64))
    with pytest.raises(InvalidInput, match=message):
        regions.register("r", key, offset, size)
    assert regions.status(None) == []


def test_a_link_is_never_followed(regions: SystemSharedMemory, tmp_path: Path) -> None:
    secret = tmp_path.parent / f"{tmp_path.name}-secret"
    secret.write_bytes(bytes(64))
    os.symlink(secret, tmp_path / "link")
    with pytest.raises(InvalidInput, match="cannot open shared-memory object 'link'"):
        regions.register("r", "link", 0, 8)
    (tmp_path / "folder").mkdir()
    with pytest.raises(InvalidInput):
        regions.register("r", "folder", 0, 8)


def test_a_name_is_registered_once(regions: SystemSharedMemory, tmp_path: Path) -> None:
    _object(tmp_path, "obj", bytes(64))
    regions.register("r", "obj", 0, 8)
    with pytest.raises(InvalidInput, match="already registered"):
        regions.register("r", "obj", 8, 8)
    with pytest.raises(InvalidInput, match="no shared-memory region 'other'"):
        regions.status("other")


def test_the_number_of_regions_is_bounded(regions: SystemSharedMemory, tmp_path: Path) -> None:
    regions.max_regions = 2
    _object(tmp_path, "obj", bytes(64))
    regions.register("a", "obj", 0, 8)
    regions.register("b", "obj", 8, 8)
    with pytest.raises(InvalidInput, match="2 shared-memory regions are registered already"):
        regions.register("c", "obj", 16, 8)


def test_nothing_is_taken_unless_allowed(tmp_path: Path) -> None:
    _object(tmp_path, "obj", bytes(64))
    regions = SystemSharedMemory(allowed=False, folder=str(tmp_path))
    for call in (lambda: regions.register("r", "obj", 0, 8), lambda: regions.status(None),
                 lambda: regions.unregister(None), lambda: _read(regions, RegionRef("r", 8), "input 'x'"),
                 lambda: _read(regions, RegionRef("r", 1 << 30), "input 'x'"),
                 lambda: regions.output_targets({"y": RegionRef("r", 8)})):
        with pytest.raises(Unsupported, match="--allow-client-shm"):
            call()


def test_outputs_are_written_as_binary_tensors_and_never_past_their_window(
        regions: SystemSharedMemory, tmp_path: Path) -> None:
    _object(tmp_path, "obj", bytes(16))
    regions.register("r", "obj", 0, 16)
    targets = regions.output_targets({"y": RegionRef("r", 16), "t": RegionRef("r", 16), "z": RegionRef("r", 16)})
    assert write_outputs([("y", "BF16", np.array([[1.5, 2.5]], ml_dtypes.bfloat16))], targets) == {"y": ("r", 4)}
    assert np.frombuffer(_window_bytes(tmp_path, "obj")[:4], ml_dtypes.bfloat16).tolist() == [1.5, 2.5]
    assert write_outputs([("t", "BYTES", np.array([b"ab", b"c"], dtype=object))], targets) == {
        "t": ("r", 4 + 2 + 4 + 1)}
    assert _window_bytes(tmp_path, "obj")[:11] == b"\x02\x00\x00\x00ab\x01\x00\x00\x00c"
    written = write_outputs([("y", "INT32", np.array([3], np.int32)), ("z", "INT32", np.array([4], np.int32))],
                            {"z": targets["z"]})
    assert written == {"z": ("r", 4)}
    assert _window_bytes(tmp_path, "obj")[:4] == b"\x04\x00\x00\x00"


def test_an_output_that_does_not_fit_leaves_every_window_as_it_was(
        regions: SystemSharedMemory, tmp_path: Path) -> None:
    _object(tmp_path, "a", bytes(16))
    _object(tmp_path, "b", bytes(16))
    regions.register("a", "a", 0, 16)
    regions.register("b", "b", 0, 16)
    outputs = [("y", "FP32", np.ones(4, np.float32)), ("z", "FP32", np.zeros(5, np.float32))]
    with pytest.raises(InvalidInput, match="output 'z' is 20 bytes; its shared-memory window holds 16"):
        write_outputs(outputs, regions.output_targets({"y": RegionRef("a", 16), "z": RegionRef("b", 16)}))
    assert _window_bytes(tmp_path, "a") == bytes(16)  # not even the output that fitted


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        ({}, None),
        ({"binary_data_size": 4}, None),
        ({"shared_memory_region": "r", "shared_memory_byte_size": 8}, RegionRef("r", 8)),
        ({"shared_memory_region": "r", "shared_memory_byte_size": 8, "shared_memory_offset": 16}, RegionRef("r", 8, 16)),
    ],
)
def test_a_tensors_reference_is_read_from_its_parameters(parameters: dict[str, object],
                                                         expected: RegionRef | None) -> None:
    assert region_ref(parameters, "input 'x'") == expected


@pytest.mark.parametrize(
    "parameters",
    [
        {"shared_memory_region": "r"},
        {"shared_memory_byte_size": 8},
        {"shared_memory_region": "", "shared_memory_byte_size": 8},
        {"shared_memory_region": "r", "shared_memory_byte_size": -1},
        {"shared_memory_region": "r", "shared_memory_byte_size": 8.0},
        {"shared_memory_region": "r", "shared_memory_byte_size": True},
        {"shared_memory_region": "r", "shared_memory_byte_size": 8, "shared_memory_offset": "0"},
        {"shared_memory_offset": 0},
    ],
)
def test_half_a_reference_is_refused(parameters: dict[str, object]) -> None:
    with pytest.raises(InvalidInput, match="input 'x'"):
        region_ref(parameters, "input 'x'")
