"""The image under test, and what the run measured (printed at the end of the session)."""

from __future__ import annotations

import pytest

from tests.image.engine import MEASURED, image_under_test


@pytest.fixture(scope="session")
def image() -> str:
    return image_under_test()


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if MEASURED:
        terminalreporter.section("the image")
        for what, value in MEASURED.items():
            terminalreporter.write_line(f"{what}: {value}")
