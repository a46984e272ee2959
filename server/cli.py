"""`batchline` command line: serve a model repository."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from server import __version__
from server.config import ServerSettings
from server.quantize.cli import add_build_parser


def settings_from(args: argparse.Namespace) -> ServerSettings:
    """Environment (BATCHLINE_*) first, flags over it."""
    overrides = {
        k: v
        for k, v in {
            "model_repository": args.model_repository,
            "host": args.host,
            "http_port": args.http_port,
            "log_level": args.log_level,
            "models": args.model or None,
            "engine_threads": args.engine_threads,
            "device_price_per_hour": args.device_price_per_hour,
            "access_log": args.access_log,
        }.items()
        if v is not None
    }
    return ServerSettings(**overrides)


def _serve(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not settings.model_repository.is_dir():
        logging.error("model repository %s is not a folder", settings.model_repository)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub at run time
    import uvicorn

    from server.dataplane import DataPlane
    from server.http.access_log import AccessLog
    from server.http.app import create_app
    from server.metrics import build_registry
    from server.repository import ModelRepository

    repository = ModelRepository(settings.model_repository.resolve(), settings.engine_threads)
    plane = DataPlane(repository)
    metrics = build_registry(repository, settings.device_price_per_hour)
    app = create_app(plane, settings.models, settings.max_body_bytes, metrics, AccessLog(settings.access_log))
    logging.getLogger(__name__).info(
        "batchline %s serving %s on http://%s:%d",
        __version__, settings.model_repository, settings.host, settings.http_port,
    )
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.http_port,
        log_level=settings.log_level,
        loop="uvloop",
        http="httptools",
        access_log=False,
        timeout_graceful_shutdown=30,
    )
    return 0


def _bench(args: argparse.Namespace) -> int:
    try:
        from loadtest.bench import main as bench_main
    except ImportError as exc:
        logging.error("the benchmark tools are not installed (pip install 'batchline[loadtest]'): %s", exc)
        return 2
    return bench_main(args.arguments)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchline", description="KServe v2 inference server.")
    parser.add_argument("--version", action="version", version=f"batchline {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve a model repository over HTTP",
        description="Serve a model repository over KServe v2 HTTP. Every flag can also be set "
        "by an environment variable BATCHLINE_<NAME> (e.g. BATCHLINE_HTTP_PORT); flags win.",
    )
    serve.add_argument("--model-repository", help="folder of models (default: models)")
    serve.add_argument("--host", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--http-port", type=int, help="HTTP port (default: 8000)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="default: info")
    serve.add_argument(
        "--engine-threads", type=int, metavar="N",
        help="threads per engine instance for every model, overriding the configs (e.g. 1 when pinned to one core)",
    )
    serve.add_argument(
        "--access-log", choices=["off", "text", "json"],
        help="a line per infer request with id, model, status, queue and compute times (default: off)",
    )
    serve.add_argument(
        "--device-price-per-hour", type=float, metavar="USD",
        help="price of this replica's device per hour, exported as batchline_device_price_per_hour",
    )
    serve.add_argument(
        "--model", action="append", metavar="NAME", help="load only this model at start (repeatable)"
    )
    serve.set_defaults(handler=_serve)
    bench = commands.add_parser(
        "bench",
        help="benchmarks: engine ceiling, closed/open loop, batching on/off (see `batchline bench --help`)",
        add_help=False,
    )
    bench.add_argument("arguments", nargs=argparse.REMAINDER, help="a mode and its flags (see `batchline bench --help`)")
    bench.set_defaults(handler=_bench)
    add_build_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # CUDA numbers GPUs fastest first by default, NVML (metrics, placement) by PCI bus: make them
    # agree before anything initialises CUDA, unless the operator chose otherwise.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    if argv[:1] == ["bench"]:  # everything after `bench` belongs to the benchmark's own parser
        return _bench(argparse.Namespace(arguments=argv[1:]))
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
