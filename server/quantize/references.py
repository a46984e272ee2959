"""FP32's answers and speed, which a build is judged and timed against, kept as long as their owner.

Every build of one source compares with the same FP32 figures, and computing them costs an
evaluation and a timing run. `build()` makes a `References` of its own unless the caller passes
one, so a build at model load leaves nothing in the server's memory; a caller that makes several
builds of one source in a run (`bench builds`) passes one and FP32 is evaluated and timed once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from server.quantize.bench import Timing
from server.quantize.plan import BuildPlan


class References:
    """FP32 outputs per (source artifact, data, device) and FP32 timings per timing settings."""

    def __init__(self) -> None:
        self._outputs: dict[tuple[str, str, str], dict[str, np.ndarray]] = {}
        self._timings: dict[tuple[Any, ...], dict[str, Any]] = {}

    def outputs(self, plan: BuildPlan) -> dict[str, np.ndarray]:
        """FP32's answers on the plan's evaluation data, on the plan's device."""
        key = (plan.source.digest, plan.data.fingerprint, plan.device)
        if key not in self._outputs:
            from server.quantize.runner import evaluate

            source = plan.source
            self._outputs[key] = evaluate(source.config, source.version_dir, plan.data, plan.track,
                                          "evaluating FP32: ", plan.device)
        return self._outputs[key]

    def timing(self, plan: BuildPlan, timing: Timing, batches: list[int]) -> dict[str, Any]:
        """FP32's speed at `batches`, timed as `timing` times the build."""
        key = (plan.source.digest, tuple(batches), timing.seconds, timing.sequence_length, timing.device)
        if key not in self._timings:
            self._timings[key] = timing.run(plan.source.config, plan.source.version_dir, batches, "timing FP32")
        return self._timings[key]
