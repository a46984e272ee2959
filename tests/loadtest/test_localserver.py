"""The shared server launcher: it yields a URL that answers, and a server that cannot start is
reported with its own output instead of a wait that runs out."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from loadtest import localserver


def test_a_server_that_exits_is_reported_with_its_log(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="exited") as failed:
        with localserver.running_server(tmp_path / "missing", "--no-such-flag", log_path=tmp_path / "log"):
            pass
    assert "--no-such-flag" in str(failed.value)  # the tail of its output


def test_an_empty_repository_serves_and_is_stopped(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    with localserver.running_server(tmp_path / "models", log_path=tmp_path / "log",
                                    wait_path="/v2/health/live") as url:
        assert httpx.get(f"{url}/v2").status_code == 200
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/v2", timeout=1)
