"""/metrics on the real server: exact movement per request sent, and agreement with the
statistics extension."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

TIMEOUT_S = 60.0  # a bound for a busy machine, not a speed claim (httpx's default is 5 s)


def scrape(server_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = httpx.get(f"{server_url}/metrics", timeout=TIMEOUT_S)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def digits(**extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"model": "digits", "version": "1", **extra}.items()))


def image_body(batch: int) -> dict:
    data = np.zeros((batch, 1, 8, 8), dtype=np.float32).ravel().tolist()
    return {"inputs": [{"name": "image", "shape": [batch, 1, 8, 8], "datatype": "FP32", "data": data}]}


def test_metrics_move_exactly_with_the_requests_sent(server_url: str) -> None:
    before = scrape(server_url)
    infer = f"{server_url}/v2/models/digits/infer"
    for batch in (1, 2, 3):
        assert httpx.post(infer, json=image_body(batch), timeout=TIMEOUT_S).status_code == 200
    bad = image_body(1)
    bad["inputs"][0]["datatype"] = "FP64"
    assert httpx.post(infer, json=bad, timeout=TIMEOUT_S).status_code == 400
    after = scrape(server_url)

    def delta(name: str, **extra: str) -> float:
        key = (name, digits(**extra))
        return after[key] - before.get(key, 0.0)

    assert delta("batchline_requests_total", outcome="success") == 3
    assert delta("batchline_requests_total", outcome="invalid") == 1
    assert delta("batchline_inferences_total") == 6
    assert delta("batchline_batches_total") == 3
    assert delta("batchline_batch_size_bucket", le="1") == 1
    assert delta("batchline_batch_size_bucket", le="2") == 2
    assert delta("batchline_batch_size_bucket", le="4") == 3
    assert delta("batchline_queue_duration_seconds_count") == 3
    assert delta("batchline_compute_duration_seconds_count") == 3
    assert delta("batchline_request_duration_seconds_count") == 3  # successes only, as the statistics' success
    assert sum(v for (name, lbl), v in after.items() if name == "batchline_dispatch_total" and ("model", "digits") in lbl) \
        == after[("batchline_batches_total", digits())]
    assert after[("batchline_queue_depth", digits())] == 0
    assert after[("batchline_pending_requests", digits())] == 0
    assert after[("batchline_model_ready", digits())] == 1
    assert delta("batchline_instance_busy_seconds_total", model_instance="digits-1-0") > 0


def test_metrics_agree_with_the_statistics_extension(server_url: str) -> None:
    stats = {s["name"]: s for s in httpx.get(f"{server_url}/v2/models/stats", timeout=TIMEOUT_S).json()["model_stats"]}
    samples = scrape(server_url)
    for model, s in stats.items():
        labels = tuple(sorted({"model": model, "version": s["version"]}.items()))
        assert samples[("batchline_inferences_total", labels)] == s["inference_count"]
        assert samples[("batchline_batches_total", labels)] == s["execution_count"]
        assert samples[("batchline_queue_duration_seconds_count", labels)] == s["inference_stats"]["queue"]["count"]
        success = tuple(sorted({"model": model, "version": s["version"], "outcome": "success"}.items()))
        assert samples[("batchline_requests_total", success)] == s["inference_stats"]["success"]["count"]
        assert samples[("batchline_request_duration_seconds_count", labels)] == s["inference_stats"]["success"]["count"]
        assert samples[("batchline_request_duration_seconds_sum", labels)] == \
            pytest.approx(s["inference_stats"]["success"]["ns"] / 1e9, rel=1e-9, abs=1e-9)
