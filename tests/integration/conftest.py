"""Integration fixtures: the real server, started as a process on loopback."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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


def linked_repository(root: Path, models: tuple[str, ...] = ("digits", "minilm")) -> Path:
    """A repository of the built models: config copied (free to edit), version 1 and eval/
    linked, never written."""
    for name in models:
        if not (MODELS / name / "1").is_dir():
            pytest.fail(f"models/{name}/1 is not built; run `make models` (make test does it)")
        link_model(MODELS, root, name)
    return root


def _require_built_models() -> None:
    missing = [p for p in (MODELS / "minilm/1/model.onnx", MODELS / "digits/1/model.pt2") if not p.is_file()]
    if missing:
        pytest.fail(f"models are not built ({missing}); run `make models` (make test does it)")


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    """The default repository, served as `make serve` would."""
    _require_built_models()
    with running_server(MODELS) as url:
        yield url


@pytest.fixture(scope="session")
def host(server_url: str) -> str:
    """host:port, as tritonclient wants it."""
    return server_url.removeprefix("http://")


@pytest.fixture(scope="module")
def scratch_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository of its own: a copy of digits, digits with three versions of which the policy
    serves two, a model whose artifact is missing, and a model whose config is invalid."""
    _require_built_models()
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
