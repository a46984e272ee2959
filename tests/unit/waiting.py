"""Waiting on the state of the code under test, never on the clock."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest


async def eventually(predicate: Callable[[], bool], what: str, timeout_s: float = 15) -> None:
    """Wait until the code under test's own state says `what`; fail with that sentence, never hang."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting until {what}")
        await asyncio.sleep(0.002)
