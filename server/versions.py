"""Installed versions of Python distributions, from package metadata: nothing is imported to
learn them (importing torch or TensorRT takes seconds), so the start-up log, the build cache key
and the benchmark records can all ask cheaply, and all get the same answer."""

from __future__ import annotations

from importlib import metadata

# TensorRT's wheels come under several names; the first installed one is TensorRT's version.
TENSORRT_DISTRIBUTIONS = ("tensorrt", "tensorrt-cu13", "tensorrt-cu12", "tensorrt-cu11", "tensorrt-libs",
                          "tensorrt-lean", "tensorrt-dispatch")


def installed_versions(names: tuple[str, ...]) -> dict[str, str | None]:
    """Each distribution's installed version, None where it is not installed."""
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def tensorrt_version() -> str | None:
    """TensorRT's version under whichever name its wheel was installed, None when it is not."""
    for name in TENSORRT_DISTRIBUTIONS:  # the first one found: each miss scans the installed packages
        version = installed_versions((name,))[name]
        if version:
            return version
    return None
