"""The one error type a build raises for expected failures.

A subclass of `EngineError` so that a build run at model load (`ensure_built`) fails that model
with a readable reason, as any engine failure does, and the server's other models keep serving.
"""

from __future__ import annotations

from server.errors import EngineError


class BuildError(EngineError):
    """A build could not be made (unsupported combination, missing library, bad source)."""


class EvalDataUnavailable(BuildError):
    """The source's evaluation data (or the library that derives it) is not here: nothing can be
    built or re-judged, though a build published earlier may still serve."""
