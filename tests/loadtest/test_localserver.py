"""The shared server launcher: it yields a URL that answers, and a server that cannot start is
reported with its own output instead of a wait that runs out."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from loadtest import localserver


def test_a_server_that_exits_is_reported_with_its_log(tmp_path: Path) -> None:
    with (pytest.raises(RuntimeError, match="exited") as failed,
          localserver.running_server(tmp_path / "missing", "--no-such-flag", log_path=tmp_path / "log")):
        pass
    assert "--no-such-flag" in str(failed.value)  # the tail of its output


def test_an_empty_repository_serves_and_is_stopped(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    with localserver.running_server(tmp_path / "models", log_path=tmp_path / "log",
                                    wait_path="/v2/health/live") as url:
        assert httpx.get(f"{url}/v2").status_code == 200
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/v2", timeout=1)


def test_the_server_binds_port_zero_and_reports_the_port_it_got(tmp_path: Path) -> None:
    """No port is picked by the caller and bound later (a race on a busy machine): the server
    binds port 0 and writes the port it got to --port-file; its log names the same port."""
    (tmp_path / "models").mkdir()
    with localserver.running_server(tmp_path / "models", log_path=tmp_path / "log",
                                    wait_path="/v2/health/live") as url:
        port = int(url.rsplit(":", 1)[1])
        assert port != 0 and httpx.get(f"{url}/v2/health/live").status_code == 200
    assert f"on http://127.0.0.1:{port}" in (tmp_path / "log").read_text()


def test_a_port_in_use_fails_at_once_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        later_flags_win = ("--http-port", str(port))  # after running_server's own --http-port 0
        with pytest.raises(RuntimeError, match="exited with 1") as failed, localserver.running_server(
                tmp_path / "models", *later_flags_win, log_path=tmp_path / "log", wait_path="/v2/health/live"):
            pass
    assert f"cannot listen on 127.0.0.1 port {port}" in str(failed.value)
