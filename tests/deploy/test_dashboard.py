"""deploy/grafana/dashboards/batchline.json: loads, is laid out sanely, covers what operators
need, and every query parses and reads only exported metrics or rules.yml's recording rules."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.contract import DEPLOY, check_promql, metric_names, recording_rules, unknown_metrics

DASHBOARD = DEPLOY / "grafana" / "dashboards" / "batchline.json"
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$job": ".*", "$model": ".*"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))  # collapsed rows hold theirs
    return [p for p in found if p["type"] != "row"]


def queries(dashboard: dict[str, Any]) -> dict[str, str]:
    """'panel title / refId' -> expr, the template variables' queries included."""
    found = {f"{p['title']} / {t['refId']}": t["expr"] for p in panels(dashboard) for t in p.get("targets", [])}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found[f"variable {variable['name']}"] = variable["definition"]
    return found


def substitute(expr: str) -> str:
    for variable, replacement in sorted(GRAFANA_VARIABLES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(variable, replacement)
    assert "$" not in expr, f"unknown Grafana variable in {expr}"
    return expr


def test_the_dashboard_is_well_formed(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "batchline" and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["w"] > 0 and grid["h"] > 0, panel["title"]
        assert panel["targets"], f"{panel['title']} has no query"
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert set(re.findall(r"\$(\w+)", target["expr"])) <= {"job", "model", "__rate_interval"}, target["expr"]


def test_every_query_reads_only_exported_metrics_or_recording_rules(dashboard: dict[str, Any]) -> None:
    for where, expr in queries(dashboard).items():
        if expr.startswith("label_values("):
            expr = re.fullmatch(r"label_values\((.*),\s*\w+\)", expr).group(1)  # type: ignore[union-attr]
        assert metric_names(expr), f"{where}: no metric in {expr}"
        assert not unknown_metrics(expr), f"{where} reads {unknown_metrics(expr)}: not exported, not a rule"


def test_every_query_parses(dashboard: dict[str, Any], tmp_path: Path) -> None:
    expressions = {where: substitute(expr) for where, expr in queries(dashboard).items()
                   if not expr.startswith("label_values(")}
    check_promql(expressions, tmp_path)


def test_the_dashboard_shows_what_operators_need(dashboard: dict[str, Any]) -> None:
    exprs = " ".join(queries(dashboard).values())
    used = metric_names(exprs)
    needed = {
        "throughput": {"batchline:inferences:rate1m"},
        "latency p50/p95/p99": {f"batchline:request_duration_seconds:p{q}" for q in (50, 95, 99)},
        "queue depth": {"batchline:queue_depth_per_replica", "batchline_queue_depth"},
        "dispatch reasons": {"batchline_dispatch_total"},
        "GPU utilization": {"batchline_gpu_utilization_ratio"},
        "GPU memory": {"batchline_gpu_memory_used_bytes", "batchline_gpu_memory_total_bytes"},
        "cost per 1k inferences": {"batchline:cost_per_1k_inferences_dollars"},
    }
    for what, metrics in needed.items():
        assert metrics <= used, f"no panel for {what}: {metrics - used}"
    assert "sum by (reason)" in exprs or "sum by (model, reason)" in exprs, "dispatch reasons are not split by reason"
    heatmaps = [p for p in panels(dashboard) if p["type"] == "heatmap"]
    assert any(t.get("format") == "heatmap" and "batchline_batch_size_bucket" in t["expr"] and "by (le)" in t["expr"]
               for p in heatmaps for t in p["targets"]), "no batch size distribution (heatmap of the histogram's buckets)"


def test_busy_time_is_grouped_by_model_instance(dashboard: dict[str, Any]) -> None:
    """Busy time is per engine instance (`model_instance`), not per scrape target (`instance`)."""
    for where, expr in queries(dashboard).items():
        if "batchline_instance_busy_seconds_total" in expr:
            assert "model_instance" in expr, f"{where} groups busy time by the target, not the engine instance"


def test_recording_rules_used_by_the_dashboard_exist(dashboard: dict[str, Any]) -> None:
    used = {n for n in metric_names(" ".join(queries(dashboard).values())) if ":" in n}
    assert used <= set(recording_rules()), used - set(recording_rules())
