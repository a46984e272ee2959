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
from typing import Any

import grpc

from server.access_log import AccessLog
from server.dataplane import DataPlane
from server.grpc.access import Policy
from server.grpc.protos import grpc_service_pb2_grpc as pb_grpc
from server.grpc.servicer import SERVICE_NAME, InferenceServicer
from server.inflight import InFlight
from server.server import StartFailed
from server.settings import ServerSettings

logger = logging.getLogger(__name__)

GRACE_S = 30.0
DRAIN_POLL_S = 0.02
# Calls open at once: one waiting for its message, or a stream between its requests, costs about
# 25 KB and none of the in-flight bound (which counts requests once their message is in). A client
# opening streams and sending nothing held 57,000 on one connection (1.6 GB), growing without end.
# Past CALLS_PER_REQUEST x --max-in-flight open calls a new one gets RESOURCE_EXHAUSTED at once; a
# connection may open at most STREAMS_PER_CONNECTION at a time (HTTP/2's own limit: a client
# waits for one to finish before it opens more).
CALLS_PER_REQUEST = 4
STREAMS_PER_CONNECTION = 256


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
            ("grpc.max_concurrent_streams", STREAMS_PER_CONNECTION),
        ]
        flight = flight or InFlight()
        self.max_calls = CALLS_PER_REQUEST * flight.max_requests
        self.servicer = InferenceServicer(plane, policy, access_log, flight)
        self._on_bound = on_bound
        self._grace_s = grace_s
        self._server: grpc.aio.Server | None = None
        self._forced = False
        self._forced_stop: asyncio.Task[None] | None = None
        self.port: int | None = None

    async def start(self) -> None:
        server = grpc.aio.server(options=self._options, maximum_concurrent_rpcs=self.max_calls)
        _serve_infer_unparsed(self.servicer, server)
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


UNPARSED_RPCS = ("ModelInfer", "ModelStreamInfer")


class _Handlers:
    """Takes the method handlers the generated code registers, to change them before a server
    gets them."""

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same methods come again through add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.handlers = handlers


def _serve_infer_unparsed(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    """The service as generated, but the infer RPCs get their messages as received, and the
    servicer parses them after the refusals that need only their size (a stopping server, the
    in-flight bounds): grpc would parse every message first, and a message of millions of
    strings holds the event loop (and the GIL: a thread would not help) for tens of
    milliseconds a megabyte. A message that is not a ModelInferRequest is INVALID_ARGUMENT."""
    generated = _Handlers()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, generated)
    handlers = {
        name: handler._replace(request_deserializer=None) if name in UNPARSED_RPCS else handler
        for name, handler in generated.handlers.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


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
