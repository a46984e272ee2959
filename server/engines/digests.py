"""Recorded sha256 digests of a version folder's files, checked before an engine loads them.

The record is `SHA256SUMS` in the version folder, in the format of coreutils' `sha256sum`, so
ops can check a folder by hand (`cd models/digits/1 && sha256sum -c SHA256SUMS`) and record one
for their own model the same way. The model build scripts and `batchline build` write it.

What it catches: a damaged, half-copied or swapped artifact (an artifact can run code when it is
loaded: `.pt2` archives). What it does not: someone who can write the repository can write the
record too. The repository is code; docs/operations.md, "Trust boundary", says who may write it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shlex
import time
from pathlib import Path, PurePosixPath

from server.errors import EngineError

RECORD = "SHA256SUMS"
_LINE = re.compile(r"^(?P<digest>[0-9a-fA-F]{64}) [ *](?P<name>.+)$")
# A file whose timestamps are this close to the hash may still change within the same clock
# tick without its stat changing (git's "racy clean" rule): its digest is not remembered.
_RACY_NS = 2_000_000_000

logger = logging.getLogger("server.engines")
_remembered: dict[tuple[str, int, int, int, int, int], str] = {}
_warned: set[str] = set()


def file_digest(path: Path, chunk: int = 1 << 20) -> str:
    """sha256 of a file's bytes, streamed (artifacts may be GBs)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def record_command(folder: Path, names: list[str]) -> str:
    """The shell line that records `names` of `folder`: what a warning tells a user to run."""
    return f"cd {shlex.quote(str(folder))} && sha256sum {' '.join(shlex.quote(n) for n in names)} > {RECORD}"


def record_digests(folder: Path, names: list[str] | None = None) -> Path:
    """Write `folder/SHA256SUMS` for `names` (default: every file under it but hidden ones and
    the record itself), atomically and durably; returns its path.

    For a user's own model: `record_digests(Path("models/mine/1"))`, or the `sha256sum` line of
    `record_command`. Record only files whose content you trust: the record vouches for them."""
    folder = Path(folder)
    if names is None:
        names = sorted(
            p.relative_to(folder).as_posix() for p in folder.rglob("*")
            if p.is_file() and p.name != RECORD and not any(part.startswith(".") for part in p.relative_to(folder).parts)
        )
    lines = []
    for name in names:
        if "\n" in name or "\\" in name:  # sha256sum would escape these; keep the file plain
            raise ValueError(f"cannot record {name!r}: a newline or backslash in a file name")
        lines.append(f"{file_digest(folder / name)}  {name}\n")
    target = folder / RECORD
    partial = folder / f".{RECORD}.tmp"
    with partial.open("w", encoding="utf-8") as handle:
        handle.writelines(lines)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, target)
    return target


def read_digests(folder: Path) -> dict[str, str] | None:
    """The record of `folder` (file name -> lowercase hex digest); None when there is none.
    A line that is not a `sha256sum` line, or a name outside the folder, is refused."""
    path = Path(folder) / RECORD
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise EngineError(f"{path} cannot be read: {exc}") from exc
    digests: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):  # sha256sum -c skips comment lines too
            continue
        match = _LINE.match(line)
        name = match["name"] if match else ""
        parts = PurePosixPath(name).parts
        if not match or name.startswith("/") or ".." in parts:
            raise EngineError(f"{path} line {number} is not a sha256sum line for a file of its folder: {line!r}")
        digests[PurePosixPath(name).as_posix()] = match["digest"].lower()
    return digests


def verify_artifact(artifact: Path, folder: Path) -> None:
    """Check every file `folder`'s record lists (as `sha256sum -c` would), and that the
    artifact is one of them; raise EngineError naming what differs.

    No record: the artifact loads with a warning (once per folder), as a model copied in by hand
    would on Triton; the warning says how to record one."""
    record = read_digests(folder)
    name = Path(os.path.relpath(artifact, folder)).as_posix()
    if record is not None and name.startswith("../"):
        raise EngineError(f"{artifact} is outside its version folder {folder}, which {RECORD} vouches for")
    if record is None:
        if str(folder) not in _warned:
            _warned.add(str(folder))
            logger.warning(
                "%s has no %s: %s loads unverified. Record its digest: %s (docs/operations.md, trust boundary)",
                folder, RECORD, name, record_command(folder, [name]),
            )
        return
    if name not in record:
        raise EngineError(
            f"{folder / RECORD} does not list {name}, the file this model loads: record it "
            f"({record_command(folder, sorted({*record, name}))}) or rebuild the model"
        )
    for listed, expected in sorted(record.items(), key=lambda item: item[0] != name):  # the artifact first
        path = folder / listed
        if not path.is_file():
            raise EngineError(f"{folder / RECORD} lists {listed}, which is missing (a half-copied version folder?)")
        actual = _digest(path)
        if actual != expected:
            raise EngineError(
                f"{path} does not match its recorded sha256 ({folder / RECORD}: {expected[:12]}..., "
                f"file: {actual[:12]}...): it was damaged, half-copied or replaced since it was built. "
                "Rebuild or re-copy the version folder; if you changed it on purpose, record it again"
            )


def _digest(path: Path) -> str:
    """file_digest, remembered while the file's identity and timestamps stay the same, so that
    each instance of a model does not hash the same GBs again."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    if key in _remembered:
        return _remembered[key]
    started = time.time_ns()
    digest = file_digest(path)
    if max(stat.st_mtime_ns, stat.st_ctime_ns) < started - _RACY_NS:
        _remembered[key] = digest
    return digest
