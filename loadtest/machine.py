"""What a figure was measured on: CPU, cores, library versions, GPU, source revision.

A throughput number without its machine cannot be compared with another one, so every report
carries this record. Nothing here fails: what cannot be read is recorded as null.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("numpy", "onnxruntime", "onnxruntime-gpu", "torch", "tokenizers", "locust", "matplotlib")


def _run(*command: str, timeout: float = 10) -> str | None:
    try:
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout or done.stderr).strip() if done.returncode == 0 else None


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def gpus() -> list[dict[str, str]] | None:
    """GPUs as nvidia-smi lists them; null when nvidia-smi is absent or fails."""
    if not shutil.which("nvidia-smi"):
        return None
    out = _run("nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader")
    if out is None:
        return None
    rows = [[part.strip() for part in line.split(",")] for line in out.splitlines() if line.strip()]
    return [{"name": r[0], "driver": r[1], "memory": r[2]} for r in rows if len(r) == 3]


def library_versions() -> dict[str, str | None]:
    from server.versions import installed_versions  # the server's own, which its start-up log uses too

    return installed_versions(LIBRARIES)


def tool_version(tool: str) -> str | None:
    """First line of `tool -v` (wrk prints its version there, and exits 1)."""
    path = shutil.which(tool)
    if not path:
        return None
    try:
        done = subprocess.run([path, "-v"], check=False, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    text = (done.stdout or done.stderr).strip()
    return text.splitlines()[0] if text else None


def source_revision() -> dict[str, Any]:
    commit = _run("git", "rev-parse", "HEAD")
    status = _run("git", "status", "--porcelain")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def machine_record() -> dict[str, Any]:
    try:
        affinity: list[int] | None = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "cpu_affinity_of_bench": affinity,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "libraries": library_versions(),
        "wrk": tool_version("wrk"),
        "gpus": gpus(),
        "source": source_revision(),
    }
