"""The GPU check's front-end curves: a model served with 1, 2, 4 and 8 HTTP front-end processes
(`--http-workers`), the same load each time, so that what more cores feeding one device buy
shows on a real model.

The check's own curve is the fast model (digits, FP32): its batches take the GPU microseconds, so
the server's own per-request work is the limit, which is what front ends spread over cores; its
requests carry their inputs as JSON numbers, the costly part of a request for a front end, and
ask for the output in binary. `--curve ROLE:PRECISION:binary` (repeatable) names the curves
instead (name `digits:fp32:json` too to keep this one): a model whose requests carry binary
tensors both ways, as the serve phase sends them. A BERT or a ResNet, whose batches take the GPU
milliseconds, shows whether the server's single process leaves the device waiting. One server
start per count, each read against the single process (1).

A count that cannot start, or whose model does not load, is recorded with the reason and the
next count runs; a count the phase has no time left for is skipped, recorded so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class Run(Protocol):
    """What the phase needs of the check's run (loadtest.gpucheck.Run, which imports this module)."""

    profile: Any  # loadtest.gpucheck.Profile
    record: dict[str, Any]
    out: Path
    clock: Callable[[], float]

    def log(self, message: str) -> None: ...

    def partial(self, reason: str) -> None: ...

    def write(self) -> None: ...

@dataclass(frozen=True)
class Curve:
    """One model served at each front-end count: `role` in `precision`, its requests' inputs as
    JSON numbers ("json") or binary tensors ("binary"), the output in binary either way."""

    role: str
    precision: str
    request: str = "json"

    @classmethod
    def parse(cls, text: str) -> Curve:
        """`ROLE:PRECISION[:json|binary]`, as --curve takes it."""
        parts = text.split(":")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in REQUESTS):
            raise ValueError(f"a curve is ROLE:PRECISION[:json|binary], not {text!r}")
        return cls(*parts)

    @property
    def label(self) -> str:
        return f"{self.role}:{self.precision}:{self.request}"


REQUESTS = {"json": "inputs as JSON numbers, the output in binary", "binary": "binary tensors both ways"}
SERVER_LOG = "server-front-ends-{workers}.log"  # the check's first curve; the others' are named by model
MIN_SECONDS = 0.2  # less load than this measures nothing
STOP_SLACK_S = 2.0  # after the load: the statistics read and the server's stop (a drain of idle connections)


def front_ends_phase(run: Run, context: dict[str, Any], deadline: float) -> None:
    """Serve each of the profile's curves at each of its front-end counts; record req/s, latency
    and the server's batches of each, and each count's rate against one process. The time left
    is shared evenly over every count of every curve still to run."""
    profile = run.profile
    curves: list[dict[str, Any]] = []
    run.record["front_ends"] = curves
    todo = len(profile.front_end_curves) * len(profile.front_ends)
    for index, curve in enumerate(profile.front_end_curves):
        _curve(run, context, curve, deadline, todo - index * len(profile.front_ends), curves, first=index == 0)
        run.write()


def _curve(run: Run, context: dict[str, Any], curve: Curve, deadline: float, counts_left: int,
           curves: list[dict[str, Any]], first: bool) -> None:
    """One curve, its record in `curves` from its start: a report written while it runs (after
    each count, or by the watchdog) holds the counts measured so far."""
    from loadtest.gpucheck_measure import REQUEST_BODIES, Clients, binary_request, json_request

    profile = run.profile
    variant = run.record["models"].get(curve.role, {}).get("variants", {}).get(curve.precision, {})
    model = context["models"].get(curve.role)
    if model is None or variant.get("status") != "built":
        run.partial(f"front ends: {curve.label} not measured, the {curve.role} {curve.precision} variant was not built")
        curves.append({"curve": curve.label, "skipped": f"the {curve.role} {curve.precision} variant was not built"})
        return
    items = profile.items_per_request[curve.role]
    datatypes = {t["name"]: t["datatype"] for t in model.inputs}
    make = json_request if curve.request == "json" else binary_request
    requests = [make(variant["name"], model.samples(items, offset=i * items), datatypes, model.output["name"])
                for i in range(REQUEST_BODIES)]
    record: dict[str, Any] = {
        "curve": curve.label, "model": variant["name"], "items_per_request": items,
        "concurrency": profile.front_end_concurrency, "client_processes": profile.front_end_clients,
        "request": REQUESTS[curve.request], "runs": [],
    }
    log_name = SERVER_LOG if first else f"server-{variant['name']}-front-ends-{{workers}}.log"
    curves.append(record)
    with Clients(profile.front_end_clients) as clients:
        for position, workers in enumerate(profile.front_ends):
            share = (deadline - run.clock()) / (counts_left - position)
            outcome: dict[str, Any] = {"http_workers": workers}
            record["runs"].append(outcome)
            if share < profile.front_end_start_s + profile.served_warmup_s + MIN_SECONDS + STOP_SLACK_S:
                outcome["skipped"] = "the phase ran out of time"
                run.partial(f"front ends: {variant['name']} {workers} not measured, the phase ran out of time")
                continue
            try:
                _measure(run, context, clients, requests, model, variant["name"], workers, share, outcome,
                         record, run.out / log_name.format(workers=workers))
            except Exception as exc:  # noqa: BLE001 (one count that cannot serve does not stop the others)
                outcome["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
                run.partial(f"front ends: {variant['name']} {workers} not measured: {outcome['error']}")
            run.write()


def _measure(run: Run, context: dict[str, Any], clients: Any, requests: list[Any], model: Any, name: str,
             workers: int, share: float, outcome: dict[str, Any], curve: dict[str, Any], log_path: Path) -> None:
    """One count: start the server, wait for the model, drive the load, read it against one
    process. The figures are recorded before the server stops: a slow stop loses none."""
    from loadtest import localserver
    from loadtest.gpucheck_measure import model_stats, stats_delta, wait_for_models

    profile = run.profile
    flags = ["--model", name, "--log-level", "info", "--allow-grpc", "false", "--http-workers", str(workers)]
    if profile.threads:
        flags += ["--engine-threads", str(profile.threads)]
    started = run.clock()
    startup = min(profile.budgets["server_start"], share - profile.served_warmup_s - MIN_SECONDS - STOP_SLACK_S)
    with localserver.running_server(context["repository"], *flags, log_path=log_path,
                                    wait_path="/v2/health/live", startup_timeout_s=startup) as url:
        state = wait_for_models(url, [name], started + startup, run.clock)[name]
        outcome["startup_s"] = round(run.clock() - started, 1)
        if state != "READY":
            outcome["error"] = f"not ready: {state}"
            run.partial(f"front ends: {name} {workers} not measured, {outcome['error']}")
            return
        duration = min(profile.served_seconds,
                       started + share - run.clock() - profile.served_warmup_s - STOP_SLACK_S)
        if duration < MIN_SECONDS:
            outcome["skipped"] = "the phase ran out of time"
            run.partial(f"front ends: {name} {workers} not measured, the phase ran out of time")
            return
        before = model_stats(url, name)
        served = clients.closed_loop(url, requests, model.output["name"], model.width,
                                     profile.front_end_concurrency, duration, profile.served_warmup_s)
        served["server"] = stats_delta(before, model_stats(url, name))
        outcome.update(served)
        one = next((r for r in curve["runs"] if r["http_workers"] == 1 and r.get("req_s")), None)
        if one is not None:
            outcome["against_one"] = round(outcome["req_s"] / one["req_s"], 3)
        run.log(f"front ends {name} {workers}: {outcome['req_s']} req/s, p50 {outcome['latency_ms']['p50']} ms,"
                f" p99 {outcome['latency_ms']['p99']} ms, {outcome['error_count']} errors"
                + (f", {outcome['against_one']}x one process" if "against_one" in outcome else ""))
        if outcome["error_count"]:
            run.partial(f"front ends {name} {workers}: {outcome['error_count']} failed requests ({outcome['first_error']})")
