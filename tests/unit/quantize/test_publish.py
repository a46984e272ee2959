"""Publishing a build is crash-safe: wherever a publish stops (each rename and fsync made to fail
in turn), and whenever a reader looks (between any two steps), the repository serves the old
config with the old version or the new config with the new version, never one with the other."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from onnx import TensorProto, helper

from server.config import load_model_config
from server.engines.digests import RECORD, read_digests
from server.layout import version_numbers
from server.quantize import variant
from server.repository import ModelRepository
from tests.unit.onnx_models import BATCH, save

# The old build takes and gives FP32, the new one FP16: a config served with the other's
# artifact is refused by the signature check, and the artifacts say which is which.
TYPES = {"FP32": TensorProto.FLOAT, "FP16": TensorProto.FLOAT16}


def config(datatype: str) -> dict[str, Any]:
    return {
        "name": "double-variant", "engine": "onnxruntime", "max_batch_size": 4,
        "inputs": [{"name": "x", "datatype": datatype, "dims": [2]}],
        "outputs": [{"name": "y", "datatype": datatype, "dims": [2]}],
    }


def stage_build(stage: Path, datatype: str) -> None:
    """What a build leaves in its stage: the artifact and its report."""
    x = helper.make_tensor_value_info("x", TYPES[datatype], [BATCH, 2])
    y = helper.make_tensor_value_info("y", TYPES[datatype], [BATCH, 2])
    save(helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "double", [x], [y]), stage)
    (stage / "build.json").write_text(f'{{"datatype": "{datatype}"}}')


def publish(folder: Path, datatype: str) -> int:
    with variant.locked(folder), variant.staging(folder) as stage:
        stage_build(stage, datatype)
        return variant.publish(folder, stage, config(datatype), "double")


def served(folder: Path) -> tuple[str, list[int]] | None:
    """What the repository loader reads, in its order: config.yaml, then the versions its
    policy selects; None while the variant has no config (the repository does not list it)."""
    if not (folder / "config.yaml").is_file():
        return None
    loaded = load_model_config(folder / "config.yaml")
    versions = loaded.version_policy.select(version_numbers(folder))
    for version in versions:  # the artifact each selected version serves must be the config's
        built = (folder / str(version) / "build.json").read_text()
        assert loaded.inputs[0].datatype in built, f"config {loaded.inputs[0].datatype} with version {version}"
    return loaded.inputs[0].datatype, versions


async def load(root: Path) -> tuple[str, str, list[str]]:
    """The real repository's verdict: state, reason and the versions it serves."""
    repository = ModelRepository(root)
    try:
        await repository.load_all()
        entries = [e for e in repository.index() if e.name == "double-variant"]
        return entries[0].state, entries[0].reason, [e.version for e in entries]
    finally:
        await repository.unload_all()


OLD, NEW = ("FP32", [1]), ("FP16", [2])


@pytest.fixture
def old_state(tmp_path: Path) -> Path:
    folder = tmp_path / "models" / "double-variant"
    assert publish(folder, "FP32") == 1
    assert served(folder) == OLD
    return folder


class Crash(Exception):
    """The process dying at this step."""


Faults = Callable[[int | None, Callable[[], None]], list[str]]


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[Faults]:
    """Arm the filesystem steps of a publish: each rename, replace and fsync first runs
    `look` (a reader between two steps), and step number `crash_at` raises instead of running."""
    real = {name: getattr(os, name) for name in ("rename", "replace", "fsync")}

    def arm(crash_at: int | None, look: Callable[[], None]) -> list[str]:
        steps: list[str] = []
        for name, function in real.items():
            def step(*args: Any, _name: str = name, _function: Callable[..., Any] = function) -> Any:
                steps.append(_name)
                look()
                if len(steps) == crash_at:
                    raise Crash(f"crashed at step {crash_at} ({_name})")
                return _function(*args)
            monkeypatch.setattr(os, name, step)
        return steps

    yield arm  # monkeypatch puts the real ones back


def test_a_reader_between_any_two_steps_sees_the_old_state_or_the_new(old_state: Path, faults: Faults) -> None:
    seen: list[tuple[str, list[int]] | None] = []
    steps = faults(None, lambda: seen.append(served(old_state)))
    assert publish(old_state, "FP16") == 2
    assert {"rename", "replace", "fsync"} <= set(steps)
    assert set(map(repr, seen)) <= {repr(OLD), repr(NEW)} and seen[0] == OLD and served(old_state) == NEW


def test_a_crash_at_any_step_leaves_the_old_state_or_the_new(old_state: Path, tmp_path: Path, faults: Faults) -> None:
    clean = tmp_path / "clean"
    shutil.copytree(old_state.parent, clean)
    crash_at = 1
    outcomes = []
    while True:
        shutil.rmtree(old_state.parent)
        shutil.copytree(clean, old_state.parent)
        steps = faults(crash_at, lambda: None)
        try:
            publish(old_state, "FP16")
        except Crash:
            pass
        else:
            break  # past the last step: the publish completed
        finally:
            faults(None, lambda: None)
        state = served(old_state)
        assert state in (OLD, NEW), f"crash at step {crash_at} ({steps[-1]}) left {state}"
        verdict = asyncio.run(load(old_state.parent))
        assert verdict[0] == "READY" and verdict[2] == [str(state[1][0])], verdict
        outcomes.append(state)
        # and the next build publishes over whatever the crash left
        assert publish(old_state, "FP16") in (2, 3) and served(old_state)[0] == "FP16"  # type: ignore[index]
        crash_at += 1
    assert crash_at > 5 and OLD in outcomes and NEW in outcomes  # some crashes before the commit, some after


def test_a_crash_before_the_commit_leaves_a_version_nothing_serves(old_state: Path, faults: Faults) -> None:
    steps = faults(None, lambda: None)
    assert publish(old_state, "FP32") == 2  # learns a publish's steps: config.yaml's replace is the last one
    commit = len(steps) - steps[::-1].index("replace")
    faults(commit, lambda: None)
    with pytest.raises(Crash):
        publish(old_state, "FP16")
    faults(None, lambda: None)
    assert version_numbers(old_state) == [1, 2, 3] and variant.served_versions(old_state) == [2]
    assert served(old_state) == ("FP32", [2])
    assert publish(old_state, "FP16") == 4 and served(old_state) == ("FP16", [4])


def test_a_published_version_carries_its_config_and_a_record_of_every_file(old_state: Path) -> None:
    version = old_state / "1"
    assert set(read_digests(version) or {}) == {"model.onnx", "build.json", variant.PUBLISHED_CONFIG}
    check = subprocess.run(["sha256sum", "-c", RECORD], check=False, cwd=version, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    assert (version / variant.PUBLISHED_CONFIG).read_text() == (old_state / "config.yaml").read_text()
    assert load_model_config(old_state / "config.yaml").version_policy.specific.versions == [1]  # type: ignore[union-attr]
    assert not [p for p in old_state.iterdir() if p.name.startswith(".") and p.name != ".build.lock"]
    # readable by a server running as another user (the image's): mkdtemp made it 0700
    assert version.stat().st_mode & 0o777 == 0o755


def test_a_rollback_is_copying_a_versions_published_config(old_state: Path) -> None:
    publish(old_state, "FP16")
    assert asyncio.run(load(old_state.parent))[::2] == ("READY", ["2"])
    shutil.copyfile(old_state / "1" / variant.PUBLISHED_CONFIG, old_state / "config.yaml")
    assert served(old_state) == OLD
    assert asyncio.run(load(old_state.parent))[::2] == ("READY", ["1"])
