"""A build's long loops reach its Track (the CLI's bars): calibration, evaluation, timing."""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path
from typing import TypeVar

from server.quantize.api import build
from server.quantize.progress import bars

T = TypeVar("T")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bars_draw_on_a_terminal_and_stay_quiet_elsewhere() -> None:
    terminal, pipe = Terminal(), io.StringIO()
    assert list(bars(terminal)(range(3), "calibrating", 3)) == [0, 1, 2]
    assert "calibrating:" in terminal.getvalue() and "0/3" in terminal.getvalue()  # drawn, then cleared
    assert list(bars(pipe)(iter("ab"), "timing")) == ["a", "b"]
    assert pipe.getvalue() == ""


def test_every_long_step_of_a_build_is_tracked(repository: Path) -> None:
    steps: dict[str, tuple[int, int | None]] = {}

    def record(items: Iterable[T], description: str, total: int | None = None) -> Iterable[T]:
        items = list(items)
        steps[description] = (len(items), total)
        return items

    result = build(repository, "digits", "onnxruntime", "int8", progress=lambda _: None, track=record,
                   bench_seconds=0.05, bench_batches=[1, 8])
    assert result.servable
    assert steps["calibrating"][0] == steps["calibrating"][1] > 0
    assert steps["evaluating the build: held-out items"][0] == 6  # 360 images, 64 a batch
    assert steps["timing the build"] == (3, 3)  # a line per batch size, then the figures
