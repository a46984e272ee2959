"""End to end: the real server under load, scraped every second by a real Prometheus (Debian's,
through scripts/prometheus.sh) that evaluates deploy/prometheus/rules.yml. The queries the
autoscalers run, taken verbatim from deploy/k8s (prometheus-adapter's rule as the adapter
renders it for this pod, KEDA's trigger), must rise under overload, agree with each other, and
fall back at idle. Loopback only; every loop is bounded in time.

The target carries the labels a ServiceMonitor would add (namespace="batchline", pod="local",
job="batchline"), so the queries run unchanged."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.deploy.contract import (
    CONTRACT,
    GPU_ONLY,
    adapter_rule,
    find,
    keda_trigger,
    query,
    render_adapter_query,
    running_prometheus,
    series_names,
    value,
    wait_for,
)
from tests.integration.conftest import linked_repository, running_server

pytestmark = pytest.mark.integration

TARGET_LABELS = {"job", "instance", "namespace", "pod"}
CLIENTS = 12  # at most 4 requests of 16 texts fit minilm's batch of 64: 8 or more wait while it runs
LOAD_S = 120  # at most; stops once the signal is over the HPA's target (a [1m] rate climbs for a minute)
HPA_TOLERANCE = 0.1  # the HPA acts only when the metric is more than 10% off its target
# A request waits for up to 3 batches of 64 texts on one engine thread: seconds on a busy 2-core
# machine. The bound is for a hung server, not a speed claim.
REQUEST_TIMEOUT_S = 120
SENTENCES = [f"request {i}: dynamic batching trades a little latency for a lot more throughput, "
             "and the queue tells the autoscaler when one replica is no longer enough." for i in range(16)]


def load(url: str, stop: threading.Event, deadline: float, statuses: list[int | str]) -> None:
    """One closed-loop client: HTTP statuses, or the name of the error, into `statuses`."""
    body = {"inputs": [{"name": "text", "shape": [len(SENTENCES), 1], "datatype": "BYTES", "data": SENTENCES}]}
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                statuses.append(client.post(f"{url}/v2/models/minilm/infer", json=body).status_code)
            except httpx.HTTPError as exc:
                statuses.append(type(exc).__name__)


def test_autoscaling_queries_follow_the_load(tmp_path: Path) -> None:
    price = 0.36
    repository = linked_repository(tmp_path / "models", ("minilm",))
    with running_server(repository, "--engine-threads", "1",
                        "--device-price-per-hour", str(price)) as server:
        target = server.removeprefix("http://")
        with running_prometheus(tmp_path / "prometheus", target) as prometheus:
            wait_for(lambda: value(prometheus, 'up{job="batchline"}') == 1, 30, "Prometheus scrapes the server")
            wait_for(lambda: value(prometheus, 'batchline_model_ready{model="minilm"}') == 1, 30, "minilm is ready")
            check_signals(prometheus, server)
            check_contract(prometheus, price)  # after the load: dispatch reasons and busy time exist


def check_contract(prometheus: str, price: float) -> None:
    """Every non-GPU metric of the contract is there with its labels (GPU ones are absent on a
    CPU machine)."""
    scraped = {r["metric"]["__name__"]: r["metric"] for r in query(prometheus, '{job="batchline", __name__=~"batchline_.*"}')}
    expected = {n for n in series_names() if not any(n.startswith(g) for g in GPU_ONLY)}
    assert expected <= set(scraped), f"not exported: {sorted(expected - set(scraped))}"
    assert not set(scraped) & set(GPU_ONLY), "GPU metrics on a CPU machine"
    assert set(scraped) <= series_names(), f"exported, not in the contract: {sorted(set(scraped) - series_names())}"
    for name, (kind, labels) in CONTRACT.items():
        sample = name + ("_count" if kind == "histogram" else "")
        if sample not in scraped:
            continue
        have = set(scraped[sample]) - {"__name__"} - TARGET_LABELS
        assert have == set(labels), f"{name}: labels {sorted(have)}, contract {sorted(labels)}"
    assert value(prometheus, 'batchline_device_price_per_hour{device="cpu"}') == price


def check_signals(prometheus: str, server: str) -> None:
    hpa = find("HorizontalPodAutoscaler", "batchline")
    target_value = float(hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"])
    adapter = render_adapter_query(adapter_rule(hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]), "batchline", ["local"])
    keda = keda_trigger()["metadata"]["query"]
    ratio = render_adapter_query(adapter_rule("batchline_queue_to_compute_ratio"), "batchline", ["local"])

    # Idle: every rate has two samples and reads 0.
    wait_for(lambda: value(prometheus, keda) == 0 and value(prometheus, adapter) == 0, 30, "the signals read 0 at idle")
    assert value(prometheus, ratio) == 0, "the adapter's ratio reads 0 at idle (not NaN)"

    # Overload: more clients than one engine thread serves; the queue builds.
    stop = threading.Event()
    statuses: list[int | str] = []
    deadline = time.monotonic() + LOAD_S
    clients = [threading.Thread(target=load, args=(server, stop, deadline, statuses)) for _ in range(CLIENTS)]
    for client in clients:
        client.start()
    scale_out = (1 + HPA_TOLERANCE) * target_value  # where one replica's HPA asks for a second
    peak, readings = 0.0, []
    try:
        while time.monotonic() < deadline:
            time.sleep(1)
            at = time.time()
            k, a = value(prometheus, keda, at), value(prometheus, adapter, at)
            readings.append((k, a, value(prometheus, ratio, at),
                             value(prometheus, 'sum(batchline:queue_depth_mean_per_replica{job="batchline"})', at)))
            assert k == pytest.approx(a), "KEDA's query is not the sum of the adapter's per-pod values"
            peak = max(peak, k or 0.0)
            if sum(1 for r in readings[-3:] if (r[0] or 0) > scale_out) == 3:
                break
    finally:
        stop.set()
        for client in clients:
            client.join(timeout=REQUEST_TIMEOUT_S + 10)
    assert statuses and set(statuses) == {200}, f"the load failed: {sorted(set(map(str, statuses)))}"
    # What the HPA does with it: desired = ceil(replicas x metric / target), so over 1.1 x target one
    # overloaded replica asks for a second. Under this overload it must.
    assert peak > scale_out, (f"one overloaded replica would not scale out: the queue signal peaked at {peak:.2f}, "
                              f"the HPA's target is {target_value:g}: {readings}")
    last = readings[-1]
    assert last[2] is not None and last[2] > 1, f"queue-to-compute ratio under overload: {last[2]}"
    # One replica, one model: the recording rule is the KEDA value, as of its last evaluation (<= 1 s old).
    assert last[3] == pytest.approx(last[0], rel=0.3), "the recording rule and the KEDA query disagree"

    # Idle again: the [1m] window empties and the signal falls back.
    wait_for(lambda: value(prometheus, 'sum(batchline:queue_depth_per_replica{job="batchline"})') == 0, 15,
             "the queue gauge empties")
    wait_for(lambda: (value(prometheus, keda) or 0) <= 0.25 * peak, 75, f"the KEDA signal falls back from {peak:.2f}")
    wait_for(lambda: (value(prometheus, adapter) or 0) <= 0.25 * peak, 5, "the adapter's signal falls back")
