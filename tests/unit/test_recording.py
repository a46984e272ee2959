"""record_traffic: a bounded, rate-limited, uniform sample of admitted inputs, written atomically
in the format builds read, and read back by them."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from server.config import ModelConfig, RecordTraffic
from server.layout import RECORDED_FILE
from server.quantize.data import TensorData, load_eval_data
from server.quantize.errors import EvalDataUnavailable
from server.recording import TrafficRecorder


def config(**changes: Any) -> ModelConfig:
    document = {
        "name": "mine", "engine": "onnxruntime", "max_batch_size": 32,
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [2]}],
    }
    return ModelConfig.model_validate(document | changes)


def batch(first: float, size: int) -> dict[str, tuple[str, np.ndarray]]:
    values = np.arange(first, first + size, dtype=np.float32)
    return {"x": ("FP32", np.stack([values, values], axis=1))}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_rate_bounds_what_is_considered(tmp_path: Path) -> None:
    clock = Clock()
    recorder = TrafficRecorder(RecordTraffic(max_per_second=2), config(), tmp_path, clock=clock, seed=0)
    for i in range(10):  # ten requests in the same instant: one is let in
        recorder.offer(batch(i, 1), 1)
    assert recorder.considered == 1
    clock.now = 1.0  # a second later: one more (the rate allows no bursts)
    for i in range(10):
        recorder.offer(batch(i, 1), 1)
    assert recorder.considered == 2


def test_the_sample_stays_within_its_items_and_bytes_and_is_uniform(tmp_path: Path) -> None:
    clock = Clock()
    recorder = TrafficRecorder(RecordTraffic(max_items=50, max_per_second=1), config(), tmp_path, clock=clock, seed=0)
    for i in range(2000):
        clock.now += 1.0
        recorder.offer(batch(float(i), 1), 1)
    assert len(recorder.items) == 50 and recorder.considered == 2000
    kept = np.array([item["x"][0] for item in recorder.items])
    assert kept.mean() == pytest.approx(1000, rel=0.25)  # drawn from the whole run, not its start
    small = TrafficRecorder(RecordTraffic(max_bytes=40, max_per_second=1000), config(), tmp_path, clock=clock)
    clock.now += 1.0
    small.offer(batch(0.0, 8), 8)  # 8 items of 8 bytes: 5 fit in 40
    assert len(small.items) == 5 and small.bytes == 40


def test_at_most_eight_items_of_one_request_are_considered(tmp_path: Path) -> None:
    recorder = TrafficRecorder(RecordTraffic(), config(), tmp_path, clock=Clock())
    recorder.offer(batch(0.0, 32), 32)
    assert recorder.considered == 8


async def test_the_sample_is_written_as_a_build_reads_it(tmp_path: Path) -> None:
    clock = Clock()
    recorder = TrafficRecorder(RecordTraffic(max_per_second=1000), config(), tmp_path, clock=clock)
    for i in range(6):
        clock.now += 1.0
        recorder.offer(batch(float(i * 8), 8), 8)
    assert await recorder.write()
    assert not await recorder.write()  # nothing new since
    with np.load(tmp_path / RECORDED_FILE) as stored:
        assert stored.files == ["x"] and stored["x"].shape == (48, 2)
    data = load_eval_data(tmp_path, tmp_path / "1", config())
    assert isinstance(data, TensorData) and data.labels is None and "recorded.npz" in data.origin
    assert data.count + data.calibration_count == 48
    with pytest.raises(EvalDataUnavailable):  # builds at load: recorded traffic would rebuild at every load
        load_eval_data(tmp_path, tmp_path / "1", config(), recorded=False)
    assert not list((tmp_path / "eval").glob(".recorded-*")), "no temporary file left behind"


TEXT = config(inputs=[{"name": "text", "datatype": "BYTES", "dims": [1]}])


def texts(*values: bytes) -> dict[str, tuple[str, np.ndarray]]:
    return {"text": ("BYTES", np.array([[v] for v in values], dtype=object))}


async def test_text_is_written_as_utf8_bytes_and_read_back_by_builds(tmp_path: Path) -> None:
    recorder = TrafficRecorder(RecordTraffic(max_per_second=1000), TEXT, tmp_path, clock=Clock())
    recorder.offer(texts(b"caf\xc3\xa9", b"two", b"three", b"four"), 4)
    await recorder.write()
    with np.load(tmp_path / RECORDED_FILE) as stored:
        assert stored["text"].dtype.kind == "S"
        assert [v.decode() for v in stored["text"].ravel()] == ["café", "two", "three", "four"]
    data = load_eval_data(tmp_path, tmp_path / "1", TEXT)
    assert isinstance(data, TensorData) and data.count == 2


async def test_the_file_stays_within_the_byte_bound_however_text_is_padded(tmp_path: Path) -> None:
    """Text is stored as wide as its longest item: one long text among short ones would make
    the file count x longest. The longest items are left out until it fits."""
    recorder = TrafficRecorder(RecordTraffic(max_per_second=1000, max_bytes=2000), TEXT, tmp_path, clock=Clock())
    recorder.offer(texts(b"x" * 1000, *[b"short"] * 7), 8)
    assert await recorder.write()
    with np.load(tmp_path / RECORDED_FILE) as stored:
        assert stored["text"].nbytes <= 2000 and stored["text"].ravel().tolist() == [b"short"] * 7


async def test_a_new_run_resumes_the_sample_an_earlier_one_wrote(tmp_path: Path) -> None:
    clock = Clock()
    first = TrafficRecorder(RecordTraffic(max_per_second=1000), config(), tmp_path, clock=clock)
    first.offer(batch(0.0, 4), 4)
    await first.write()
    second = TrafficRecorder(RecordTraffic(max_per_second=1000), config(), tmp_path, clock=clock)
    second.restore()
    assert len(second.items) == 4 and not second.changed
    clock.now += 1.0
    second.offer(batch(10.0, 2), 2)
    await second.write()
    with np.load(tmp_path / RECORDED_FILE) as stored:
        assert stored["x"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 10.0, 11.0]
    other = TrafficRecorder(RecordTraffic(), TEXT, tmp_path, clock=clock)
    other.restore()  # recorded for other inputs: starts afresh
    assert other.items == []


def test_a_sample_file_that_cannot_be_read_starts_afresh(tmp_path: Path) -> None:
    """A truncated file (a model folder copied half-way) is no sample: the model still loads
    and records afresh."""
    (tmp_path / RECORDED_FILE).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / RECORDED_FILE).write_bytes(b"PK\x03\x04 cut short")
    recorder = TrafficRecorder(RecordTraffic(), config(), tmp_path)
    recorder.restore()
    assert recorder.items == []


def test_a_sample_without_an_item_axis_starts_afresh(tmp_path: Path) -> None:
    (tmp_path / RECORDED_FILE).parent.mkdir(parents=True, exist_ok=True)
    np.savez(tmp_path / RECORDED_FILE, x=np.float32(1.0))
    recorder = TrafficRecorder(RecordTraffic(), config(), tmp_path)
    recorder.restore()
    assert recorder.items == []


def test_a_zip_of_other_files_starts_afresh(tmp_path: Path) -> None:
    """numpy reads a member that is not an array as its bytes."""
    (tmp_path / RECORDED_FILE).parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(tmp_path / RECORDED_FILE, "w") as written:
        written.writestr("x", b"not an array")
    recorder = TrafficRecorder(RecordTraffic(), config(), tmp_path)
    recorder.restore()
    assert recorder.items == []


async def test_a_repository_it_cannot_write_is_said_once_and_serving_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "eval").write_text("a file where the folder should be")
    clock = Clock()
    recorder = TrafficRecorder(RecordTraffic(max_per_second=1000), config(), tmp_path, clock=clock)
    recorder.offer(batch(0.0, 1), 1)
    assert not await recorder.write()
    clock.now += 1.0  # past the rate: the second request is recorded too, and tried again
    recorder.offer(batch(1.0, 1), 1)
    assert len(recorder.items) == 2 and recorder.changed
    assert not await recorder.write()
    assert sum("cannot write the recorded requests" in r.message for r in caplog.records) == 1


def test_the_sample_is_uniform_when_its_bytes_bind(tmp_path: Path) -> None:
    """Items past the byte bound replace kept ones at random, as past the item bound: the
    sample is drawn from the whole run, not its first items."""
    clock = Clock()
    recorder = TrafficRecorder(RecordTraffic(max_bytes=80, max_per_second=1), config(), tmp_path, clock=clock, seed=0)
    for i in range(2000):
        clock.now += 1.0
        recorder.offer(batch(float(i), 1), 1)
    assert len(recorder.items) == 10 and recorder.bytes == 80  # 8 bytes an item
    kept = np.array([item["x"][0] for item in recorder.items])
    assert kept.mean() == pytest.approx(1000, rel=0.35)


async def test_a_sample_that_did_not_change_is_not_written_again(tmp_path: Path) -> None:
    clock = Clock()
    recorder = TrafficRecorder(RecordTraffic(max_items=2, max_per_second=1), config(), tmp_path, clock=clock, seed=0)
    for i in range(2):
        clock.now += 1.0
        recorder.offer(batch(float(i), 1), 1)
    assert await recorder.write()
    rewritten = 0
    for i in range(2, 200):  # considered, rarely kept: most writes would find nothing new
        clock.now += 1.0
        before = recorder.items[:]
        recorder.offer(batch(float(i), 1), 1)
        kept_one = any(a is not b for a, b in zip(before, recorder.items, strict=True))
        wrote = await recorder.write()
        assert wrote == kept_one
        rewritten += wrote
    assert 0 < rewritten < 20


@pytest.mark.parametrize("name", ["file", "allow_pickle", "args"])
async def test_an_input_named_like_a_parameter_of_the_writer_is_recorded(tmp_path: Path, name: str) -> None:
    """The sample is written one array a name: an input called `file` or `allow_pickle` is an
    input like any other, not a keyword of the function that writes the file."""
    named = config(inputs=[{"name": name, "datatype": "FP32", "dims": [2]}])
    clock = Clock()
    recorder = TrafficRecorder(RecordTraffic(max_per_second=1000), named, tmp_path, clock=clock)
    clock.now += 1.0
    recorder.offer({name: batch(0.0, 3)["x"]}, 3)
    assert await recorder.write()
    with np.load(tmp_path / RECORDED_FILE) as stored:
        assert stored.files == [name] and stored[name].shape == (3, 2)
