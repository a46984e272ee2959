"""The built image and the container engine that runs it, for tests/image and the real build in
tests/deploy/test_dockerfile.py.

The engine and its flags come from scripts/image.sh (`engine`, `run-flags`), so the tests run
containers exactly as `make image` builds them. Which image: $BATCHLINE_IMAGE when set (`make
image-test` builds it first); else, with BATCHLINE_IMAGE_TESTS=1, the script builds the CPU image
here (the layer cache makes that seconds after the first time); else the tests are skipped.
They are marked `image`, which `make test` deselects (the first build takes about ten minutes
and needs root or a container engine); `make image-test` runs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "image.sh"
OPT_IN = "BATCHLINE_IMAGE_TESTS"
GIVEN = "BATCHLINE_IMAGE"
MEASURED: dict[str, str] = {}  # what a run measured: printed at the end of the session (conftest)


def _script(*args: str) -> str:
    done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.fail(f"scripts/image.sh {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-4000:]}",
                    pytrace=False)
    return done.stdout


@cache
def engine() -> tuple[str, ...]:
    """The engine's command line, e.g. ("podman", "--runtime", "runc")."""
    return tuple(_script("engine").split())


@cache
def run_flags() -> tuple[str, ...]:
    """What `run` needs on this machine (podman: ulimits that fit the host's)."""
    return tuple(line for line in _script("run-flags").splitlines() if line)


def version() -> str:
    for line in (ROOT / "pyproject.toml").read_text().splitlines():
        if line.startswith("version"):
            return line.split("=", 1)[1].strip().strip('"')
    raise AssertionError("pyproject.toml has no version")


@cache
def _build() -> tuple[str, float]:
    tag = f"batchline:{version()}-cpu"
    started = time.monotonic()
    done = subprocess.run(["bash", str(SCRIPT), "build", "--tag", tag], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.fail(f"the image build failed ({done.returncode}):\n{(done.stdout + done.stderr)[-6000:]}",
                    pytrace=False)
    return tag, time.monotonic() - started


def image_under_test() -> str:
    """The tag to test: given, or built here when opted in; the test is skipped otherwise."""
    given = os.environ.get(GIVEN)
    if given:
        if subprocess.run([*engine(), "image", "inspect", given], capture_output=True, check=False).returncode:
            pytest.fail(f"{GIVEN}={given}: no such image here (`make image` builds it)", pytrace=False)
        return given
    if os.environ.get(OPT_IN) != "1":
        pytest.skip(f"builds and runs the container image: `make image-test`, or {OPT_IN}=1 "
                    "(needs docker or podman, or root to install podman)")
    return _build()[0]


def engine_run(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*engine(), *args], capture_output=True, text=True, check=False, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(engine())} {' '.join(args)} -> {done.returncode}:\n{done.stderr[-4000:]}")
    return done


def inspect_image(tag: str) -> dict:
    return json.loads(engine_run("image", "inspect", tag).stdout)[0]


def healthcheck_of(inspected: dict) -> dict:
    """The image's HEALTHCHECK: docker keeps it in Config, podman beside it."""
    found = inspected["Config"].get("Healthcheck") or inspected.get("Healthcheck")
    assert found, "the image has no health check (podman keeps it only with --format docker)"
    return found


def image_size(tag: str) -> int:
    return int(engine_run("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip())


# As deploy/k8s/base/deployment.yaml runs it: non-root (the image's numeric user), a read-only
# root file system with an emptyDir-like /tmp, every capability dropped, no privilege escalation.
AS_THE_MANIFESTS_DO = ("--user", "10001:10001", "--read-only", "--tmpfs", "/tmp:rw,size=1g,mode=1777",
                       "--cap-drop", "ALL", "--security-opt", "no-new-privileges")


@dataclass
class Container:
    name: str
    started: float  # time.monotonic() at `run`

    def url(self) -> str:
        line = engine_run("port", self.name, "8000/tcp").stdout.split()[0]  # 127.0.0.1:PORT
        return f"http://{line.replace('0.0.0.0', '127.0.0.1')}"

    def logs(self) -> str:
        done = engine_run("logs", self.name, check=False)
        return done.stdout + done.stderr

    def running(self) -> bool:
        state = engine_run("inspect", "--format", "{{.State.Running}}", self.name, check=False).stdout.strip()
        return state == "true"

    def exit_code(self) -> int:
        return int(engine_run("inspect", "--format", "{{.State.ExitCode}}", self.name).stdout.strip())


@contextmanager
def running_container(tag: str, name: str, *extra: str, command: tuple[str, ...] = ()) -> Iterator[Container]:
    """`run -d` the image as the manifests do, port 8000 on a loopback port the engine picks;
    removed (by name) afterwards, whatever happened."""
    engine_run("rm", "-f", name, check=False)
    started = time.monotonic()
    engine_run("run", "-d", "--name", name, *run_flags(), *AS_THE_MANIFESTS_DO, "-p", "127.0.0.1::8000", *extra,
               tag, *command)
    try:
        yield Container(name, started)
    finally:
        engine_run("kill", name, check=False)
        engine_run("rm", "-f", name, check=False)
