"""Opt-in recording of real requests' inputs, for a model's builds to calibrate and be judged on
(`record_traffic` in its config; off by default).

It holds user data: what clients sent, inputs only (no outputs, no identities), bounded in
items, bytes and rate, kept in memory as a uniform sample of the items it considered (reservoir
sampling), and written to `<model>/eval/recorded.npz` in the format `batchline build` reads (one
array per input, items first, text as numpy strings), replacing the file atomically. Only
requests that passed admission are offered, so every item fits the config.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from server.config import ModelConfig, RecordTraffic

logger = logging.getLogger(__name__)

RECORDED_FILE = Path("eval") / "recorded.npz"
ITEMS_PER_REQUEST = 8  # at most this many items of one request are considered


class TrafficRecorder:
    """The reservoir of one model version. `offer` runs on the event loop for each admitted
    request and costs a clock read unless the rate lets the request in; writing runs on a thread."""

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
        self._shapes: dict[str, tuple[int, ...]] = {}  # the first item's shape per input: items must stack
        self.items: list[dict[str, np.ndarray]] = []
        self.considered = 0  # items offered and let in by the rate
        self.bytes = 0
        self._written = 0  # self.considered when last written
        self._failed = False

    def offer(self, inputs: dict[str, tuple[str, np.ndarray]], batch_size: int) -> None:
        """Consider a request's items for the reservoir, within the rate."""
        now = self._clock()
        self._tokens = min(1.0, self._tokens + (now - self._refilled) * self._settings.max_per_second)
        self._refilled = now
        if self._tokens < 1.0:
            return
        self._tokens -= 1.0
        count = min(batch_size if self._batched else 1, ITEMS_PER_REQUEST)
        for index in range(count):
            item = {name: self._row(inputs[name][1], index) for name in self._names}
            if any(self._shapes.setdefault(n, a.shape) != a.shape for n, a in item.items()):
                continue  # a variable dim of another size than the first item's: it would not stack
            self._keep(item)

    def _row(self, array: np.ndarray, index: int) -> np.ndarray:
        row = array[index] if self._batched else array
        return np.array(row, copy=True)

    def _keep(self, item: dict[str, np.ndarray]) -> None:
        self.considered += 1
        size = sum(_nbytes(a) for a in item.values())
        if len(self.items) < self._settings.max_items:
            if self.bytes + size <= self._settings.max_bytes:
                self.items.append(item)
                self.bytes += size
            return
        slot = int(self._rng.integers(self.considered))  # keep it with probability max_items / considered
        if slot < len(self.items):
            replaced = sum(_nbytes(a) for a in self.items[slot].values())
            if self.bytes - replaced + size <= self._settings.max_bytes:
                self.items[slot] = item
                self.bytes += size - replaced

    @property
    def changed(self) -> bool:
        return self.considered != self._written and bool(self.items)

    async def write(self) -> bool:
        """Write the reservoir (on a thread) when it changed; False when there was nothing new
        or the file could not be written (said once in the log; serving goes on)."""
        if not self.changed:
            return False
        items, considered = list(self.items), self.considered
        try:
            await asyncio.to_thread(_save, self.path, self._names, items)
        except OSError as exc:
            if not self._failed:
                logger.warning("cannot write the recorded requests to %s: %s (serving goes on)", self.path, exc)
            self._failed = True
            return False
        self._written = considered
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


def _save(path: Path, names: list[str], items: list[dict[str, np.ndarray]]) -> None:
    """The items as one array per input, text as numpy strings (UTF-8 decoded where it is, else
    raw bytes), into `path` by a rename."""
    arrays = {name: _stacked([item[name] for item in items]) for name in names}
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".recorded-", suffix=".npz")
    try:
        with os.fdopen(handle, "wb") as file:
            np.savez(file, **arrays)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _stacked(rows: list[np.ndarray]) -> np.ndarray:
    stacked = np.stack(rows)
    if stacked.dtype != object:
        return stacked
    values = [v if isinstance(v, bytes) else str(v).encode() for v in stacked.ravel()]
    try:
        return np.array([v.decode("utf-8") for v in values]).reshape(stacked.shape)
    except UnicodeDecodeError:
        return np.array(values, dtype=bytes).reshape(stacked.shape)
