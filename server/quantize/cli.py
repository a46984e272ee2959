"""`batchline build MODEL --engine E --precision P [--name N] [--force] [--report]`.

Wired into server/cli.py with `add_build_parser(commands)`; the handler returns the exit code:
0 a servable version exists (built or cached), 1 the build failed its quality gate (nothing was
published), 2 no build could be made (bad model, unsupported combination, missing library).
"""

from __future__ import annotations

import argparse
import json
import sys

from server.engines.registry import ENGINES
from server.settings import RepositorySettings, add_setting_flags, settings_from

PRECISIONS = ("fp32", "fp16", "bf16", "int8")


def add_build_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "build",
        help="build a quantized / lower-precision variant of a model, gated on quality",
        description="Build MODEL for an engine and precision as a new model of the repository "
        "(default name MODEL-ENGINE-PRECISION). The build is evaluated against FP32 on the model's "
        "held-out data (models/MODEL/eval/) and published as the variant's next version only if it "
        "passes the quality gate. An identical earlier build is reused (cache). Steps are printed on "
        "stderr; on a terminal, long steps (calibration, evaluation, timing) draw progress bars.",
    )
    parser.add_argument("model", help="the FP32 source model")
    parser.add_argument("--engine", required=True, choices=list(ENGINES))
    parser.add_argument("--precision", required=True, choices=PRECISIONS)
    parser.add_argument("--name", help="the variant's name (default MODEL-ENGINE-PRECISION)")
    parser.add_argument(
        "--device", choices=("cpu", "gpu"), default=None,
        help="evaluate and time the build (and FP32) on the CPU or on GPU 0, and serve the variant there "
        "(default: the variant's earlier build's, else cpu; tensorrt: always gpu)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when the cache has this build")
    parser.add_argument("--report", action="store_true", help="print the variant's latest report; build nothing")
    parser.add_argument(
        "--option", action="append", default=[], metavar="KEY=VALUE",
        help="builder option, e.g. per_channel=false, mode=static, scheme=weight_only, keep_io_types=true (repeatable)",
    )
    parser.add_argument("--no-benchmark", action="store_true", help="skip the speed measurements")
    parser.add_argument("--bench-seconds", type=float, default=1.0, help="timed seconds per batch size (default 1)")
    parser.add_argument("--sequence-length", type=int, default=32,
                        help="text models: tokens per timed item (default 32)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of markdown")
    add_setting_flags(parser, RepositorySettings)
    parser.set_defaults(handler=run_build)
    return parser


def parse_option(text: str) -> tuple[str, bool | int | float | str]:
    """KEY=VALUE with VALUE read as JSON when it is (true, 3, 0.5), else kept as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--option wants KEY=VALUE, got {text!r}")
    try:
        parsed = json.loads(value)
    except ValueError:
        return key, value
    if not isinstance(parsed, (bool, int, float, str)):
        raise ValueError(f"--option {key}: a scalar value is expected, got {value!r}")  # noqa: TRY004 - said as a usage error
    return key, parsed


def run_build(args: argparse.Namespace) -> int:
    from server.errors import BatchlineError
    from server.quantize.api import build
    from server.quantize.progress import bars
    from server.quantize.reporting import report
    from server.quantize.variant import variant_name

    repository = settings_from(args, RepositorySettings).model_repository.absolute()
    variant = args.name or variant_name(args.model, args.engine, args.precision)
    try:
        if args.report:
            print(report(repository, variant))
            return 0
        options = dict(parse_option(o) for o in args.option) if args.option else None
        result = build(
            repository, args.model, args.engine, args.precision, name=args.name, force=args.force, device=args.device,
            options=options, benchmark=not args.no_benchmark, bench_seconds=args.bench_seconds,
            sequence_length=args.sequence_length,
            progress=lambda message: print(message, file=sys.stderr, flush=True), track=bars(sys.stderr),
        )
    except (BatchlineError, ValueError, OSError) as exc:  # OSError: a repository it cannot write (never 1: the gate's)
        print(f"batchline build: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 2
    print(result.to_json() if args.json else result.markdown())
    if result.servable:
        print(f"{variant}: a running server serves this version after a restart or, if it was started with "
              f"--model-control, after `curl -X POST -H 'Content-Type: application/json' "
              f"[-H \"Authorization: Bearer $ADMIN_TOKEN\"] localhost:8000/v2/repository/models/{variant}/load`",
              file=sys.stderr)
    return 0 if result.servable else 1
