"""The Makefile's GPU switch, without installing anything.

`make GPU=1 setup|serve|test` installs requirements/gpu.txt into the same venv path with a stamp
of its own; without GPU (or GPU=0) it is the CPU set, as before; setup refuses a venv that holds
the other variant's ONNX Runtime (onnxruntime and onnxruntime-gpu install one module). The
commands are read with `make -n`; the refusal runs for real against venvs made without pip, so no
install can happen whatever the Makefile does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A parent `make GPU=1 test` passes its variables down through MAKEFLAGS; these runs start clean.
_INHERITED = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "GPU", "VENV", "PYTHON", "PYTEST_ARGS")


def make(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in _INHERITED}
    command = ["make", "--no-print-directory", f"VENV={venv}", *args]
    return subprocess.run(command, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def setup_commands(venv: Path, *args: str) -> list[str]:
    """What `make -n setup` would run to install the venv (model builds left out)."""
    done = make(venv, "-n", *args, "setup")
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if str(venv) in line and "models/" not in line]


def test_the_default_is_the_cpu_set_as_before(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    commands = setup_commands(venv)
    assert commands[0] == f"test -x {venv}/bin/python || python3 -m venv {venv}"
    assert "m.distribution('onnxruntime-gpu')" in commands[1] and "exit 1" in commands[1]
    assert commands[2:] == [
        f"{venv}/bin/python -m pip install --quiet --disable-pip-version-check -r requirements/cpu.txt",
        f"touch {venv}/.installed",
    ]
    assert setup_commands(venv, "GPU=0") == commands
    test = make(venv, "-n", "test")
    assert test.returncode == 0 and test.stdout.splitlines()[-1].strip() == f"{venv}/bin/python -m pytest"


def test_gpu_1_installs_the_gpu_set_with_its_own_stamp(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    commands = setup_commands(venv, "GPU=1")
    assert commands[0] == f"test -x {venv}/bin/python || python3 -m venv {venv}", "the same venv path"
    assert "m.distribution('onnxruntime')" in commands[1] and "exit 1" in commands[1]
    assert commands[2:] == [
        f"{venv}/bin/python -m pip install --quiet --disable-pip-version-check -r requirements/gpu.txt",
        f"touch {venv}/.installed-gpu",
    ]
    assert "cpu.txt" not in make(venv, "-n", "GPU=1", "serve").stdout


def test_each_variant_has_its_own_stamp(tmp_path: Path) -> None:
    """A fresh CPU stamp satisfies `make setup`, not `make GPU=1 setup`, and the other way round."""
    venv = tmp_path / "venv"
    venv.mkdir()
    later = time.time() + 60  # newer than pyproject.toml and requirements/*.txt
    for stamp, fresh, stale in ((".installed", (), ("GPU=1",)), (".installed-gpu", ("GPU=1",), ())):
        for old in venv.glob(".installed*"):
            old.unlink()
        (venv / stamp).touch()
        os.utime(venv / stamp, (later, later))
        assert setup_commands(venv, *fresh) == [], f"{stamp} is fresh"
        assert any("pip install" in c for c in setup_commands(venv, *stale)), f"{stamp} is not the other's"


def test_an_unknown_gpu_value_is_refused(tmp_path: Path) -> None:
    done = make(tmp_path / "venv", "-n", "GPU=yes", "setup")
    assert done.returncode != 0 and "GPU=yes: use GPU=1" in done.stderr


def venv_holding(tmp_path: Path, distribution: str) -> Path:
    """A venv without pip whose site-packages records `distribution` as installed."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    (site,) = venv.glob("lib/python3.*/site-packages")
    record = site / f"{distribution.replace('-', '_')}-1.32.0.dist-info"
    record.mkdir()
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 1.32.0\n")
    return venv


@pytest.mark.parametrize(("holds", "args", "wants"), [
    ("onnxruntime", ("GPU=1",), "onnxruntime-gpu"),
    ("onnxruntime-gpu", (), "onnxruntime"),
])
def test_setup_refuses_the_other_variants_onnxruntime(tmp_path: Path, holds: str, args: tuple[str, ...],
                                                      wants: str) -> None:
    venv = venv_holding(tmp_path, holds)
    done = make(venv, *args, "setup")
    assert done.returncode != 0
    (refusal,) = [line for line in done.stderr.splitlines() if not line.startswith("make: ***")]
    assert refusal == (f"make: {venv} holds {holds} and requirements/{'gpu' if args else 'cpu'}.txt would put"
                       f" {wants} beside it: run 'make clean' first, or use another VENV=DIR")
    assert "pip" not in done.stdout + done.stderr, "refused before pip ran"
    assert not list(venv.glob(".installed*"))


@pytest.mark.parametrize(("holds", "args"), [("onnxruntime", ()), ("onnxruntime-gpu", ("GPU=1",))])
def test_setup_lets_its_own_variant_through(tmp_path: Path, holds: str, args: tuple[str, ...]) -> None:
    """The same variant passes the check and reaches pip (absent from this venv: nothing installs)."""
    venv = venv_holding(tmp_path, holds)
    done = make(venv, *args, "setup")
    assert "No module named pip" in done.stderr and "would put" not in done.stderr
