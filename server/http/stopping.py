"""uvicorn's server, told to tell the data plane the moment a stop is asked for."""

from __future__ import annotations

from types import FrameType

import uvicorn

from server.dataplane import DataPlane


class StoppingServer(uvicorn.Server):
    """On SIGTERM or SIGINT readiness turns false and new inference is refused (503) at once, so
    the orchestrator stops routing here; uvicorn's graceful shutdown then lets what is queued and
    running finish before the models are unloaded."""

    def __init__(self, plane: DataPlane, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._plane = plane

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._plane.begin_stop()
        super().handle_exit(sig, frame)
