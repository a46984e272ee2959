"""The port a server bound, written for whoever started it (`--port-file`)."""

from __future__ import annotations

from pathlib import Path


def write_port_file(path: Path, port: int) -> None:
    """Written beside, then renamed: whoever polls for the file never reads half a number."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(f"{port}\n")
    partial.replace(path)
