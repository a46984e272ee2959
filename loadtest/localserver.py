"""A `batchline serve` process on a free loopback port, for benchmarks and tests: start it, wait
until it answers, stop it. One place, so the suite's pinned servers and the tests' servers start,
fail and stop the same way."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
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


@contextmanager
def running_server(
    repository: Path, *extra: str, log_path: Path, cpu: int | None = None,
    wait_path: str = "/v2/health/ready", startup_timeout_s: float = 300,
) -> Iterator[str]:
    """Serve `repository` (with `extra` flags of `batchline serve`, pinned to `cpu` if given) on
    127.0.0.1; yield its base URL once `wait_path` answers 200; stop it. Output goes to
    `log_path`, whose tail a failure to start quotes."""
    port = free_port()
    command = [sys.executable, "-m", "server.cli", "serve", "--model-repository", str(repository),
               "--host", "127.0.0.1", "--http-port", str(port), *extra]
    if cpu is not None:
        command = ["taskset", "-c", str(cpu), *command]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            _wait(url + wait_path, process, log_path, startup_timeout_s)
            yield url
        finally:
            stop(process)


def _wait(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{_tail(log_path)}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server did not answer {url} within {timeout_s:.0f} s:\n{_tail(log_path)}")


def _tail(log_path: Path, chars: int = 8000) -> str:
    return log_path.read_text(errors="replace")[-chars:]
