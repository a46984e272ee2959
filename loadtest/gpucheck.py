"""`loadtest/gpu_check OUTDIR`: the whole GPU story in one command, stopped by 8 minutes.

On a GPU host (loadtest/README.md, "GPU check"): install the carried wheels into a throwaway
folder (`--wheels DIR`), build random-weight models of real shapes (ResNet-50, a BERT-base
encoder, the shipped digits CNN) in FP32, FP16, BF16 and INT8 where the stack allows, plus digits
torch.compiled per batch bucket (reduce-overhead: a CUDA graph per bucket) and ResNet-50 with two
instances on the GPU (gpucheck_coverage.py); time each engine alone per batch bucket, serve them
all on the GPU through the real HTTP server with binary tensors and many concurrent clients, serve
digits again with 1, 2, 4 and 8 HTTP front-end processes (gpucheck_frontends.py), and write
OUTDIR/gpu_check.json (the record) and OUTDIR/gpu_check.md (the tables, and what the host cannot
cover), with the server's log.

Every phase has a time budget; the serving phase takes what is left but what it keeps back for
the front-end curve, which takes the rest. A watchdog writes what there is and stops the run at
the limit. The report is rewritten after each phase, so even a run killed from outside leaves its
figures; anything cut short is marked partial, with the reason, and a phase that ran past its
budget is marked so.

`--dry-run` runs the same flow on the CPU with tiny models and seconds of load (the test of this
module); `--fetch-wheels DIR` is the step before, on a machine with PyPI (gpucheck_wheels.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadtest import gpucheck_wheels as wheels
from loadtest.gpucheck_coverage import (
    Extra,
    compiler_problem,
    instance_comparison,
    not_covered,
    server_compiles,
)
from loadtest.gpucheck_frontends import Curve
from loadtest.machine import machine_record

TIME_LIMIT_S = 480.0
DRY_RUN_TIME_LIMIT_S = 1200.0  # the CPU rehearsal: bounded, but not by the GPU host's minutes
REPORT_RESERVE_S = 10.0  # kept back from the phases for the last report and the server's stop
WATCHDOG_MARGIN_S = 3.0  # the watchdog writes and exits this long before the limit
OVER_BUDGET_GRACE_S = 1.0  # a phase may end this long past its budget before it is marked over it
JSON_FILE, MARKDOWN_FILE, SERVER_LOG, PROGRESS_LOG = "gpu_check.json", "gpu_check.md", "server.log", "progress.log"
SCHEMA = "batchline.gpu_check/2"  # 2: front_ends is a list of curves (1: one curve, or a list from a tree before 2)
ROLES = ("digits", "resnet", "bert")  # build order: the cheap one first
PHASES = ("engine", "serve", "front_ends")  # after install and build, which always run


@dataclass(frozen=True)
class Profile:
    """Sizes and budgets of one kind of run."""

    mode: str  # "gpu" | "dry-run"
    # phase -> seconds at most; serve takes what is left but what it keeps back for the front-end
    # curve ("front_ends", never so much that serve gets under "serve_floor"), which then takes the rest
    budgets: dict[str, float]
    max_batch: dict[str, int]  # role -> max_batch_size
    buckets: dict[str, list[int]]  # role -> engine-alone batch sizes
    items_per_request: dict[str, int]
    concurrency: dict[str, int]  # role -> concurrent clients
    engine_seconds: float  # per batch bucket
    served_seconds: float  # per variant, after its warm-up
    served_warmup_s: float
    client_processes: int
    instances: int  # engine instances per model
    threads: int | None  # CPU threads per engine (None: the engine's default)
    precisions: tuple[str, ...] = ("fp32", "fp16", "bf16", "int8")
    extras: tuple[Extra, ...] = ()  # variants built from a plain one: compiled, more instances
    # --http-workers counts of the front-end curve (gpucheck_frontends.py), in the order they run:
    # one process first (the others read against it), then the far end, so that a curve cut short
    # by time still spans the range
    front_ends: tuple[int, ...] = (1, 8, 2, 4)
    front_end_curves: tuple[Curve, ...] = (Curve("digits", "fp32"),)
    front_end_concurrency: int = 256
    front_end_clients: int = 6  # client processes of the front-end curve
    front_end_start_s: float = 10.0  # about what one server start takes there: a count given less is skipped
    differences: tuple[str, ...] = ()  # what this kind of run does unlike the GPU run, for the report
    roles: tuple[str, ...] = ROLES  # the models built
    phases: tuple[str, ...] = PHASES  # the phases run after the build
    only: tuple[tuple[str, str], ...] | None = None  # (role, precision) of the variants built; None: all

    def builds(self, role: str, precision: str) -> bool:
        return self.only is None or (role, precision) in self.only


# On the GPU the compiled variant's buckets are its role's engine buckets, so that its figures read
# against the plain variant's bucket by bucket; the ResNet of two instances is FP16, where a batch's host
# staging (77 MB of FP32 pixels at 128) is as long as its compute, so that overlap shows. The load
# of the models whose requests carry one item is 256 clients from 6 processes: the first run's 128
# from 4 got ResNet-50 FP16 half what one server process served the curves' 256 from 6.
GPU = Profile(
    mode="gpu",
    budgets={"install": 60, "build": 150, "engine": 120, "front_ends": 60, "serve_floor": 100, "server_start": 150},
    max_batch={"resnet": 128, "bert": 64, "digits": 1024},
    buckets={"resnet": [1, 8, 32, 128], "bert": [1, 8, 32, 64], "digits": [1, 64, 256, 1024]},
    items_per_request={"resnet": 1, "bert": 1, "digits": 16},
    concurrency={"resnet": 256, "bert": 256, "digits": 64},
    engine_seconds=1.0, served_seconds=6.0, served_warmup_s=1.5, client_processes=6, instances=1, threads=None,
    extras=(Extra("digits", "fp32", "compiled", compile_mode="reduce-overhead"),
            Extra("resnet", "fp16", "x2", instances=2)),
)
DRY_RUN = Profile(
    mode="dry-run",
    # Generous: on the CPU nothing waits for the run, and a shared 2-core machine under another
    # job's load compiles digits several times slower than a quiet one (the real run keeps 8 min).
    budgets={"install": 60, "build": 240, "engine": 240, "front_ends": 150, "serve_floor": 120,
             "server_start": 400},
    max_batch={"resnet": 8, "bert": 8, "digits": 64},
    buckets={"resnet": [1, 8], "bert": [1, 8], "digits": [1, 64]},
    items_per_request={"resnet": 1, "bert": 1, "digits": 4},
    concurrency={"resnet": 4, "bert": 4, "digits": 4},
    engine_seconds=0.1, served_seconds=0.4, served_warmup_s=0.15, client_processes=2, instances=1, threads=1,
    precisions=("fp32", "int8"),
    extras=(Extra("digits", "fp32", "compiled", compile_mode="default", buckets=(64,)),
            Extra("resnet", "fp32", "x2", instances=2)),
    front_ends=(1, 2), front_end_concurrency=8, front_end_clients=2, front_end_start_s=4.0,
    differences=(
        ("runs on the CPU: tiny models (ResNet of 4 bottlenecks at 32x32, BERT of 2 layers at sequence 16,"
         " digits trained 1 epoch), one CPU thread per engine, seconds of load from 2 client processes"),
        ("no FP16 or BF16 variants: each is the FP32 program cast by the torch engine at load, a path of"
         " its own in the GPU run (tests/unit/engines test the cast); on a CPU they only cost time"),
        ("digits compiled in torch.compile's default mode over the one bucket [64] (batches of 1 padded up to"
         " it), not reduce-overhead over [1, 64, 256, 1024]: a CPU has no CUDA graphs (reduce-overhead compiles as"
         " default does there), and each compile on the CPU builds C++ kernels, seconds apiece"),
        "the ResNet of two instances is FP32 (no FP16 here) on CPU instances: two threads of compute, no CUDA streams",
        "the front-end curve runs 1 and 2 front ends, not 1, 2, 4 and 8, with 8 clients from 2 processes",
    ),
)


class Run:
    """The record of one check, its clock and its files."""

    def __init__(self, out: Path, profile: Profile, limit_s: float, argv: list[str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.out = out
        self.profile = profile
        self.limit_s = limit_s
        self.clock = clock  # the run's budgets and elapsed times (the tests pass a fake one)
        self.started = clock()
        # a short limit (the tests') scales the reserve and the watchdog's margin down with it
        self.deadline = self.started + limit_s - min(REPORT_RESERVE_S, 0.1 * limit_s)
        self.stop_at = self.started + limit_s - min(WATCHDOG_MARGIN_S, 0.05 * limit_s)
        self.lock = threading.RLock()
        self.finished = False
        self.record: dict[str, Any] = {
            "schema": SCHEMA,
            "mode": profile.mode,
            "command_line": " ".join(["loadtest/gpu_check", *argv]),
            "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "time_limit_s": limit_s,
            "complete": False,
            "partial": [],  # why anything is missing: phases cut short, variants skipped
            "phases": {},
            "profile": {k: [asdict(e) for e in v] if k in ("extras", "front_end_curves") else v
                        for k, v in vars(profile).items() if k != "differences"},
            "dry_run_differences": list(profile.differences),
            "models": {},
            "summary": [],
        }
        out.mkdir(parents=True, exist_ok=True)
        (out / PROGRESS_LOG).write_text("")

    def elapsed(self) -> float:
        return self.clock() - self.started

    def left(self) -> float:
        return self.deadline - self.clock()

    def log(self, message: str) -> None:
        line = f"[gpu_check {self.elapsed():6.1f}s] {message}"
        print(line, flush=True)
        with (self.out / PROGRESS_LOG).open("a") as log:
            log.write(line + "\n")

    def partial(self, reason: str) -> None:
        with self.lock:
            self.record["partial"].append(reason)
        self.log(f"PARTIAL: {reason}")

    @contextmanager
    def phase(self, name: str, budget: float | None) -> Iterator[float]:
        """Yield the phase's deadline (on the run's clock); record its time and outcome. A phase
        that raises is recorded as failed with the reason, and the run goes on to the report. A
        phase that ends past its budget (a step longer than the time it had left: a compile, a
        load) is marked `over_budget_s`, which the report shows: the budgets are what keeps the
        whole run within its limit, so the phases after it had less time than planned."""
        seconds = self.left() if budget is None else min(budget, self.left())
        entry: dict[str, Any] = {"budget_s": round(seconds, 1), "status": "running"}
        with self.lock:
            self.record["phases"][name] = entry
        self.log(f"phase {name}: up to {seconds:.0f} s")
        start = self.clock()
        try:
            yield start + seconds
            entry["status"] = "done"
        except Exception as exc:  # noqa: BLE001 (recorded; the other phases and the report still run)
            entry.update(status="failed", error=f"{type(exc).__name__}: {exc}",
                         traceback=traceback.format_exc(limit=8)[-3000:])
            self.partial(f"phase {name} failed: {type(exc).__name__}: {exc}")
        finally:
            took = self.clock() - start
            entry["took_s"] = round(took, 1)
            if took > seconds + OVER_BUDGET_GRACE_S:
                entry["over_budget_s"] = round(took - seconds, 1)
                self.log(f"phase {name}: OVER its budget of {seconds:.0f} s by {entry['over_budget_s']} s")
            self.log(f"phase {name}: {entry['status']} in {entry['took_s']} s")
            self.write()

    def write(self) -> None:
        """Both files, each replaced whole."""
        from loadtest.gpucheck_report import markdown, summary_rows

        with self.lock:  # held while writing too: the watchdog may write at the same moment
            self.record["elapsed_s"] = round(self.elapsed(), 1)
            self.record["summary"] = summary_rows(self.record)
            text = json.dumps(self.record, indent=2, default=str)
            for name, content in ((JSON_FILE, text), (MARKDOWN_FILE, markdown(self.record))):
                temporary = self.out / f".{name}.tmp"
                temporary.write_text(content)
                os.replace(temporary, self.out / name)

    def watch(self) -> None:
        """At the limit: write what there is, stop the children (the server, the clients), exit."""
        def expire() -> None:
            remaining = self.stop_at - self.clock()
            if remaining > 0:
                time.sleep(remaining)
            if self.finished:
                return
            with self.lock:
                self.record["stopped"] = f"the watchdog stopped the run at its limit of {self.limit_s:.0f} s"
                self.record["partial"].append(self.record["stopped"])
            self.write()
            _kill_children()
            os._exit(3)

        threading.Thread(target=expire, name="gpucheck-watchdog", daemon=True).start()


def _kill_children() -> None:
    """SIGKILL every process whose parent is this one (the server, the client processes)."""
    me = os.getpid()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            try:
                os.kill(int(stat.parent.name), signal.SIGKILL)
            except OSError:
                pass


# ---- the phases ----------------------------------------------------------------------------------
def check(out: Path, profile: Profile, limit_s: float, wheel_folder: Path | None, work: Path, argv: list[str]) -> int:
    run = Run(out, profile, limit_s, argv)
    run.watch()
    run.log(f"{profile.mode} check into {out}, limit {limit_s:.0f} s, work folder {work}")
    run.record["machine"] = machine_record()
    run.record["not_covered"] = not_covered(profile.mode, onnx_providers())
    if wheel_folder is not None:
        with run.phase("install", profile.budgets["install"]):
            run.record["wheels"] = wheels.install(wheel_folder, work / "site")
            run.log(f"installed {len(run.record['wheels']['installed'])} wheels into {work / 'site'}")
    if run.record["phases"].get("install", {}).get("status") == "failed":
        return finish(run, 1)
    missing = missing_modules()
    if missing:
        run.record["missing_modules"] = missing
        run.partial(f"the server cannot run here, missing {', '.join(missing)}: fetch the wheels with"
                    " `loadtest/gpu_check --fetch-wheels DIR` where PyPI is reachable, and pass --wheels DIR")
        return finish(run, 1)
    context: dict[str, Any] = {}
    with run.phase("build", profile.budgets["build"]) as deadline:
        context = build_phase(run, work / "repository", work / "artifacts", deadline)
    if context.get("models"):
        if "engine" in profile.phases:
            with run.phase("engine", profile.budgets["engine"]) as deadline:
                engine_phase(run, context, deadline)
        if "serve" in profile.phases:
            budget = serve_budget(run.left(), profile) if "front_ends" in profile.phases else None
            with run.phase("serve", budget) as deadline:
                serve_phase(run, context, deadline)
    if context.get("models") and "front_ends" in profile.phases:
        with run.phase("front_ends", None) as deadline:
            from loadtest.gpucheck_frontends import front_ends_phase

            front_ends_phase(run, context, deadline)
    failed = any(p.get("status") == "failed" for p in run.record["phases"].values())
    return finish(run, 1 if failed else 0)


def serve_budget(left: float, profile: Profile) -> float:
    """What the serve phase gets of `left`: all but what it keeps back for the front-end curve,
    and never less than the serve floor for it (the curve takes what serve leaves)."""
    kept_back = min(profile.budgets["front_ends"], max(0.0, left - profile.budgets["serve_floor"]))
    return left - kept_back


# What `batchline serve` and this check import beyond the standard library (module names).
REQUIRED_MODULES = ("fastapi", "fastapi_offline", "httptools", "numpy", "orjson", "prometheus_client", "pydantic",
                    "pydantic_settings", "torch", "uvicorn", "uvloop", "yaml")


def missing_modules() -> list[str]:
    import importlib.util

    return [name for name in REQUIRED_MODULES if importlib.util.find_spec(name) is None]


def finish(run: Run, code: int) -> int:
    with run.lock:
        run.record["complete"] = code == 0 and not run.record["partial"]
        run.record["exit_code"] = code
        run.finished = True
    run.write()
    run.log(f"done: {'complete' if run.record['complete'] else 'PARTIAL'}; {run.out / JSON_FILE}, "
            f"{run.out / MARKDOWN_FILE}")
    return code


def build_phase(run: Run, repository: Path, artifacts: Path, deadline: float) -> dict[str, Any]:
    import torch

    from loadtest import gpucheck_models as models

    profile = run.profile
    if profile.threads:
        torch.set_num_threads(profile.threads)
    if profile.mode == "gpu" and not torch.cuda.is_available():
        raise RuntimeError(f"torch {torch.__version__} sees no CUDA device (run --dry-run on a machine without one)")
    device = torch.device("cuda:0" if profile.mode == "gpu" else "cpu")
    run.record["device"] = device_record(torch, device)
    run.record["onnx"] = onnx_record(profile)
    shapes = models.FULL if profile.mode == "gpu" else models.TINY
    repository.mkdir(parents=True, exist_ok=True)
    built: dict[str, Any] = {}
    kind = "GPU" if device.type == "cuda" else "CPU"
    for role in profile.roles:
        if run.clock() > deadline:
            run.partial(f"{role}: not built, the build phase ran out of time")
            continue
        started = run.clock()
        entry: dict[str, Any] = {"name": role, "variants": {}}
        with run.lock:
            run.record["models"][role] = entry
        try:
            model = models.BUILDERS[role](shapes, device)
            entry.update(name=model.name, about=model.about)
            run.log(f"{role}: {model.name} built in {run.clock() - started:.1f} s; exporting")
            fp32 = artifacts / f"{model.name}-fp32.pt2"
            models.save(models.export(model.module, model, device), fp32)
            options: dict[str, Any] = {"kind": kind, "instances": profile.instances, "max_batch": profile.max_batch[role],
                       "threads": profile.threads}
            for precision in (p for p in profile.precisions if p != "int8" and profile.builds(role, p)):
                name = models.write_variant(repository, model, precision, fp32, **options)
                method = ("torch.export program (FP32)" if precision == "fp32"
                          else f"the FP32 program, cast to {precision} by the torch engine at load")
                entry["variants"][precision] = {"name": name, "status": "built", "method": method}
                for extra in (e for e in profile.extras if (e.role, e.precision) == (role, precision)):
                    buckets = list(extra.buckets or profile.buckets[role])
                    entry["variants"][extra.key] = extra_variant(extra, model, repository, fp32, device, options,
                                                                 buckets)
            if "int8" in profile.precisions and profile.builds(role, "int8"):
                entry["variants"]["int8"] = int8_variant(run, model, repository, artifacts, device, options, deadline)
        except Exception as exc:  # noqa: BLE001 (one model that cannot be built does not stop the others)
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:1000]}"
            entry["traceback"] = traceback.format_exc(limit=8)[-3000:]
            run.partial(f"{role}: not built: {entry['error']}")
            continue
        entry["build_s"] = round(run.clock() - started, 1)
        built[role] = model
        outcomes = ", ".join(f"{p} {v['status']}" for p, v in entry["variants"].items())
        run.log(f"{role}: variants {outcomes} ({entry['build_s']} s)")
        run.write()
    return {"models": built, "repository": repository, "device": device}


def extra_variant(extra: Extra, model: Any, repository: Path, program: Path, device: Any, options: dict[str, Any],
                  buckets: list[int]) -> dict[str, Any]:
    """A variant built from a plain one (gpucheck_coverage.Extra): compiled over `buckets`, or
    with more instances; unsupported, with the reason, where torch.compile cannot run here."""
    from loadtest import gpucheck_models as models

    record: dict[str, Any] = {"of": extra.precision, "instances": extra.instances}
    if extra.compile_mode:
        problem = compiler_problem(device.type)
        if problem:
            return {**record, "status": "unsupported", "reason": f"torch.compile cannot run here: {problem}"}
        record.update(compile_mode=extra.compile_mode, batch_buckets=buckets)
    name = models.write_variant(repository, model, extra.precision, program, **{**options, "instances": extra.instances},
                                suffix=extra.suffix, batch_buckets=buckets if extra.compile_mode else None,
                                compile_mode=extra.compile_mode)
    return {"name": name, "status": "built", "method": extra.method(buckets), **record}


def int8_variant(run: Run, model: Any, repository: Path, artifacts: Path, device: Any, options: dict[str, Any],
                 deadline: float) -> dict[str, Any]:
    from loadtest import gpucheck_models as models

    if run.clock() > deadline:
        run.partial(f"{model.name} int8: not built, the build phase ran out of time")
        return {"status": "skipped", "reason": "the build phase ran out of time"}
    try:
        module = models.int8_module(model)
        path = artifacts / f"{model.name}-int8.pt2"
        models.save(models.export(module, model, device), path)
    except models.Unsupported as exc:
        return {"status": "unsupported", "reason": str(exc)}
    except Exception as exc:  # noqa: BLE001 (a torchao/export failure on this stack: recorded as the reason)
        return {"status": "unsupported", "reason": f"the torchao {model.int8_scheme} INT8 program could not be"
                f" made here: {type(exc).__name__}: {str(exc)[:500]}"}
    name = models.write_variant(repository, model, "int8", path, **options)
    scheme = {"dynamic": "INT8 weights and per-row INT8 activations, INT8 matmuls",
              "weight_only": "INT8 weights, float compute"}[model.int8_scheme]
    return {"name": name, "status": "built", "method": f"torchao {model.int8_scheme} ({scheme}) on the linear layers,"
            " other layers FP32; torch.export program"}


def device_record(torch: Any, device: Any) -> dict[str, Any]:
    record: dict[str, Any] = {"torch": torch.__version__, "device": str(device), "cuda": torch.version.cuda}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        record.update(name=properties.name, memory_gib=round(properties.total_memory / 2**30, 1),
                      capability=f"sm{properties.major}{properties.minor}", multiprocessors=properties.multi_processor_count)
    else:
        record.update(name="cpu", threads=torch.get_num_threads())
    return record


def onnx_providers() -> list[str] | None:
    """ONNX Runtime's available providers, or None where it is not installed."""
    try:
        import onnxruntime
    except ImportError:
        return None
    return list(onnxruntime.get_available_providers())


def onnx_record(profile: Profile) -> dict[str, Any]:
    """Why there are no ONNX Runtime variants on this machine."""
    try:
        import onnxruntime
    except ImportError:
        return {"status": "skipped", "reason": "onnxruntime is not installed"}
    providers = onnxruntime.get_available_providers()
    if profile.mode != "gpu":
        return {"status": "skipped", "reason": "the dry run serves the torch engine only", "providers": providers}
    if "CUDAExecutionProvider" not in providers:
        return {"status": "skipped", "providers": providers,
                "reason": f"onnxruntime {onnxruntime.__version__} has no CUDAExecutionProvider (the CPU build):"
                          " the torch engine is the GPU engine here"}
    return {"status": "not built", "providers": providers,
            "reason": "onnxruntime-gpu is present, but this check builds torch.export programs only"}


def built_variants(run: Run, context: dict[str, Any]) -> Iterator[tuple[str, Any, str, dict[str, Any]]]:
    """(role, model, precision, variant record) of every variant built, in report order."""
    for role, model in context["models"].items():
        for precision, variant in run.record["models"][role]["variants"].items():
            if variant["status"] == "built":
                yield role, model, precision, variant


def engine_phase(run: Run, context: dict[str, Any], deadline: float) -> None:
    import torch

    from loadtest.gpucheck_measure import GpuTrace
    from server.config import load_model_config
    from server.devices import Device
    from server.engines import create_engine
    from server.layout import FIRST_VERSION, config_path, version_dir

    profile, device = run.profile, context["device"]
    placement = Device("GPU", device.index or 0) if device.type == "cuda" else Device("CPU")
    trace = GpuTrace()

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    todo = list(built_variants(run, context))
    for position, (role, model, precision, variant) in enumerate(todo):
        if run.clock() > deadline:
            variant["engine"] = {"skipped": "the engine phase ran out of time"}
            run.partial(f"{variant['name']}: engine alone not measured, the phase ran out of time")
            continue
        buckets = variant.get("batch_buckets") or profile.buckets[role]
        share = (deadline - run.clock()) / (len(todo) - position) / (len(buckets) + 2)
        seconds = max(0.05, min(profile.engine_seconds, share))
        folder = context["repository"] / variant["name"]
        loaded = run.clock()
        engines: list[Any] = []
        try:
            config = load_model_config(config_path(folder))
            for _ in range(variant.get("instances", 1)):  # one by one: those made are closed if the next fails
                engines.append(create_engine(config, version_dir(folder, FIRST_VERSION), placement))
            record: dict[str, Any] = {"load_s": round(run.clock() - loaded, 2), "seconds_per_bucket": round(seconds, 3)}

            def batches(size: int, model: Any = model) -> list[dict[str, Any]]:
                return [model.samples(size, offset=k * size) for k in range(4)]

            if len(engines) > 1:
                record.update(instances_alone(run, engines, batches, buckets, profile.max_batch[role], seconds, trace))
            else:
                record.update(one_engine(run, engines[0], batches, buckets, seconds, deadline, synchronize, trace,
                                         compiled=bool(variant.get("compile_mode"))))
            if record.get("skipped_buckets"):
                run.partial(f"{variant['name']}: engine buckets {record['skipped_buckets']} not measured,"
                            " the phase ran out of time")
            if model.heldout is not None:
                record["accuracy"] = accuracy(engines[0], model, profile.max_batch[role])
            variant["engine"] = record
            results = record["buckets"]
            best = max(results, key=lambda r: r["items_s"]) if results else None
            run.log(f"{variant['name']}: engine best {best['items_s'] if best else '-'} items/s"
                    f" at batch {best['batch_size'] if best else '-'}"
                    + (f", {record['speedup']}x one instance" if "speedup" in record else "")
                    + (f", compiled in {sum(c['seconds'] for c in record['compile']):.1f} s" if "compile" in record
                       else ""))
        except Exception as exc:  # noqa: BLE001 (one variant that cannot load or run does not stop the others)
            variant["engine"] = {"error": f"{type(exc).__name__}: {str(exc)[:1000]}"}
            run.log(f"{variant['name']}: engine FAILED: {exc}")
        finally:
            for engine in engines:
                engine.close()
            del engines
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        run.write()


def one_engine(run: Run, engine: Any, batches: Callable[[int], list[dict[str, Any]]], buckets: list[int],
               seconds: float, deadline: float, synchronize: Callable[[], None], trace: Any,
               compiled: bool) -> dict[str, Any]:
    """One instance per bucket; a compiled engine's first run of each bucket (its compile, and
    its CUDA graph where the mode records one) timed first, apart from the figures."""
    from loadtest.gpucheck_measure import engine_buckets, first_runs

    record: dict[str, Any] = {}
    if compiled:
        record["compile"] = first_runs(engine.run, batches, buckets, deadline, synchronize, run.clock)
    with trace.window() as gpu:
        results, skipped = engine_buckets(engine.run, batches, buckets, seconds, deadline, synchronize, run.clock)
    record.update(buckets=results, gpu=gpu)
    if skipped:
        record["skipped_buckets"] = skipped
    return record


def instances_alone(run: Run, engines: list[Any], batches: Callable[[int], list[dict[str, Any]]], buckets: list[int],
                    max_batch: int, seconds: float, trace: Any) -> dict[str, Any]:
    """Several instances of one model on one device, each on a thread of its own as the server
    runs them (on a GPU each enqueues on its own CUDA stream and waits for that stream alone), at
    the largest bucket the server may form: one instance alone, then all at once."""
    from loadtest.gpucheck_measure import engines_at_once

    size = max(b for b in buckets if b <= max_batch)
    inputs = batches(size)
    with trace.window() as gpu_one:
        one = engines_at_once([e.run for e in engines[:1]], inputs, size, seconds)
    with trace.window() as gpu:
        many = engines_at_once([e.run for e in engines], inputs, size, seconds)
    run.log(f"{len(engines)} instances at batch {size}: {many['items_s']} items/s, one alone {one['items_s']}")
    return {"instances": len(engines), "buckets": [many], "gpu": gpu, "one_instance": {**one, "gpu": gpu_one},
            "speedup": round(many["items_s"] / one["items_s"], 3) if one["items_s"] else None}


def accuracy(engine: Any, model: Any, batch: int) -> float:
    """Top-1 accuracy over the held-out images, through the engine as the server runs it: in
    batches of `batch`, the last padded up to it as the server pads a batch to its bucket (a
    compiled engine meets only the shapes it was compiled for)."""
    import numpy as np

    images, labels = model.heldout
    name = model.inputs[0]["name"]
    predicted = []
    for start in range(0, len(images), batch):
        chunk = images[start:start + batch]
        padded = np.zeros((batch, *chunk.shape[1:]), dtype=chunk.dtype)
        padded[:len(chunk)] = chunk
        outputs = engine.run({name: padded})
        predicted.append(np.asarray(outputs[model.output["name"]])[:len(chunk)].argmax(axis=1))
    return round(float((np.concatenate(predicted) == labels).mean()), 4)


def serve_phase(run: Run, context: dict[str, Any], deadline: float) -> None:
    from loadtest import localserver
    from loadtest.gpucheck_measure import (
        REQUEST_BODIES,
        Clients,
        GpuTrace,
        binary_request,
        model_stats,
        stats_delta,
        wait_for_models,
    )

    profile = run.profile
    todo = list(built_variants(run, context))
    flags = ["--log-level", "info"]
    if profile.threads:
        flags += ["--engine-threads", str(profile.threads)]
    serve: dict[str, Any] = {"models": [v["name"] for *_, v in todo]}
    flags += [flag for name in serve["models"] for flag in ("--model", name)]
    run.record["serve"] = serve
    started = run.clock()
    startup = min(profile.budgets["server_start"], deadline - started)
    with localserver.running_server(context["repository"], *flags, log_path=run.out / SERVER_LOG,
                                    wait_path="/v2/health/live", startup_timeout_s=startup) as url:
        states = wait_for_models(url, serve["models"], started + startup, run.clock)
        serve.update(url=url, startup_s=round(run.clock() - started, 1), states=states)
        run.log(f"server at {url}: {sum(s == 'READY' for s in states.values())}/{len(states)} models ready"
                f" in {serve['startup_s']} s")
        log = (run.out / SERVER_LOG).read_text(errors="replace")
        for *_, variant in todo:
            if variant.get("compile_mode"):  # compiled at load, every bucket: the log has the times
                variant["server_compile"] = server_compiles(log, variant["name"])
                run.log(f"{variant['name']}: the server compiled {len(variant['server_compile']['compiles'])}"
                        f" buckets in {variant['server_compile']['compile_s']} s")
        trace = GpuTrace()
        with Clients(profile.client_processes) as clients:
            ready = [(role, model, precision, v) for role, model, precision, v in todo if states.get(v["name"]) == "READY"]
            for role, model, precision, variant in todo:
                if states.get(variant["name"]) != "READY":
                    variant["served"] = {"error": f"not ready in the server: {states.get(variant['name'])}"}
                    run.partial(f"{variant['name']}: not served, {variant['served']['error']}")
            for position, (role, model, precision, variant) in enumerate(ready):
                share = (deadline - run.clock()) / (len(ready) - position) - profile.served_warmup_s - 2.0
                duration = min(profile.served_seconds, share)
                if duration < min(1.0, profile.served_seconds):
                    variant["served"] = {"skipped": "the serve phase ran out of time"}
                    run.partial(f"{variant['name']}: not served, the phase ran out of time")
                    continue
                items = profile.items_per_request[role]
                datatypes = {t["name"]: t["datatype"] for t in model.inputs}
                requests = [binary_request(variant["name"], model.samples(items, offset=i * items), datatypes,
                                           model.output["name"]) for i in range(REQUEST_BODIES)]
                before = model_stats(url, variant["name"])
                with trace.window() as gpu:
                    served = clients.closed_loop(url, requests, model.output["name"], model.width,
                                                 profile.concurrency[role], duration, profile.served_warmup_s)
                served["gpu"] = gpu
                served["server"] = stats_delta(before, model_stats(url, variant["name"]))
                served.update(engine_reference(variant.get("engine"), profile.max_batch[role], served["items_s"]))
                if variant.get("instances", 1) > 1:  # read against the plain variant's one instance, same load
                    one = run.record["models"][role]["variants"].get(variant["of"], {}).get("served")
                    served["against_one_instance"] = instance_comparison(one, served, variant["instances"])
                variant["served"] = served
                run.log(f"{variant['name']}: served {served['items_s']} items/s, p50 {served['latency_ms']['p50']} ms,"
                        f" p99 {served['latency_ms']['p99']} ms, {served['error_count']} errors,"
                        f" {served.get('ratio_to_engine')} of the engine")
                if served["error_count"]:
                    run.partial(f"{variant['name']}: {served['error_count']} failed requests ({served['first_error']})")
                run.write()


def engine_reference(engine: dict[str, Any] | None, max_batch: int, served_items_s: float) -> dict[str, Any]:
    """The engine's best items/s over the buckets the server may form (<= max_batch_size), and the
    served rate as a share of it."""
    buckets = [b for b in (engine or {}).get("buckets", []) if b["batch_size"] <= max_batch]
    if not buckets:
        return {"engine_items_s": None, "engine_batch": None, "ratio_to_engine": None}
    best = max(buckets, key=lambda b: b["items_s"])
    return {"engine_items_s": best["items_s"], "engine_batch": best["batch_size"],
            "ratio_to_engine": round(served_items_s / best["items_s"], 3) if best["items_s"] else None}


# ---- the command line ----------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loadtest/gpu_check", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[1] + "\n\nloadtest/README.md, \"GPU check\", has the whole recipe.",
    )
    p.add_argument("outdir", nargs="?", type=Path, help="where gpu_check.json, gpu_check.md and the logs go")
    p.add_argument("--dry-run", action="store_true", help="the same flow on the CPU, tiny models, seconds of load")
    p.add_argument("--wheels", type=Path, help="install the server's missing packages from this folder first"
                   " (made by --fetch-wheels) into a throwaway folder")
    p.add_argument("--time-limit", type=float, help=f"seconds the whole run may take (default {TIME_LIMIT_S:g}; "
                   f"{DRY_RUN_TIME_LIMIT_S:g} with --dry-run)")
    p.add_argument("--work", type=Path, help="folder for the model repository and installed wheels (default: a"
                   " temporary one, removed at the end)")
    p.add_argument("--phases", type=_phases, help=f"comma-separated, of {', '.join(PHASES)} (default: all; install"
                   " and build always run): with front_ends alone, only the models and precisions of the curves"
                   " are built")
    p.add_argument("--curve", action="append", type=_curve, dest="curves", metavar="ROLE:PRECISION[:json|binary]",
                   help="a model the front-end curve serves (repeatable; default digits:fp32:json), its requests'"
                   f" inputs as JSON numbers or binary tensors; roles: {', '.join(ROLES)}")
    p.add_argument("--front-ends", type=_counts, help="comma-separated --http-workers counts of the front-end curves,"
                   " in the order they run (default 1,8,2,4)")
    p.add_argument("--fetch-wheels", type=Path, metavar="DIR",
                   help="instead of a check: download the wheels the GPU host lacks into DIR (needs PyPI)")
    p.add_argument("--budget-mib", type=float, default=wheels.DEFAULT_BUDGET_MIB,
                   help="--fetch-wheels fails when the wheels take more than this")
    p.add_argument("--requirement", action="append", dest="requirements", metavar="REQ",
                   help="--fetch-wheels only these requirements (default: pyproject's, less the host's)")
    return p


def _phases(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in PHASES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"phases are of {', '.join(PHASES)}, not {text!r}")
    return names


def _curve(text: str) -> Curve:
    try:
        curve = Curve.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if curve.role not in ROLES:
        raise argparse.ArgumentTypeError(f"roles are {', '.join(ROLES)}, not {curve.role!r}")
    return curve


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(n) for n in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"counts are positive integers, comma-separated, not {text!r}")
    return counts


def chosen(profile: Profile, args: argparse.Namespace) -> Profile:
    """`profile` with the command line's phases, curves and front-end counts. Without the engine
    and serve phases, only what the curves serve is built: each curve's model in its precision."""
    changes: dict[str, Any] = {}
    if args.phases:
        changes["phases"] = args.phases
    if args.curves:
        changes["front_end_curves"] = tuple(args.curves)
    if args.front_ends:
        changes["front_ends"] = args.front_ends
    profile = dataclasses.replace(profile, **changes)
    if "engine" not in profile.phases and "serve" not in profile.phases:
        curves = profile.front_end_curves
        profile = dataclasses.replace(
            profile, roles=tuple(r for r in ROLES if any(c.role == r for c in curves)),
            only=tuple(dict.fromkeys((c.role, c.precision) for c in curves)), extras=())
    return profile


def fetch_command(folder: Path, budget_mib: float, requirements: list[str] | None) -> int:
    if requirements is None:
        requirements, left_out = wheels.carried_requirements()
        for name, why in left_out.items():
            print(f"not carried: {name}: {why}")
    print(f"fetching for CPython {wheels.PYTHON_VERSION} manylinux x86-64: {' '.join(requirements)}", flush=True)
    try:
        found = wheels.fetch(folder, requirements)
        print(wheels.describe(found))
        wheels.check_budget(found, int(budget_mib * 2**20))
    except wheels.WheelError as exc:
        print(f"gpu_check --fetch-wheels: {exc}", file=sys.stderr)
        return 1
    print(f"within the budget of {budget_mib:g} MiB; carry {folder} to the GPU host and run"
          f" `loadtest/gpu_check --wheels {folder} OUTDIR` there")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.fetch_wheels is not None:
        return fetch_command(args.fetch_wheels, args.budget_mib, args.requirements)
    if args.outdir is None:
        parser().error("OUTDIR is required (or --fetch-wheels DIR)")
    profile = chosen(DRY_RUN if args.dry_run else GPU, args)
    if args.time_limit is None:
        args.time_limit = DRY_RUN_TIME_LIMIT_S if args.dry_run else TIME_LIMIT_S
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
        return check(args.outdir, profile, args.time_limit, args.wheels, args.work.resolve(), argv)
    with tempfile.TemporaryDirectory(prefix="gpucheck-") as work:
        return check(args.outdir, profile, args.time_limit, args.wheels, Path(work), argv)


if __name__ == "__main__":
    sys.exit(main())
