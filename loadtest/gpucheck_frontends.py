"""The GPU check's front-end curve: one model served with 1, 2, 4 and 8 HTTP front-end
processes (`--http-workers`), the same load each time, so that what more cores feeding one
device buy shows on a real model.

The model is the fast one (digits, FP32): its batches take the GPU microseconds, so the server's
own per-request work is the limit, which is what front ends spread over cores. Requests carry
their inputs as JSON numbers, the costly part of a request for a front end, and ask for the
output in binary; one server start per count, each read against the single process (1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loadtest.gpucheck import Run

ROLE, PRECISION = "digits", "fp32"
SERVER_LOG = "server-front-ends-{workers}.log"
MIN_SECONDS = 0.2  # less than this of load measures nothing: the counts left are skipped


def front_ends_phase(run: Run, context: dict[str, Any], deadline: float) -> None:
    """Serve the digits FP32 variant at each of the profile's front-end counts; record req/s,
    latency and the server's batches of each, and each count's rate against one process."""
    from loadtest import localserver
    from loadtest.gpucheck import model_stats, stats_delta, wait_for_models
    from loadtest.gpucheck_measure import Clients, json_request

    profile = run.profile
    variant = run.record["models"].get(ROLE, {}).get("variants", {}).get(PRECISION, {})
    model = context["models"].get(ROLE)
    if model is None or variant.get("status") != "built":
        run.record["front_ends"] = {"skipped": f"the {ROLE} {PRECISION} variant was not built"}
        run.partial(f"front ends: not measured, the {ROLE} {PRECISION} variant was not built")
        return
    name = variant["name"]
    items = profile.items_per_request[ROLE]
    datatypes = {t["name"]: t["datatype"] for t in model.inputs}
    requests = [json_request(name, model.samples(items, offset=i * items), datatypes, model.output["name"])
                for i in range(16)]
    record: dict[str, Any] = {
        "model": name, "items_per_request": items, "concurrency": profile.front_end_concurrency,
        "client_processes": profile.front_end_clients,
        "request": "inputs as JSON numbers, the output in binary", "runs": [],
    }
    run.record["front_ends"] = record
    flags = ["--model", name, "--log-level", "info", "--allow-grpc", "false"]
    if profile.threads:
        flags += ["--engine-threads", str(profile.threads)]
    counts = list(profile.front_ends)
    with Clients(profile.front_end_clients) as clients:
        for position, workers in enumerate(counts):
            share = (deadline - run.clock()) / (len(counts) - position)
            started = run.clock()
            startup = min(profile.budgets["server_start"], share / 2)
            if share < MIN_SECONDS + profile.served_warmup_s:
                record["runs"].append({"http_workers": workers, "skipped": "the phase ran out of time"})
                run.partial(f"front ends: {workers} not measured, the phase ran out of time")
                continue
            with localserver.running_server(context["repository"], *flags, "--http-workers", str(workers),
                                            log_path=run.out / SERVER_LOG.format(workers=workers),
                                            startup_timeout_s=startup) as url:
                state = wait_for_models(url, [name], started + startup, run.clock)[name]
                startup_s = round(run.clock() - started, 1)
                if state != "READY":
                    record["runs"].append({"http_workers": workers, "error": f"not ready: {state}"})
                    run.partial(f"front ends: {workers} not measured, {name} not ready: {state}")
                    continue
                duration = min(profile.served_seconds, started + share - run.clock() - profile.served_warmup_s - 1.0)
                if duration < MIN_SECONDS:
                    record["runs"].append({"http_workers": workers, "skipped": "the phase ran out of time"})
                    run.partial(f"front ends: {workers} not measured, the phase ran out of time")
                    continue
                before = model_stats(url, name)
                served = clients.closed_loop(url, requests, model.output["name"], model.width,
                                             profile.front_end_concurrency, duration, profile.served_warmup_s)
                served["server"] = stats_delta(before, model_stats(url, name))
            served.update(http_workers=workers, startup_s=startup_s)
            record["runs"].append(served)
            one = next((r for r in record["runs"] if r.get("http_workers") == 1 and "req_s" in r), None)
            if one and one["req_s"]:
                served["against_one"] = round(served["req_s"] / one["req_s"], 3)
            run.log(f"front ends {workers}: {served['req_s']} req/s, p50 {served['latency_ms']['p50']} ms,"
                    f" p99 {served['latency_ms']['p99']} ms, {served['error_count']} errors,"
                    f" {served.get('against_one')}x one process")
            if served["error_count"]:
                run.partial(f"front ends {workers}: {served['error_count']} failed requests ({served['first_error']})")
            run.write()
