"""Where things are in a model repository, said once.

```
<repository>/<model>/config.yaml      the model's config
<repository>/<model>/<N>/             version N (digits, N >= 1): the artifact and its files
<repository>/<model>/eval/            data for builds: inputs.npz (+ labels.npy), recorded.npz
```
The server, the builds, import and the benchmarks all read a repository through these names,
so they cannot disagree on what a version folder is.
"""

from __future__ import annotations

from pathlib import Path

CONFIG_FILENAME = "config.yaml"
EVAL_DIR = "eval"
FIRST_VERSION = 1
# The files of eval/: a user's data (inputs, optional labels), a shipped model's recipe for its
# data, and the traffic the server recorded (same format as inputs.npz).
INPUTS_FILE = Path(EVAL_DIR) / "inputs.npz"
LABELS_FILE = Path(EVAL_DIR) / "labels.npy"
DATASET_FILE = Path(EVAL_DIR) / "dataset.json"
RECORDED_FILE = Path(EVAL_DIR) / "recorded.npz"
# Versions are folder names of digits; no real one has more digits than an int64 (19).
_MAX_VERSION_DIGITS = 19


def version_number(name: str) -> int | None:
    """The version a folder or a client names, or None when it names none: ASCII digits only
    ("²" and "١" pass str.isdigit but are not folder names), and few enough of them that int()
    stays cheap (Python refuses over 4300 digits). "01" is version 1, as Triton reads it."""
    if not (name.isascii() and name.isdigit()) or len(name) > _MAX_VERSION_DIGITS:
        return None
    return int(name)


def is_version_folder(path: Path) -> bool:
    number = version_number(path.name)
    return number is not None and number >= FIRST_VERSION and path.is_dir()


def version_numbers(model_dir: Path) -> list[int]:
    """The versions on disk, ascending; none when the folder does not exist."""
    if not model_dir.is_dir():
        return []
    return sorted({int(p.name) for p in model_dir.iterdir() if is_version_folder(p)})


def version_dir(model_dir: Path, version: int) -> Path:
    """Where `version` is written: its number as a folder name."""
    return model_dir / str(version)


def found_version_dir(model_dir: Path, version: int) -> Path:
    """Where `version` is read from: the folder of its number, or, where there is none, one
    that names it with leading zeros ("02", which `version_numbers` reads as 2, as Triton does)."""
    plain = version_dir(model_dir, version)
    if plain.is_dir() or not model_dir.is_dir():
        return plain
    padded = sorted(p for p in model_dir.iterdir() if is_version_folder(p) and int(p.name) == version)
    return padded[0] if padded else plain


def config_path(model_dir: Path) -> Path:
    return model_dir / CONFIG_FILENAME


def eval_dir(model_dir: Path) -> Path:
    return model_dir / EVAL_DIR
