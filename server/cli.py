"""`batchline` command line: serve a model repository."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys
import tempfile
import threading
from importlib.metadata import entry_points

from server import __version__
from server.model_import import add_import_parser
from server.port_file import write_port_file
from server.quantize.cli import add_build_parser
from server.settings import InvalidSettings, add_setting_flags, settings_from


def _serve(args: argparse.Namespace) -> int:
    try:
        settings = settings_from(args)
    except InvalidSettings as exc:
        print(f"batchline serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not settings.model_repository.is_dir():
        logging.getLogger(__name__).error("model repository %s is not a folder", settings.model_repository)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub at run time
    import uvloop

    from server.access_log import AccessLog
    from server.dataplane import DataPlane
    from server.devices import describe_stack
    from server.grpc.frontend import grpc_frontends
    from server.heap import HeapPolicy
    from server.http.app import create_app
    from server.http.auth import AccessPolicy, SettingsError
    from server.http.frontend import HttpFrontEnd
    from server.http.shared_port import reserve_port
    from server.http.workers import HttpWorkers
    from server.inflight import InFlight
    from server.metrics import build_registry
    from server.repository import ModelRepository
    from server.server import FrontEnd, Server, StartFailed
    from server.shared_memory import SystemSharedMemory

    try:
        access = AccessPolicy.from_settings(settings)
    except SettingsError as exc:
        logging.getLogger(__name__).error("not starting: %s", exc)
        return 2
    repository = ModelRepository(settings.model_repository.resolve(), settings.engine_threads)
    heap = HeapPolicy().install()
    regions = SystemSharedMemory(settings.allow_client_shm, settings.max_body_bytes, settings.max_in_flight_bytes)
    plane = DataPlane(repository, heap, regions, settings.max_output_bytes)
    metrics = build_registry(repository, settings.device_price_per_hour, heap=heap)
    flight = InFlight(settings.max_in_flight, settings.max_in_flight_bytes)  # every front end's
    app = create_app(plane, settings.max_body_bytes, metrics, AccessLog(settings.access_log), access, flight)
    try:
        listener = (_listen(settings.host, settings.http_port) if settings.http_workers == 1
                    else reserve_port(settings.host, settings.http_port))
    except OSError as exc:
        logging.getLogger(__name__).error("cannot listen on %s port %d: %s", settings.host, settings.http_port, exc)
        return 1
    port = int(listener.getsockname()[1])
    logging.getLogger(__name__).info(
        "batchline %s serving %s on http://%s:%d", __version__, settings.model_repository, settings.host, port,
    )
    # On a GPU machine naming the stack imports torch and onnxruntime (seconds): not on the way to serving.
    threading.Thread(target=lambda: logging.getLogger(__name__).info("devices: %s", describe_stack()),
                     name="describe-devices", daemon=True).start()
    if settings.port_file is not None:
        write_port_file(settings.port_file, port)
    with contextlib.ExitStack() as cleanup:
        if settings.http_workers == 1:
            http: list[FrontEnd] = [HttpFrontEnd(app, listener, settings.log_level)]
        else:  # the app listens on a private socket, for the front-end processes to forward to
            private = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="batchline-"))
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.bind(os.path.join(private, "app.sock"))
            upstream.listen(2048)
            http = [HttpFrontEnd(app, upstream, settings.log_level),
                    HttpWorkers(settings, plane, port, settings.http_workers, upstream.getsockname(),
                                os.path.join(private, "link.sock"))]
        server = Server(plane, [*http, *grpc_frontends(settings, plane, access, flight, write_port_file)],
                        settings.models)
        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(server.run())
        except StartFailed as exc:
            logging.getLogger(__name__).error("not serving: %s", exc)
            return 3
        finally:
            listener.close()
    return 0  # a clean stop: a container's orchestrator reads anything else as a fault


def _listen(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound here rather than by uvicorn so that its port is known before the
    server starts: with port 0 the system picks a free one that nobody can take in between."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


# Commands that other installed packages add to `batchline` (the benchmarks add `bench`), found
# by name among the installed entry points: the server never imports the tools built on it.
COMMANDS = "batchline.commands"


def _bench(args: argparse.Namespace) -> int:
    found = entry_points(group=COMMANDS, name="bench")
    try:
        run = next(iter(found)).load() if found else None
    except ImportError as exc:
        logging.getLogger(__name__).error("the benchmark tools are not installed (pip install 'batchline[loadtest]'): %s", exc)
        return 2
    if run is None:  # the package's metadata predates the command: an install from before it
        logging.getLogger(__name__).error("the bench command is not registered with this install of batchline: "
                                          "reinstall it (pip install -e '.[loadtest]' in a checkout)")
        return 2
    return int(run(args.arguments))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchline", description="KServe v2 inference server.")
    parser.add_argument("--version", action="version", version=f"batchline {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve a model repository over HTTP and gRPC",
        description="Serve a model repository over KServe v2 HTTP and gRPC. Every flag can also be set "
        "by an environment variable BATCHLINE_<NAME> (e.g. BATCHLINE_HTTP_PORT); flags win.",
    )
    add_setting_flags(serve)
    serve.set_defaults(handler=_serve)
    bench = commands.add_parser(
        "bench",
        help="benchmarks: engine ceiling, closed/open loop, batching on/off (see `batchline bench --help`)",
        add_help=False,
    )
    bench.add_argument("arguments", nargs=argparse.REMAINDER, help="a mode and its flags (see `batchline bench --help`)")
    bench.set_defaults(handler=_bench)
    add_build_parser(commands)
    add_import_parser(commands)
    return parser


# Library log lines that are known and harmless here, and that a user cannot act on: torchao's
# optional GPU kernels that a CPU machine cannot load, and torch's deprecation notes about
# torchao's enums. Their errors still show.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    # CUDA numbers GPUs fastest first by default, NVML (metrics, placement) by PCI bus: make them
    # agree before anything initialises CUDA, unless the operator chose otherwise.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    if argv[:1] == ["bench"]:  # everything after `bench` belongs to the benchmark's own parser
        return _bench(argparse.Namespace(arguments=argv[1:]))
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
