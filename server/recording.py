"""Opt-in recording of real requests' inputs, for a model's builds to calibrate and be judged on
(`record_traffic` in its config; off by default).

It holds user data: what clients sent, inputs only (no outputs, no identities), bounded in
items, bytes and rate, kept in memory as a uniform sample of the items it considered (reservoir
sampling), and written to `<model>/eval/recorded.npz` in the format `batchline build` reads (one
array per input, items first, text as UTF-8 bytes), replacing the file atomically. Only
requests that were admitted and queued are offered, so every item fits the config.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

from server.config import ModelConfig, RecordTraffic
from server.layout import RECORDED_FILE

logger = logging.getLogger(__name__)

ITEMS_PER_REQUEST = 8  # at most this many items of one request are considered


class TrafficRecorder:
    """The reservoir of one model version. `offer` runs on the event loop for each queued
    request and costs a clock read unless the rate lets the request in; reading and writing the
    file run on a thread. A version that loads resumes from the file an earlier one wrote."""

    def __init__(self, settings: RecordTraffic, config: ModelConfig, model_dir: Path,
                 clock: Callable[[], float] = time.monotonic, seed: int | None = None) -> None:
        self._settings = settings
        self._batched = config.batched
        self._names = [t.name for t in config.inputs]
        self.path = model_dir / RECORDED_FILE
        self._clock = clock
        self._rng = np.random.default_rng(seed)
        self._tokens = 1.0
        self._refilled = clock()
        self._shapes: dict[str, tuple[int, ...]] = {}  # an item's shape per input: items must stack
        self.items: list[dict[str, np.ndarray]] = []
        self.considered = 0  # items offered and let in by the rate
        self.bytes = 0
        self._changes = 0  # items placed (restored, added or replacing one) since the start
        self._written = 0  # self._changes when last written
        self._failed = False
        self._writing: asyncio.Future[None] | None = None

    def restore(self) -> None:
        """Start from the sample an earlier run wrote, when it fits this config (call off the loop)."""
        try:
            with np.load(self.path, allow_pickle=False) as stored:
                arrays = {name: stored[name] for name in stored.files}
        except FileNotFoundError:
            return
        except Exception as exc:  # noqa: BLE001 - truncated, not a zip, not numpy's: whatever it is, not a sample
            logger.warning("the recorded requests in %s cannot be read (%s); recording starts afresh", self.path, exc)
            return
        items = {a.shape[0] if isinstance(a, np.ndarray) and a.ndim else None for a in arrays.values()}
        if sorted(arrays) != sorted(self._names) or len(items) != 1 or None in items:  # one count for every input
            logger.warning("the recorded requests in %s do not fit this model's inputs; recording starts afresh",
                           self.path)
            return
        count = min(len(next(iter(arrays.values()))), self._settings.max_items)
        for index in range(count):
            item = {name: array[index].copy() for name, array in arrays.items()}  # not views of the whole file
            size = sum(_nbytes(a) for a in item.values())
            if self.bytes + size > self._settings.max_bytes:
                break
            self.items.append(item)
            self.bytes += size
        self._shapes = {name: array.shape[1:] for name, array in arrays.items()}
        self.considered = self._changes = self._written = len(self.items)

    def offer(self, inputs: dict[str, tuple[str, np.ndarray]], batch_size: int) -> None:
        """Consider a request's items for the reservoir, within the rate."""
        now = self._clock()
        self._tokens = min(1.0, self._tokens + (now - self._refilled) * self._settings.max_per_second)
        self._refilled = now
        if self._tokens < 1.0:
            return
        self._tokens -= 1.0
        arrays = {name: inputs[name][1] for name in self._names}
        shapes = {name: a.shape[1:] if self._batched else a.shape for name, a in arrays.items()}
        if any(self._shapes.setdefault(n, shape) != shape for n, shape in shapes.items()):
            return  # a variable dim of another size than the items kept: it would not stack
        for index in range(min(batch_size if self._batched else 1, ITEMS_PER_REQUEST)):
            self.considered += 1
            view = {name: a[index] if self._batched else a for name, a in arrays.items()}
            size = sum(_nbytes(a) for a in view.values())
            slot = len(self.items)
            if slot >= self._settings.max_items or self.bytes + size > self._settings.max_bytes:
                # full, by items or by bytes: kept with probability len(items) / considered, so the
                # sample stays uniform over the whole run whichever bound binds
                slot = int(self._rng.integers(self.considered))
                if slot >= len(self.items):
                    continue
            self._place(slot, view, size)

    def _place(self, slot: int, view: dict[str, np.ndarray], size: int) -> None:
        replaced = sum(_nbytes(a) for a in self.items[slot].values()) if slot < len(self.items) else 0
        if self.bytes - replaced + size > self._settings.max_bytes:
            return
        item = {name: np.array(a, copy=True) for name, a in view.items()}  # copied only once kept
        if slot < len(self.items):
            self.items[slot] = item
        else:
            self.items.append(item)
        self.bytes += size - replaced
        self._changes += 1

    @property
    def changed(self) -> bool:
        return self._changes != self._written and bool(self.items)

    async def write(self) -> bool:
        """Write the reservoir (on a thread) when it changed; False when there was nothing new
        or it could not be written (said once in the log; serving goes on). A write whose caller
        was cancelled still lands before the next one starts, so the last write wins."""
        if self._writing is not None:
            await asyncio.wait({self._writing})
            if not self._writing.cancelled():
                self._writing.exception()  # said by its own caller, or by nobody: not again
            self._writing = None
        if not self.changed:
            return False
        items, changes = list(self.items), self._changes
        self._writing = asyncio.ensure_future(
            asyncio.to_thread(_save, self.path, self._names, items, self._settings.max_bytes))
        try:
            await asyncio.shield(self._writing)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (recording must never take serving down)
            if not self._failed:
                logger.warning("cannot write the recorded requests to %s: %s (serving goes on)", self.path, exc)
            self._failed = True
            return False
        self._written = changes
        return True

    async def run(self) -> None:
        """Write every `write_every_seconds` while the model serves (cancel to stop)."""
        while True:
            await asyncio.sleep(self._settings.write_every_seconds)
            await self.write()


def _nbytes(array: np.ndarray) -> int:
    if array.dtype == object:
        return sum(len(v) if isinstance(v, (bytes, str)) else 8 for v in array.ravel())
    return array.nbytes


def _save(path: Path, names: list[str], items: list[dict[str, np.ndarray]], max_bytes: int) -> None:
    """The items as one array per input (text as UTF-8 bytes), into `path` by a rename. Text is
    padded to its longest item in the file: the longest items are left out until the file
    holds no more than `max_bytes`."""
    sized = sorted(((_padded_size(item), i) for i, item in enumerate(items)))
    while sized and len(sized) * sized[-1][0] > max_bytes:  # every item as wide as the widest
        sized.pop()
    kept = [items[i] for _, i in sorted(sized, key=lambda pair: pair[1])]  # in the sample's order
    arrays = {name: _stacked([item[name] for item in kept]) for name in names}
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".recorded-", suffix=".npz")
    try:
        with os.fdopen(handle, "wb") as file:
            _write_npz(file, arrays)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _padded_size(item: dict[str, np.ndarray]) -> int:
    """The item's bytes once its text is a fixed-width field as wide as its longest string."""
    size = 0
    for array in item.values():
        if array.dtype == object:
            size += max((len(_utf8(v)) for v in array.ravel()), default=0) * max(array.size, 1)
        else:
            size += array.nbytes
    return size


def _utf8(value: object) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _write_npz(file: BinaryIO, arrays: dict[str, np.ndarray]) -> None:
    """What np.savez writes (a zip of one .npy a name), for any input names: np.savez takes the
    names as keywords, so an input called `file` or `allow_pickle` would meet its parameters."""
    with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in arrays.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, array, allow_pickle=False)


def _stacked(rows: list[np.ndarray]) -> np.ndarray:
    stacked = np.stack(rows)
    if stacked.dtype != object:
        return stacked
    return np.array([_utf8(v) for v in stacked.ravel()], dtype=bytes).reshape(stacked.shape)
