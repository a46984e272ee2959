"""A `batchline serve` process on a loopback port, for benchmarks and tests: start it, wait
until it answers, stop it. One place, so the suite's pinned servers and the tests' servers start,
fail and stop the same way.

The server binds port 0 itself and reports the port the system gave it (`--port-file`): a port
chosen here and bound later by the server could be taken in between on a busy machine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A port nothing listens on right now, for a client that must find no server there. Never
    for a server to bind later (another process may take it first): serve on port 0 with
    --port-file and read `bound_port` instead."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop(process: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM (the server drains), then SIGKILL if it has not exited within `timeout_s`."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@dataclass(frozen=True)
class StartedServer:
    url: str
    process: subprocess.Popen


@contextmanager
def running_server(
    repository: Path, *extra: str, log_path: Path, cpu: int | None = None,
    wait_path: str = "/v2/health/ready", startup_timeout_s: float = 300,
) -> Iterator[str]:
    """Serve `repository` (with `extra` flags of `batchline serve`, pinned to `cpu` if given) on
    127.0.0.1, on the port the system picks; yield its base URL once `wait_path` answers 200;
    stop it. Output goes to `log_path`, whose tail a failure to start quotes."""
    with started_server(repository, *extra, log_path=log_path, cpu=cpu, wait_path=wait_path,
                        startup_timeout_s=startup_timeout_s) as server:
        yield server.url


@contextmanager
def started_server(
    repository: Path, *extra: str, log_path: Path, cpu: int | None = None,
    wait_path: str = "/v2/health/ready", startup_timeout_s: float = 300,
    launcher: tuple[str, ...] = ("-m", "server.cli", "serve"), port: int = 0,
    environment: dict[str, str] | None = None,
) -> Iterator[StartedServer]:
    """`running_server`, with its process: started by `launcher` (python's arguments before the
    flags), on `port` (0: the one the system picks), with `environment` added to this one's."""
    with tempfile.TemporaryDirectory(prefix="batchline-port-") as folder:
        port_file = Path(folder) / "port"
        command = [sys.executable, *launcher, "--model-repository", str(repository),
                   "--host", "127.0.0.1", "--http-port", str(port), "--port-file", str(port_file),
                   "--grpc-port", "0", *extra]  # gRPC on a free port too (--grpc-port-file in extra learns it)
        with started_process(command, port_file, log_path=log_path, cpu=cpu, wait_path=wait_path,
                             startup_timeout_s=startup_timeout_s, environment=environment) as server:
            yield server


@contextmanager
def started_process(
    command: list[str], port_file: Path, *, log_path: Path, cpu: int | None = None,
    wait_path: str = "/v2/health/ready", startup_timeout_s: float = 300,
    environment: dict[str, str] | None = None,
) -> Iterator[StartedServer]:
    """Any HTTP server on loopback that writes its port to `port_file` once bound (pinned to
    `cpu` if given): yielded once `wait_path` answers 200, stopped after."""
    if cpu is not None:
        command = ["taskset", "-c", str(cpu), *command]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", **(environment or {})})
        try:
            deadline = time.monotonic() + startup_timeout_s
            url = f"http://127.0.0.1:{bound_port(port_file, process, log_path, deadline)}"
            _wait(url + wait_path, process, log_path, deadline)
            yield StartedServer(url, process)
        finally:
            stop(process)


def bound_port(port_file: Path, process: subprocess.Popen, log_path: Path, deadline: float) -> int:
    """The port a server started with `--port-file port_file` listens on, once it has bound it
    (before time.monotonic() reaches `deadline`); a server that exits first is reported with
    the tail of `log_path`."""
    while True:
        if port_file.is_file():  # the server renames it into place whole
            return int(port_file.read_text())
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{_tail(log_path)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not bind its port in time:\n{_tail(log_path)}")
        time.sleep(0.05)


def _wait(url: str, process: subprocess.Popen, log_path: Path, deadline: float) -> None:
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{_tail(log_path)}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server did not answer {url} in time:\n{_tail(log_path)}")


def _tail(log_path: Path, chars: int = 8000) -> str:
    return log_path.read_text(errors="replace")[-chars:]
