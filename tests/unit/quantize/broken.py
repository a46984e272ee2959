"""Deliberately broken calibrations, for tests that prove the quality gate catches a bad build.
They live here, not in the server: a build calibrates on the model's own data, always."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from server.quantize import api


def garbage(array: np.ndarray, how: str) -> np.ndarray:
    """Blank items ("zeros") or values far outside any real input ("noise")."""
    if array.dtype.kind not in "fc":
        return array
    if how == "zeros":
        return np.zeros_like(array)
    if how == "noise":
        return np.random.default_rng(0).uniform(0, 2000, size=array.shape).astype(array.dtype)
    raise ValueError(f"no broken calibration {how!r}")


def break_calibration(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Builds made in this test (in this process) calibrate on garbage instead of the model's
    calibration items; the data's fingerprint changes too, so no earlier build is a cache hit."""
    real = api.load_eval_data

    def broken(*args: Any, **kwargs: Any) -> Any:
        data = real(*args, **kwargs)
        calibration = {name: garbage(array, how) for name, array in getattr(data, "calibration", {}).items()}
        return dataclasses.replace(data, calibration=calibration, fingerprint=f"{data.fingerprint}-{how}")

    monkeypatch.setattr(api, "load_eval_data", broken)
