"""Quantized and lower-precision builds of a model, with a quality gate against FP32.

`build()` makes a *variant* model in the repository (`<model>-<engine>-<precision>`) from an FP32
source: the artifact, a derived config.yaml and a build report. A version is published (made
servable) only when the build keeps the source's quality on held-out data (`quality.py`), so a
bad calibration can never replace a good model. Heavy libraries are imported lazily: the server
imports this package only for `ensure_built`.
"""

from __future__ import annotations

from server.quantize.errors import BuildError
from server.quantize.report import BuildReport

__all__ = ["BuildError", "BuildReport", "build", "ensure_built", "report"]


def __getattr__(name: str):  # lazy: keeps `import server.quantize` cheap for the server
    if name == "build":
        from server.quantize.build import build

        return build
    if name == "ensure_built":
        from server.quantize.ensure import ensure_built

        return ensure_built
    if name == "report":
        from server.quantize.report import report

        return report
    raise AttributeError(name)
