"""`batchline serve` with a GPU stand-in: for measuring how many cores feed one device on a
machine that has none.

    python -m loadtest.standin serve --model-repository FOLDER ...   (the flags of `batchline serve`)

ONNX Runtime models load as usual (configs, signatures and warm-up are real), but a batch costs
wall time instead of CPU, as a GPU kernel does: each run holds the device for
STANDIN_FIXED_US + STANDIN_ITEM_US x its rows (default 1,000 + 10 us), sleeping, and answers
zeros of the outputs' shapes. The device is a file lock (STANDIN_DEVICE_LOCK, default one per
user in /tmp), so several server processes share one device the way they would share one GPU:
one batch at a time.

STANDIN_REUSE_PORT=1 makes the server listen in the port's SO_REUSEPORT group, so that several
whole servers can share one port: the design `--http-workers` is measured against. The server
itself has no such option: a second server started on a port by mistake must fail, not share.
"""

from __future__ import annotations

import fcntl
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

FIXED_US = float(os.environ.get("STANDIN_FIXED_US", "1000"))
ITEM_US = float(os.environ.get("STANDIN_ITEM_US", "10"))
DEVICE_LOCK = Path(os.environ.get("STANDIN_DEVICE_LOCK", Path(tempfile.gettempdir()) / f"batchline-standin-{os.getuid()}.lock"))


class Device:
    """One device for every process that opens the same lock file: a batch holds it while it runs."""

    def __init__(self, lock_path: Path) -> None:
        self._fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)

    def run(self, rows: int) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # blocks without the GIL, as a CUDA sync does
        try:
            time.sleep((FIXED_US + ITEM_US * rows) / 1e6)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)


def install() -> None:
    """Replace ONNX Runtime's batch run with the stand-in (and, if asked, the HTTP socket with
    one in the port's SO_REUSEPORT group)."""
    from server import cli
    from server.engines import onnxruntime as engine_module

    device = Device(DEVICE_LOCK)

    def run(self: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = len(next(iter(inputs.values())))
        device.run(rows)
        return {output.name: np.zeros((rows, *output.shape[1:]), dtype=np.float32)
                for output in self._session.get_outputs()}

    engine_module.OnnxRuntimeEngine.run = run  # type: ignore[method-assign]
    if os.environ.get("STANDIN_REUSE_PORT") == "1":
        from server.http.shared_port import reuse_port_socket

        cli._listen = lambda host, port: reuse_port_socket(host, port, listen=True)  # type: ignore[assignment]


def main(argv: list[str]) -> int:
    from server import cli

    install()
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
