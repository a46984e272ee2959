"""What the GPU check measures: the engine alone per batch bucket, the served rate under many
concurrent clients, the server's own view of it (models ready, batches formed), and the GPU's
own counters (NVML) while either runs.

Kept free of torch at import: the load-generating processes import this module (spawned, so
that they inherit no CUDA state and no threads) and need only sockets and numpy.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Self
from urllib.parse import urlsplit

import numpy as np

from loadtest.engine import measure
from loadtest.openloop import _read_reply, raw_request, run
from loadtest.payloads import HEADER_LENGTH, InferRequest

REQUEST_BODIES = 16  # distinct request bodies per model
VALIDATE_EVERY = 50  # a full reply check on the first reply of each connection and one in this many
START_DELAY_S = 0.3  # the client processes start together, this long after they are handed the work


# ---- requests and replies ------------------------------------------------------------------------
def binary_request(model: str, inputs: dict[str, np.ndarray], datatypes: dict[str, str], output: str) -> InferRequest:
    """A KServe v2 infer request with binary tensors (Triton's extension) both ways."""
    tensors, raw = [], []
    for name, array in inputs.items():
        data = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        tensors.append({"name": name, "shape": list(array.shape), "datatype": datatypes[name],
                        "parameters": {"binary_data_size": len(data)}})
        raw.append(data)
    header = json.dumps({"inputs": tensors, "outputs": [{"name": output, "parameters": {"binary_data": True}}]},
                        separators=(",", ":")).encode()
    headers = {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(header))}
    items = int(next(iter(inputs.values())).shape[0])
    return InferRequest(model, items, True, f"/v2/models/{model}/infer", header + b"".join(raw), headers)


def json_request(model: str, inputs: dict[str, np.ndarray], datatypes: dict[str, str], output: str) -> InferRequest:
    """A KServe v2 infer request with its inputs as JSON numbers and its output asked for in
    binary: parsing the numbers is the costly part of a request for the server, while the client
    sends the same bytes each time and checks the binary reply as for `binary_request`."""
    tensors = [{"name": name, "shape": list(array.shape), "datatype": datatypes[name],
                "data": np.asarray(array).reshape(-1).tolist()} for name, array in inputs.items()]
    body = json.dumps({"inputs": tensors, "outputs": [{"name": output, "parameters": {"binary_data": True}}]},
                      separators=(",", ":")).encode()
    items = int(next(iter(inputs.values())).shape[0])
    return InferRequest(model, items, False, f"/v2/models/{model}/infer", body, {"Content-Type": "application/json"})


def check_reply(output: str, items: int, width: int, status: int, headers: dict[str, str], body: bytes) -> str | None:
    """None when the reply is a 200 holding `output` as FP32 [items, width] in binary; else why not."""
    if status != 200:
        return f"HTTP {status}: {body[:200]!r}"
    length = headers.get(HEADER_LENGTH.lower())
    if length is None:
        return "no binary reply (Inference-Header-Content-Length missing)"
    try:
        header = json.loads(body[: int(length)])
    except ValueError as exc:
        return f"reply header is not JSON: {exc}"
    found = [o for o in header.get("outputs") or [] if o.get("name") == output]
    if not found:
        return f"no output {output!r} in the reply"
    shape, size = found[0].get("shape"), (found[0].get("parameters") or {}).get("binary_data_size")
    if shape != [items, width] or size != items * width * 4 or len(body) - int(length) != size:
        return f"output shape {shape} of {size} bytes, expected {[items, width]} of {items * width * 4}"
    return None


# ---- many concurrent clients ---------------------------------------------------------------------
@dataclass(frozen=True)
class LoadPlan:
    """What each client process runs: `connections` closed loops (each sends its next request
    when its reply arrives) from `start_at` (time.time()), counting [warmup_s, warmup_s + duration_s)."""

    url: str
    payloads: list[bytes]
    output: str
    items: int
    width: int
    connections: int
    start_at: float
    warmup_s: float
    duration_s: float
    timeout_s: float


@dataclass
class LoadTally:
    ok: int = 0
    latencies_ms: list[float] = field(default_factory=list)  # of the replies inside the window
    errors: dict[str, int] = field(default_factory=dict)
    first_error: str | None = None
    validated: int = 0

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        self.first_error = self.first_error or f"{kind}: {detail}"


def client_process(plan: LoadPlan) -> LoadTally:
    """One client process: its connections' closed loops, on uvloop where installed."""
    return run(_clients(plan))


async def _clients(plan: LoadPlan) -> LoadTally:
    tally = LoadTally()
    parts = urlsplit(plan.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    # Wall-clock start shared by every process; perf_counter inside for the timings.
    await asyncio.sleep(max(0.0, plan.start_at - time.time()))
    begin = time.perf_counter()
    window = (begin + plan.warmup_s, begin + plan.warmup_s + plan.duration_s)
    await asyncio.gather(*(_connection(plan, host, port, index, window, tally) for index in range(plan.connections)))
    return tally


async def _connection(plan: LoadPlan, host: str, port: int, index: int, window: tuple[float, float],
                      tally: LoadTally) -> None:
    sent = 0
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, port)
        while time.perf_counter() < window[1]:
            payload = plan.payloads[(index + sent) % len(plan.payloads)]
            started = time.perf_counter()
            writer.write(payload)
            async with asyncio.timeout(plan.timeout_s):
                status, headers, body = await _read_reply(reader)
            finished = time.perf_counter()
            problem = None
            if sent % VALIDATE_EVERY == 0:
                tally.validated += 1
                problem = check_reply(plan.output, plan.items, plan.width, status, headers, body)
                if problem:
                    tally.error("bad_reply", problem)
            elif status != 200:
                problem = body[:200].decode("utf-8", "replace")
                tally.error(f"http_{status}", problem)
            if problem is None and window[0] <= finished < window[1]:
                tally.ok += 1
                tally.latencies_ms.append((finished - started) * 1000)
            sent += 1
            if headers.get("connection", "").lower() == "close":
                writer.close()
                reader, writer = await asyncio.open_connection(host, port)
    except TimeoutError:
        tally.error("timeout", f"no reply within {plan.timeout_s} s")
    except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        tally.error("socket", repr(exc))
    finally:
        if writer is not None:
            writer.close()


class Clients:
    """A pool of spawned client processes, started once and reused for every model."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._pool = multiprocessing.get_context("spawn").Pool(processes)

    def close(self) -> None:
        self._pool.terminate()
        self._pool.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def closed_loop(self, url: str, requests: list[InferRequest], output: str, width: int, concurrency: int,
                    duration_s: float, warmup_s: float, timeout_s: float = 30.0) -> dict[str, Any]:
        """`concurrency` clients over the processes, each sending its next request when its reply
        arrives, for warmup_s + duration_s; the figures of the replies inside the window after
        the warm-up."""
        parts = urlsplit(url)
        payloads = [raw_request(r, parts.hostname or "127.0.0.1", parts.port or 80) for r in requests]
        items = requests[0].items
        shares = [concurrency // self.processes + (1 if i < concurrency % self.processes else 0)
                  for i in range(self.processes)]
        start_at = time.time() + START_DELAY_S
        plans = [LoadPlan(url, payloads, output, items, width, share, start_at, warmup_s, duration_s, timeout_s)
                 for share in shares if share]
        tallies: list[LoadTally] = self._pool.map(client_process, plans)
        latencies = np.array([v for t in tallies for v in t.latencies_ms])
        ok = sum(t.ok for t in tallies)
        errors: dict[str, int] = {}
        for tally in tallies:
            for kind, count in tally.errors.items():
                errors[kind] = errors.get(kind, 0) + count
        first_error = next((t.first_error for t in tallies if t.first_error), None)
        return {
            "concurrency": concurrency,
            "client_processes": len(plans),
            "items_per_request": items,
            "warmup_s": warmup_s,
            "duration_s": duration_s,
            "requests": ok,
            "req_s": round(ok / duration_s, 2),
            "items_s": round(ok * items / duration_s, 2),
            "latency_ms": {
                "p50": _percentile(latencies, 50), "p99": _percentile(latencies, 99), "max": _percentile(latencies, 100),
            },
            "errors": errors,
            "error_count": sum(errors.values()),
            "first_error": first_error,
            "validated_replies": sum(t.validated for t in tallies),
        }


def _percentile(values: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if len(values) else None


# ---- the server's own view ----------------------------------------------------------------------
def wait_for_models(url: str, names: list[str], deadline: float,
                    clock: Callable[[], float] = time.monotonic) -> dict[str, str]:
    """Each model's state once none is loading any more (or at `deadline`, on `clock`): READY,
    or the reason it is not. The server's own readiness is strict (every model), so one variant
    that cannot load would hide the others."""
    states: dict[str, str] = {}
    while True:
        request = urllib.request.Request(f"{url}/v2/repository/index", data=b"{}", method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            index = json.loads(response.read())
        states = {}
        for entry in index:
            state = entry.get("state") or "LOADING"  # no state yet: its load has not begun
            states[entry["name"]] = state if state in ("READY", "LOADING") else f"{state}: {entry.get('reason', '')}"
        pending = [n for n in names if states.get(n, "LOADING") == "LOADING"]
        if not pending:
            return {n: states.get(n, "missing") for n in names}
        if clock() > deadline:
            return {n: states.get(n, "missing") if n not in pending else "LOADING when the start budget ran out"
                    for n in names}
        time.sleep(0.25)


def model_stats(url: str, name: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"{url}/v2/models/{name}/stats", timeout=10) as response:
            stats = json.loads(response.read())["model_stats"][0]
    except (OSError, ValueError, KeyError, IndexError):
        return None
    return stats


def stats_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the server itself counted over the load: batches, items per batch, a request's time
    queued, and a batch's own time in the engine's three stages (from the per-batch-size
    statistics: a request's compute figures carry its whole batch's time, once per request)."""
    if before is None or after is None:
        return None
    batches = after["execution_count"] - before["execution_count"]
    items = after["inference_count"] - before["inference_count"]
    queue_count = after["inference_stats"]["queue"]["count"] - before["inference_stats"]["queue"]["count"]
    queue_ns = after["inference_stats"]["queue"]["ns"] - before["inference_stats"]["queue"]["ns"]

    def per_batch(stage: str) -> float | None:
        ns = sum(b[stage]["ns"] for b in after.get("batch_stats", [])) - sum(
            b[stage]["ns"] for b in before.get("batch_stats", []))
        return round(ns / batches / 1e6, 3) if batches else None

    return {"batches": batches, "items": items, "mean_batch": round(items / batches, 2) if batches else None,
            "queue_ms_per_request": round(queue_ns / queue_count / 1e6, 3) if queue_count else None,
            **{f"{stage}_ms_per_batch": per_batch(stage) for stage in ("compute_input", "compute_infer", "compute_output")}}


# ---- the engine alone ----------------------------------------------------------------------------
def engine_buckets(run_batch: Callable[[dict[str, np.ndarray]], Any], batches: Callable[[int], list[dict[str, np.ndarray]]],
                   buckets: list[int], seconds: float, deadline: float, synchronize: Callable[[], None],
                   clock: Callable[[], float] = time.monotonic) -> tuple[list[dict[str, Any]], list[int]]:
    """Items/s and latency of `run_batch` per batch bucket, `seconds` each (loadtest/engine.py's
    measure: warm-up runs, then back to back), the device synchronised around every run so that
    a run's time is its whole work. Returns the figures and the buckets left out for lack of
    time (`deadline`, on `clock`)."""
    results, skipped = [], []
    for size in buckets:
        if clock() + seconds > deadline:
            skipped.append(size)
            continue
        inputs = batches(size)

        def one(index: int, inputs: list[dict[str, np.ndarray]] = inputs) -> None:
            run_batch(inputs[index % len(inputs)])
            synchronize()

        synchronize()
        results.append(measure(one, size, seconds).as_dict())
    return results, skipped


def first_runs(run_batch: Callable[[dict[str, np.ndarray]], Any], batches: Callable[[int], list[dict[str, np.ndarray]]],
               buckets: list[int], deadline: float, synchronize: Callable[[], None],
               clock: Callable[[], float] = time.monotonic) -> list[dict[str, Any]]:
    """Each bucket's first run, timed: where a compiled engine compiles the bucket (and records
    its CUDA graph). A compile cannot be cut short, so none starts past `deadline` (on `clock`);
    the buckets left are compiled, and timed apart from their figures, by engine_buckets."""
    timings = []
    for size in buckets:
        if clock() > deadline:
            break
        inputs = batches(size)[0]
        synchronize()
        start = time.perf_counter()
        run_batch(inputs)
        synchronize()
        timings.append({"batch_size": size, "seconds": round(time.perf_counter() - start, 3)})
    return timings


def engines_at_once(run_batches: list[Callable[[dict[str, np.ndarray]], Any]], inputs: list[dict[str, np.ndarray]],
                    size: int, seconds: float) -> dict[str, Any]:
    """Items/s of several engine instances running at once, each on a thread of its own (as the
    server runs its instances), each loadtest/engine.py's measure for `seconds`; started
    together. No device-wide synchronisation: an instance's run waits for its own work (on a GPU,
    its own CUDA stream), and a device-wide wait would serialise the very overlap measured."""
    barrier = threading.Barrier(len(run_batches))
    results: list[Any] = [None] * len(run_batches)
    errors: list[BaseException] = []

    def work(index: int) -> None:
        run_batch = run_batches[index]

        def one(step: int) -> None:
            run_batch(inputs[(index + step) % len(inputs)])

        try:
            barrier.wait()
            results[index] = measure(one, size, seconds)
        except BaseException as exc:  # noqa: BLE001 (re-raised on the calling thread)
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(i,), name=f"gpucheck-instance-{i}") for i in range(len(run_batches))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    runs = sum(r.runs for r in results)
    elapsed = max(r.elapsed_s for r in results)
    ms = np.array([v for r in results for v in r.latencies_s]) * 1000
    return {
        "batch_size": size,
        "instances": len(run_batches),
        "runs": runs,
        "elapsed_s": round(elapsed, 3),
        "items_s": round(size * runs / elapsed, 1),
        "latency_ms": {"p50": round(float(np.percentile(ms, 50)), 3), "p99": round(float(np.percentile(ms, 99)), 3),
                       "min": round(float(ms.min()), 3)},
    }


# ---- the GPU's counters --------------------------------------------------------------------------
class GpuTrace:
    """NVML readings (server/gpu.py) every `interval_s` on a thread, summarised per window."""

    def __init__(self, interval_s: float = 0.2) -> None:
        from server.gpu import nvml_available

        self.interval_s = interval_s
        self.available = nvml_available()

    @contextmanager
    def window(self) -> Iterator[dict[str, Any]]:
        """Yields a dict that holds the window's summary once the block ends."""
        summary: dict[str, Any] = {}
        if not self.available:
            summary.update(available=False, reason="NVML is not available here (nvidia-ml-py or the driver missing)")
            yield summary
            return
        from server.gpu import read_gpus

        readings: list[Any] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                found = read_gpus()
                if found:
                    readings.append(found[0])
                stop.wait(self.interval_s)

        thread = threading.Thread(target=sample, name="gpucheck-nvml", daemon=True)
        thread.start()
        try:
            yield summary
        finally:
            stop.set()
            thread.join(timeout=5)
            summary.update(summarise(readings))


def summarise(readings: list[Any]) -> dict[str, Any]:
    """Mean and peak utilisation, peak memory, mean and peak power, and the energy spent."""
    if not readings:
        return {"available": True, "samples": 0, "reason": "NVML gave no reading in the window"}

    def values(attribute: str) -> list[float]:
        return [float(v) for v in (getattr(r, attribute) for r in readings) if v is not None]

    utilisation, power = values("utilization_ratio"), values("power_watts")
    memory, energy = values("memory_used_bytes"), values("energy_joules")
    return {
        "available": True,
        "gpu": readings[0].name,
        "samples": len(readings),
        "utilization_pct": {"mean": _mean(utilisation, 100), "max": _peak(utilisation, 100)},
        "memory_used_mib": {"max": _peak(memory, 1 / 2**20)},
        "memory_total_mib": round(readings[0].memory_total_bytes / 2**20) if readings[0].memory_total_bytes else None,
        "power_w": {"mean": _mean(power), "max": _peak(power)},
        "energy_j": round(energy[-1] - energy[0], 1) if len(energy) > 1 else None,
    }


def _mean(values: list[float], scale: float = 1) -> float | None:
    return round(sum(values) / len(values) * scale, 1) if values else None


def _peak(values: list[float], scale: float = 1) -> float | None:
    return round(max(values) * scale, 1) if values else None
