"""The repository's layout, read one way by the server, builds, import and the benchmarks."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.layout import (
    CONFIG_FILENAME,
    EVAL_DIR,
    FIRST_VERSION,
    config_path,
    eval_dir,
    is_version_folder,
    version_dir,
    version_number,
    version_numbers,
)


@pytest.mark.parametrize(("name", "number"), [
    ("1", 1), ("01", 1), ("12", 12), ("0", 0), ("9" * 19, int("9" * 19)),
    ("9" * 20, None), ("", None), ("-1", None), ("1.0", None), ("²", None), ("١", None), ("v1", None),
])
def test_a_version_is_plain_ascii_digits(name: str, number: int | None) -> None:
    assert version_number(name) == number


def test_version_folders_are_folders_numbered_from_one(tmp_path: Path) -> None:
    model = tmp_path / "m"
    for name in ("1", "3", "10", "0", "eval", "rejected", "v2"):
        (model / name).mkdir(parents=True)
    (model / "2").write_text("a file named like a version")
    (model / CONFIG_FILENAME).write_text("name: m\n")
    assert version_numbers(model) == [1, 3, 10]
    assert not is_version_folder(model / "0") and not is_version_folder(model / "2")
    assert version_numbers(tmp_path / "absent") == []


def test_paths_are_made_one_way(tmp_path: Path) -> None:
    assert version_dir(tmp_path, FIRST_VERSION) == tmp_path / "1"
    assert config_path(tmp_path) == tmp_path / "config.yaml"
    assert eval_dir(tmp_path) == tmp_path / EVAL_DIR == tmp_path / "eval"
