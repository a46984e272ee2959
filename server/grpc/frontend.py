"""The gRPC front end: grpc.aio serving Triton's GRPCInferenceService on the Server's loop.

Draining: open streams stop being read, answer what they hold, then end with UNAVAILABLE so
their clients reconnect elsewhere; calls in flight get up to `grace_s` (the HTTP front end's
30 s) while new ones are refused with UNAVAILABLE; then grpc stops, cancelling what is left.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import grpc

from server.access_log import AccessLog
from server.dataplane import DataPlane
from server.grpc.access import Policy
from server.grpc.protos import grpc_service_pb2_grpc as pb_grpc
from server.grpc.servicer import InferenceServicer
from server.inflight import InFlight
from server.server import StartFailed
from server.settings import ServerSettings

logger = logging.getLogger(__name__)

GRACE_S = 30.0
DRAIN_POLL_S = 0.02


class GrpcFrontEnd:
    name = "grpc"

    def __init__(
        self,
        plane: DataPlane,
        host: str,
        port: int,
        policy: Policy | None = None,
        access_log: AccessLog | None = None,
        max_message_bytes: int = 64 << 20,
        flight: InFlight | None = None,
        on_bound: Callable[[int], None] | None = None,
        grace_s: float = GRACE_S,
    ) -> None:
        self._address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._host = host
        self._options = [
            ("grpc.max_receive_message_length", max_message_bytes),  # past it: RESOURCE_EXHAUSTED, unread
            ("grpc.max_send_message_length", -1),  # answers are bounded by the model; clients set their own
            ("grpc.so_reuseport", 0),  # a port in use is an error, never shared with another server
        ]
        self.servicer = InferenceServicer(plane, policy, access_log, flight)
        self._on_bound = on_bound
        self._grace_s = grace_s
        self._server: grpc.aio.Server | None = None
        self._forced = False
        self._forced_stop: asyncio.Task[None] | None = None
        self.port: int | None = None

    async def start(self) -> None:
        server = grpc.aio.server(options=self._options)
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(self.servicer, server)
        try:
            port = server.add_insecure_port(self._address)
        except RuntimeError as exc:  # grpc's words for a port in use or an address it cannot bind
            raise StartFailed(f"gRPC cannot listen on {self._address}: {exc}") from exc
        if port == 0:  # some grpc versions answer a failed bind with port 0
            raise StartFailed(f"gRPC cannot listen on {self._address}")
        await server.start()
        self._server, self.port = server, port
        logger.info("serving gRPC on %s:%d", self._host, port)
        if self._on_bound is not None:
            self._on_bound(port)

    async def drain(self) -> None:
        """Calls in flight finish first while the port stays open: a call that comes meanwhile
        is answered UNAVAILABLE by the data plane (retry elsewhere), where a closing grpc
        server would answer CANCELLED, which clients do not retry. Then the port closes."""
        if self._server is None:
            return
        self.servicer.stop_streams()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._grace_s
        while self.servicer.busy and loop.time() < deadline and not self._forced:
            await asyncio.sleep(DRAIN_POLL_S)
        await self._server.stop(0 if self._forced else max(0.0, deadline - loop.time()))

    def force(self) -> None:
        self._forced = True
        if self._server is not None:  # kept: a task nobody holds may be collected before it runs
            self._forced_stop = asyncio.get_running_loop().create_task(self._server.stop(None))


def grpc_frontends(
    settings: ServerSettings,
    plane: DataPlane,
    policy: Policy | None,
    flight: InFlight,
    write_port_file: Callable[[Path, int], None],
) -> list[GrpcFrontEnd]:
    """The gRPC front end `batchline serve` runs beside HTTP, or none with --allow-grpc false.
    A request's size limit is HTTP's; requests in flight count in the server's one `flight`."""
    if not settings.allow_grpc:
        return []
    port_file = settings.grpc_port_file
    on_bound = None if port_file is None else (lambda port: write_port_file(port_file, port))
    return [GrpcFrontEnd(
        plane, settings.host, settings.grpc_port, policy, AccessLog(settings.access_log),
        max_message_bytes=settings.max_body_bytes, flight=flight, on_bound=on_bound,
    )]
