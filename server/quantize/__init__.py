"""Quantized and lower-precision builds of a model, with a quality gate against FP32.

`build()` makes a *variant* model in the repository (`<model>-<engine>-<precision>`) from an FP32
source: the artifact, a derived config.yaml and a build report. A version is published (made
servable) only when the build keeps the source's quality on held-out data (`quality.py`), so a
bad calibration can never replace a good model. Heavy libraries (torch, onnx, matplotlib) are
imported only when a build runs.
"""

from __future__ import annotations

from server.quantize.api import build
from server.quantize.ensure import ensure_built
from server.quantize.errors import BuildError
from server.quantize.reporting import BuildReport, report

__all__ = ["BuildError", "BuildReport", "build", "ensure_built", "report"]
