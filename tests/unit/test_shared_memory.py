"""The registry of clients' shared-memory regions: what it maps, what it refuses, and that an
unregistered region stays readable for whoever still holds it."""

from __future__ import annotations

import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from server import shared_memory
from server.errors import InvalidInput, Unsupported
from server.protocol.shared_memory import RegionRef, region_ref
from server.shared_memory import SystemSharedMemory, write_outputs


def _object(folder: Path, key: str, data: bytes) -> None:
    (folder / key).write_bytes(data)


@pytest.fixture
def regions(tmp_path: Path) -> SystemSharedMemory:
    return SystemSharedMemory(allowed=True, max_input_bytes=1 << 20, folder=str(tmp_path))


def test_a_region_is_registered_read_written_and_unregistered(regions: SystemSharedMemory, tmp_path: Path) -> None:
    _object(tmp_path, "input0", bytes(range(64)))
    regions.register("in", "/input0", offset=16, byte_size=32)
    assert regions.status(None) == [{"name": "in", "key": "/input0", "offset": 16, "byte_size": 32}]
    assert regions.status("in") == regions.status(None)
    assert bytes(regions.input_window(RegionRef("in", 8, offset=4), "input 'x'")) == bytes(range(20, 28))
    window = regions.output_window(RegionRef("in", 4), "output 'y'")
    window[:] = b"\xff\xff\xff\xff"
    assert (tmp_path / "input0").read_bytes()[16:20] == b"\xff\xff\xff\xff"  # written into the client's object
    regions.unregister("in")
    assert regions.status(None) == []
    with pytest.raises(InvalidInput, match="no shared-memory region 'in'"):
        regions.input_window(RegionRef("in", 4), "input 'x'")
    regions.unregister("in")  # again: not an error, as in Triton


def test_output_targets_are_the_windows_of_every_output_or_a_refusal(regions: SystemSharedMemory, tmp_path: Path) -> None:
    _object(tmp_path, "out", bytes(32))
    regions.register("r", "out", 0, 32)
    targets = regions.output_targets({"y": RegionRef("r", 16), "z": RegionRef("r", 8, offset=16)})
    assert {name: (region, window.nbytes) for name, (region, window) in targets.items()} == {
        "y": ("r", 16), "z": ("r", 8)}
    targets["z"][1][:] = b"\x07" * 8
    assert (tmp_path / "out").read_bytes() == bytes(16) + b"\x07" * 8 + bytes(8), "z's window starts at its offset"
    assert regions.output_targets({}) == {}
    with pytest.raises(InvalidInput, match="no shared-memory region 'gone'"):
        regions.output_targets({"y": RegionRef("r", 16), "z": RegionRef("gone", 8)})
    with pytest.raises(InvalidInput, match="output 'y'"):
        regions.output_targets({"y": RegionRef("r", 64)})  # past the region's end


def test_a_region_past_a_page_boundary_maps_from_its_own_offset(regions: SystemSharedMemory, tmp_path: Path) -> None:
    data = np.arange(5000, dtype=np.uint32).tobytes()
    _object(tmp_path, "big", data)
    regions.register("r", "big", offset=4 * 4100 + 4, byte_size=16)
    assert np.frombuffer(regions.input_window(RegionRef("r", 16), "x"), np.uint32).tolist() == [4101, 4102, 4103, 4104]


def test_unregistering_leaves_a_held_window_readable_and_writable(regions: SystemSharedMemory, tmp_path: Path) -> None:
    _object(tmp_path, "obj", np.arange(4, dtype=np.float32).tobytes())
    regions.register("r", "obj", 0, 16)
    array = np.frombuffer(regions.input_window(RegionRef("r", 16), "input 'x'"), np.float32)  # a request's input
    out = regions.output_window(RegionRef("r", 16), "output 'y'")  # a request's output target
    regions.unregister(None)
    assert array.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert write_outputs([("y", "FP32", np.full(4, 7, np.float32))], {"y": ("r", out)}) == {"y": ("r", 16)}
    assert np.frombuffer((tmp_path / "obj").read_bytes(), np.float32).tolist() == [7.0] * 4
    with pytest.raises(InvalidInput, match="no shared-memory region"):
        regions.input_window(RegionRef("r", 16), "input 'x'")


def test_an_input_is_read_only_to_the_server_and_capped_at_the_body_limit(
        regions: SystemSharedMemory, tmp_path: Path) -> None:
    _object(tmp_path, "obj", bytes(2 << 20))
    regions.register("r", "obj", 0, 2 << 20)
    array = np.frombuffer(regions.input_window(RegionRef("r", 16), "input 'x'"), np.float32)
    assert not array.flags.writeable  # an engine working in place would change the client's memory
    with pytest.raises(ValueError):
        array[0] = 1.0
    with pytest.raises(InvalidInput, match="input 'x': 2097152 bytes of shared memory is over the server's limit"):
        regions.input_window(RegionRef("r", 2 << 20), "input 'x'")
    assert regions.output_window(RegionRef("r", 2 << 20), "output 'y'").nbytes == 2 << 20  # outputs: the region's


def test_references_past_the_region_are_refused(regions: SystemSharedMemory, tmp_path: Path) -> None:
    _object(tmp_path, "obj", bytes(64))
    regions.register("r", "obj", 0, 32)
    with pytest.raises(InvalidInput, match="input 'x': 8 bytes at offset 28 run past the end of shared-memory region 'r'"):
        regions.input_window(RegionRef("r", 8, offset=28), "input 'x'")
    assert regions.input_window(RegionRef("r", 4, offset=28), "input 'x'").nbytes == 4
    with pytest.raises(InvalidInput, match="output 'y': 8 bytes at offset 28 run past"):
        regions.output_window(RegionRef("r", 8, offset=28), "output 'y'")


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


def test_the_number_of_regions_is_bounded(regions: SystemSharedMemory, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared_memory, "MAX_REGIONS", 2)
    _object(tmp_path, "obj", bytes(64))
    regions.register("a", "obj", 0, 8)
    regions.register("b", "obj", 8, 8)
    with pytest.raises(InvalidInput, match="2 shared-memory regions are registered already"):
        regions.register("c", "obj", 16, 8)


def test_nothing_is_taken_unless_allowed(tmp_path: Path) -> None:
    _object(tmp_path, "obj", bytes(64))
    regions = SystemSharedMemory(allowed=False, folder=str(tmp_path))
    for call in (lambda: regions.register("r", "obj", 0, 8), lambda: regions.status(None),
                 lambda: regions.unregister(None), lambda: regions.input_window(RegionRef("r", 8), "input 'x'"),
                 lambda: regions.input_window(RegionRef("r", 1 << 30), "input 'x'"),
                 lambda: regions.output_window(RegionRef("r", 8), "output 'y'")):
        with pytest.raises(Unsupported, match="--allow-client-shm"):
            call()


def test_outputs_are_written_as_binary_tensors_and_never_past_their_window() -> None:
    target = bytearray(16)
    window = memoryview(target)
    assert write_outputs([("y", "BF16", np.array([[1.5, 2.5]], ml_dtypes.bfloat16))], {"y": ("r", window)}) == {
        "y": ("r", 4)}
    assert np.frombuffer(target[:4], ml_dtypes.bfloat16).tolist() == [1.5, 2.5]
    assert write_outputs([("t", "BYTES", np.array([b"ab", b"c"], dtype=object))], {"t": ("r", window)}) == {
        "t": ("r", 4 + 2 + 4 + 1)}
    assert bytes(target[:11]) == b"\x02\x00\x00\x00ab\x01\x00\x00\x00c"
    written = write_outputs([("y", "INT32", np.array([3], np.int32)), ("z", "INT32", np.array([4], np.int32))],
                            {"z": ("region", window)})
    assert written == {"z": ("region", 4)}
    assert bytes(target[:4]) == b"\x04\x00\x00\x00"


def test_an_output_that_does_not_fit_leaves_every_window_as_it_was() -> None:
    first, second = bytearray(16), bytearray(16)
    outputs = [("y", "FP32", np.ones(4, np.float32)), ("z", "FP32", np.zeros(5, np.float32))]
    with pytest.raises(InvalidInput, match="output 'z' is 20 bytes; its shared-memory window holds 16"):
        write_outputs(outputs, {"y": ("a", memoryview(first)), "z": ("b", memoryview(second))})
    assert first == bytearray(16) and second == bytearray(16)  # not even the output that fitted


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
