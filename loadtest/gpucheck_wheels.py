"""Wheels for the GPU host: fetched here, where PyPI is reachable; installed there, where nothing is.

The GPU host (loadtest/README.md, "GPU check") has Python 3.12 with torch, numpy, transformers and
the other packages of `HOST_PROVIDES`, but not the web stack the server needs. `fetch` downloads,
for CPython 3.12 on manylinux x86-64, what pyproject.toml's core dependencies and `gpu` extra need
beyond those: each requirement pinned to the version installed here (the one the tests ran
with), its dependencies resolved for 3.12 (pure-Python ones too), binary wheels only. It writes
the pinned list to DIR/requirements.txt, so that the host installs exactly that set.

`install` runs on the host: pip resolves requirements.txt against what the host already has
(`--dry-run --report`, no network), and only what is missing or too old is installed, without
dependencies, into a throwaway folder put first on the import path. The host's own torch, numpy
or tokenizers are never shadowed by a copy from here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
REQUIREMENTS_FILE = "requirements.txt"
PYTHON_VERSION = "3.12"
# pip matches a wheel's platform tags exactly: every manylinux level the host's glibc (2.39) runs.
PLATFORMS = ("manylinux2014_x86_64", *(f"manylinux_2_{n}_x86_64" for n in range(17, 40)))
EXTRAS = ("gpu", "torchao")  # torchao: INT8 torch programs (optional; its absence is reported)
DEFAULT_BUDGET_MIB = 60.0  # the device tool carries 64 MiB in all, the working tree (~2 MiB) included

# What the GPU host's image already holds (/work/.library/device/KINDS.md, read 2026-11): never carried.
HOST_PROVIDES = frozenset({
    "httpx", "ml-dtypes", "numpy", "nvidia-ml-py", "prometheus-client", "pyyaml", "tokenizers", "torch", "uvloop",
})
# Dependencies deliberately left behind, and why.
NOT_CARRIED = {
    "onnxruntime-gpu": "its wheel (CUDA libraries inside) is several times the budget; the host's onnxruntime is the"
    " CPU build, so the torch engine is the GPU engine there",
}


class WheelError(RuntimeError):
    """A fetch or an install that cannot give the server what it needs; the message says why."""


@dataclass(frozen=True)
class Wheel:
    path: Path
    size: int


def normalize(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return "-".join(name.replace("_", "-").replace(".", "-").lower().split("-"))


def carried_requirements(pyproject: Path = PYPROJECT, extras: tuple[str, ...] = EXTRAS) -> tuple[list[str], dict[str, str]]:
    """The requirements to carry (core dependencies and `extras` of `pyproject`, less what the host
    has), each pinned to the version installed here when that satisfies it; and every dependency
    left out, with the reason."""
    from packaging.requirements import Requirement

    project = tomllib.loads(pyproject.read_text())["project"]
    declared = list(project["dependencies"])
    for extra in extras:
        declared += project.get("optional-dependencies", {}).get(extra, [])
    carried: list[str] = []
    left_out: dict[str, str] = {}
    seen: set[str] = set()
    for text in declared:
        requirement = Requirement(text)
        name = normalize(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        if name in HOST_PROVIDES:
            left_out[name] = "on the GPU host already"
            continue
        if name in NOT_CARRIED:
            left_out[name] = NOT_CARRIED[name]
            continue
        carried.append(_pinned(requirement))
    return carried, left_out


def _pinned(requirement: Any) -> str:
    extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
    try:
        installed = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
        return str(requirement)
    if requirement.specifier and not requirement.specifier.contains(installed, prereleases=True):
        return str(requirement)
    return f"{requirement.name}{extras}=={installed}"


def fetch(destination: Path, requirements: list[str], python: str = sys.executable) -> list[Wheel]:
    """Download `requirements` and their dependencies as CPython 3.12 manylinux x86-64 (or pure
    Python) wheels into `destination`, emptied of wheels first; write requirements.txt beside them."""
    destination.mkdir(parents=True, exist_ok=True)
    for old in destination.glob("*.whl"):
        old.unlink()
    command = [python, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary=:all:",
               "--python-version", PYTHON_VERSION, "--implementation", "cp",
               *(flag for platform in PLATFORMS for flag in ("--platform", platform)),
               "--dest", str(destination), *requirements]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise WheelError(f"pip download failed ({done.returncode}):\n{_noise_free(done.stderr or done.stdout)}")
    (destination / REQUIREMENTS_FILE).write_text("".join(f"{r}\n" for r in requirements))
    return sorted((Wheel(p, p.stat().st_size) for p in destination.glob("*.whl")), key=lambda w: w.path.name)


def _noise_free(text: str) -> str:
    """pip's output without the warnings about this machine's local index folders."""
    lines = [line for line in text.splitlines() if "is ignored: it is neither a file nor a directory" not in line]
    return "\n".join(lines[-40:])


def check_budget(wheels: list[Wheel], budget_bytes: int) -> None:
    total = sum(w.size for w in wheels)
    if total > budget_bytes:
        largest = ", ".join(f"{w.path.name} {w.size / 2**20:.1f} MiB" for w in sorted(wheels, key=lambda w: -w.size)[:3])
        raise WheelError(f"the wheels take {total / 2**20:.1f} MiB, over the budget of {budget_bytes / 2**20:.1f} MiB"
                         f" (largest: {largest})")


def describe(wheels: list[Wheel]) -> str:
    """One line per wheel and the total, as the fetch prints them."""
    lines = [f"{w.size / 2**20:8.2f} MiB  {w.path.name}" for w in wheels]
    total = sum(w.size for w in wheels)
    return "\n".join([*lines, f"{total / 2**20:8.2f} MiB  total, {len(wheels)} wheels"])


def install(wheels: Path, target: Path, python: str = sys.executable) -> dict[str, Any]:
    """Install from `wheels` (a fetch's folder) what this interpreter lacks of its requirements.txt
    into `target`, and put `target` first on the import path of this process and its children.
    Returns what was installed and what was already there."""
    started = time.perf_counter()
    listed = wheels / REQUIREMENTS_FILE
    if not listed.is_file():
        raise WheelError(f"{listed} is missing: fetch the wheels with `loadtest/gpu_check --fetch-wheels {wheels}`")
    requirements = [line.strip() for line in listed.read_text().splitlines() if line.strip()]
    needed = _resolve(wheels, listed, python)
    target.mkdir(parents=True, exist_ok=True)
    if needed:
        command = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-index", "--no-deps",
                   "--no-compile", "--no-cache-dir", "--quiet", "--target", str(target), *(str(p) for p in needed.values())]
        done = subprocess.run(command, capture_output=True, text=True, check=False, env=_offline_pip())
        if done.returncode != 0:
            raise WheelError(f"pip install failed ({done.returncode}):\n{_noise_free(done.stderr or done.stdout)}")
    use_target(target)
    names = {normalize(n.split("==")[0]) for n in needed}
    return {
        "folder": str(wheels),
        "target": str(target),
        "installed": sorted(needed),
        "already_present": sorted(r for r in requirements if normalize(_name(r)) not in names),
        "seconds": round(time.perf_counter() - started, 1),
    }


def _name(requirement: str) -> str:
    for stop in "[=<>!~; ":
        requirement = requirement.split(stop, 1)[0]
    return requirement


def _resolve(wheels: Path, listed: Path, python: str) -> dict[str, Path]:
    """name==version -> wheel file of everything pip would install here for `listed`, resolved
    against what is installed (no network); every wheel of the folder when pip cannot say."""
    with tempfile.TemporaryDirectory(prefix="gpucheck-pip-") as scratch:
        report = Path(scratch) / "report.json"
        command = [python, "-m", "pip", "install", "--disable-pip-version-check", "--dry-run", "--quiet",
                   "--no-index", "--find-links", str(wheels), "--report", str(report), "-r", str(listed)]
        done = subprocess.run(command, capture_output=True, text=True, check=False, env=_offline_pip())
        if done.returncode != 0 or not report.is_file():
            if "no such option" in (done.stderr or ""):  # pip older than 22.2: no --report
                return {w.name: w for w in sorted(wheels.glob("*.whl"))}
            raise WheelError(f"the wheels in {wheels} do not satisfy {listed.name} here:\n"
                             f"{_noise_free(done.stderr or done.stdout)}")
        planned = json.loads(report.read_text()).get("install", [])
    needed: dict[str, Path] = {}
    for item in planned:
        url = item["download_info"]["url"]
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        path = Path(unquote(urlsplit(url).path))
        if path.parent.resolve() != wheels.resolve():
            raise WheelError(f"pip would install {name} {version} from {url}, outside {wheels}")
        needed[f"{name}=={version}"] = path
    return needed


def _offline_pip() -> dict[str, str]:
    """pip's environment for the install: no configuration file, so that the wheel folder is the
    only place it looks (a machine's own find-links or index would otherwise join in)."""
    return {**os.environ, "PIP_CONFIG_FILE": os.devnull}


def use_target(target: Path) -> None:
    """Put `target` first on this process's import path and on its children's (PYTHONPATH)."""
    import importlib

    folder = str(target)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    importlib.invalidate_caches()
    current = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = folder if not current else f"{folder}{os.pathsep}{current}"
