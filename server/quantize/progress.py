"""Progress bars for a build's long steps: drawn on a terminal (tqdm), silent elsewhere.

A build says what it is doing in `progress(message)` lines. Loops long enough to wait on
(calibration batches, evaluation batches, timing each batch size) go through a `Track`: the CLI
draws them as tqdm bars on stderr when stderr is a terminal; a build at model load (the server)
uses `untracked`, since its log already has the step lines.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Protocol, TextIO, TypeVar

T = TypeVar("T")


class Track(Protocol):
    def __call__(self, items: Iterable[T], description: str, total: int | None = None) -> Iterable[T]: ...


def untracked(items: Iterable[T], description: str, total: int | None = None) -> Iterable[T]:
    return items


def bars(stream: TextIO | None = None) -> Track:
    """A Track drawing tqdm bars on `stream` (stderr); tqdm turns itself off when it is not a TTY."""
    from tqdm import tqdm

    def track(items: Iterable[T], description: str, total: int | None = None) -> Iterable[T]:
        return tqdm(items, desc=description, total=total, file=stream or sys.stderr, leave=False, disable=None,
                    dynamic_ncols=True)

    return track
