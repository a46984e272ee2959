"""CPython's garbage collector, tuned for a server that holds models, and its pauses measured.

A collection stops whichever thread triggers it, the event loop included, for as long as it
walks its generation. Loading models leaves a few hundred thousand long-lived objects (torch,
ONNX Runtime, tokenizers) that every full collection walked again, and the default young
threshold (700 allocations) ran a collection every few requests under load; the objects of
requests still in flight survived those, moved to older generations and were walked again.
Measured at 3x a small model's capacity, on one core: collections took a third of the event
loop's time, with full ones of ~200 ms that stalled every client. So:

- `settle()` after models load or unload: collect once (what an unloaded model left in cycles
  is freed), then freeze what survives, so later collections never walk it again;
- a young threshold of `YOUNG_THRESHOLD` allocations: most request objects are freed by their
  reference counts before a collection sees them.

`HeapPolicy.pauses` counts each collection's pause by generation, exported on /metrics.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from server.stats import Histogram

logger = logging.getLogger(__name__)

YOUNG_THRESHOLD = 20_000
GENERATIONS = (0, 1, 2)
PAUSE_BOUNDS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class HeapPolicy:
    """Installed once per serving process (`install`); the data plane calls `settle` after it
    loads or unloads models."""

    def __init__(self) -> None:
        self.pauses = {generation: Histogram(PAUSE_BOUNDS_S) for generation in GENERATIONS}
        self._started_ns = 0
        self._installed = False

    def install(self) -> HeapPolicy:
        """Raise the young threshold (the older ones keep their ratios) and time collections."""
        if not self._installed:
            _, middle, old = gc.get_threshold()
            gc.set_threshold(YOUNG_THRESHOLD, middle, old)
            gc.callbacks.append(self._on_collection)
            self._installed = True
        return self

    def uninstall(self) -> None:
        """Stop timing collections (tests install a policy of their own in a shared process)."""
        if self._installed:
            gc.callbacks.remove(self._on_collection)
            self._installed = False

    def settle(self) -> None:
        """Collect everything, then freeze the survivors out of later collections. Frozen
        objects that become garbage in cycles are never collected, so the freeze is undone
        first: a model unloaded since the last settle is freed now."""
        started = time.perf_counter()
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        logger.info("heap settled: %d objects frozen out of later collections in %.0f ms",
                    gc.get_freeze_count(), (time.perf_counter() - started) * 1000)

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started_ns = time.perf_counter_ns()
        elif self._started_ns:
            self.pauses[info["generation"]].observe((time.perf_counter_ns() - self._started_ns) / 1e9)
            self._started_ns = 0
