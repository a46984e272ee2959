"""Fixtures of the load-test tests: one real digits server for the whole folder (starting one
costs seconds), fake servers of known service time (loadtest/fakeserver.py), and the bench CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest import fakeserver
from tests.integration.conftest import linked_repository, require_tool, running_server

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def wrk() -> str:
    """wrk, which the closed-loop modes drive."""
    return require_tool("wrk", "wrk")


def run_command(*command: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def bench(*arguments: str, **kwargs) -> subprocess.CompletedProcess:
    return run_command(sys.executable, "-m", "loadtest.bench", *arguments, **kwargs)


def assert_figure(folder: Path, mode: str) -> str:
    """MODE.png exists and is a PNG, MODE.md shows it; returns the markdown."""
    png = folder / f"{mode}.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{png} missing or not a PNG"
    markdown = (folder / f"{mode}.md").read_text()
    assert f"![{mode}]({mode}.png)" in markdown
    return markdown


@pytest.fixture(scope="session")
def digits_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The shipped digits model, served alone, its log kept in a temporary folder."""
    repository = linked_repository(tmp_path_factory.mktemp("server") / "models", ("digits",))
    with running_server(repository) as url:
        yield url


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    """A fake server: 1 ms per request, /metrics on."""
    with fakeserver.running(1.0) as url:
        yield url
