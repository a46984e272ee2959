"""Admission as a request meets it: the work handed off the loop, if any, run on a worker thread."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from server.scheduler.admission import Admission, Admitted


async def admit(
    admission: Admission, inputs: dict[str, tuple[str, np.ndarray]], parameters: dict[str, Any],
    received_ns: int | None = None,
) -> Admitted:
    admitted = admission.admit_or_offload(inputs, parameters, received_ns)
    return admitted if isinstance(admitted, Admitted) else await asyncio.to_thread(admitted)
