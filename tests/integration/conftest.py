"""Integration fixtures: the real server, started as a process on loopback."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson
import pytest

from loadtest import localserver
from loadtest.builds import link_model

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"


@contextmanager
def running_server(
    repository: Path, *extra: str, wait_ready: bool = True, log_path: Path | None = None
) -> Iterator[str]:
    """Start `batchline serve` on a free loopback port; yield its base URL; stop it.
    Its output goes to `log_path` (default: a file in the temp folder)."""
    if log_path is None:
        logs = Path(tempfile.gettempdir()) / "batchline-test-logs"
        logs.mkdir(exist_ok=True)
        log_path = logs / f"server-{time.monotonic_ns()}.log"
    with localserver.running_server(repository, *extra, log_path=log_path, startup_timeout_s=180,
                                    wait_path="/v2/health/ready" if wait_ready else "/v2/health/live") as url:
        yield url


def require_tool(name: str, package: str) -> str:
    """The path of a system tool the test needs. Missing, it fails the test (a skip would hide
    a gap): `make test` installs it first (scripts/test-tools.sh)."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: `make test` installs it (scripts/test-tools.sh), "
                    f"or apt-get install -y {package}", pytrace=False)
    return path


SHIPPED_MODELS = ("digits", "minilm")  # the models whose build scripts ship in models/


def require_built_models(models: tuple[str, ...] = SHIPPED_MODELS) -> None:
    """Fail (never skip) when a shipped model is not built: `make test` builds them first."""
    missing = [name for name in models if not (MODELS / name / "1").is_dir()]
    if missing:
        pytest.fail(f"models {missing} are not built; run `make models` (make test does it)")


def linked_repository(root: Path, models: tuple[str, ...] = SHIPPED_MODELS) -> Path:
    """A repository of the shipped models only, whatever else a user built into models/:
    config copied (free to edit), version 1 and eval/ linked, never written."""
    require_built_models(models)
    for name in models:
        link_model(MODELS, root, name)
    return root


@pytest.fixture(scope="session")
def shipped_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped models in a repository of their own (read-only use: tests that edit
    configs make their own)."""
    return linked_repository(tmp_path_factory.mktemp("shipped") / "models")


@pytest.fixture(scope="session")
def server_url(shipped_repository: Path) -> Iterator[str]:
    """The shipped models, served as `make serve` serves them."""
    with running_server(shipped_repository) as url:
        yield url


@pytest.fixture(scope="session")
def host(server_url: str) -> str:
    """host:port, as tritonclient wants it."""
    return server_url.removeprefix("http://")


@pytest.fixture(scope="module")
def scratch_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository of its own: a copy of digits, digits with three versions of which the policy
    serves two, a model whose artifact is missing, and a model whose config is invalid."""
    require_built_models()
    root = tmp_path_factory.mktemp("repo") / "models"
    shutil.copytree(MODELS / "digits", root / "digits", ignore=shutil.ignore_patterns("build.py"))
    broken = root / "broken"
    (broken / "1").mkdir(parents=True)
    (broken / "config.yaml").write_text((MODELS / "digits/config.yaml").read_text().replace("name: digits", "name: broken"))
    versions = root / "digits_versions"
    versions.mkdir()
    for v in (1, 2, 3):
        (versions / str(v)).symlink_to(MODELS / "digits" / "1", target_is_directory=True)
    (versions / "config.yaml").write_text(
        (MODELS / "digits/config.yaml").read_text().replace("name: digits", "name: digits_versions")
        + "version_policy:\n  specific:\n    versions: [1, 3]\n"
    )
    bad = root / "badconfig"
    (bad / "1").mkdir(parents=True)
    (bad / "config.yaml").write_text("name: badconfig\nengine: onnxruntime\nmax_batch_size: many\n"
                                     "inputs: [{name: x, datatype: FP32, dims: [1]}]\n"
                                     "outputs: [{name: y, datatype: FP32, dims: [1]}]\n")
    return root


def access_log_lines(log: Path) -> list[dict]:
    """The server's JSON access-log lines written so far, in the order it answered. A line still
    being written when the file is read (a read can see part of a write) is left for later."""
    text = log.read_text()
    whole = text[:text.rfind("\n") + 1]
    return [orjson.loads(line) for line in whole.splitlines() if line.startswith('{"time"')]
