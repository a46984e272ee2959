"""deploy/prometheus/: the config and rules pass promtool, the rules' unit tests pass, every
rule and alert is unit-tested, and every metric they read is one the server exports."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.deploy.contract import (
    DEPLOY,
    RULES,
    adapter_rules,
    alerting_rules,
    check_promql,
    keda_trigger,
    recording_rules,
    render_adapter_query,
    rule_groups,
    run,
    tool,
    unknown_metrics,
)

UNIT_TESTS = Path(__file__).resolve().parent / "promtool" / "rules_test.yml"

REQUIRED_RECORDS = {
    "batchline:queue_to_compute_ratio",
    "batchline:queue_depth_per_replica",
    "batchline:request_duration_seconds:p50",
    "batchline:request_duration_seconds:p95",
    "batchline:request_duration_seconds:p99",
    "batchline:inferences:rate1m",
    "batchline:batch_size:avg",
    "batchline:cost_per_1k_inferences_dollars",
    "batchline:energy_per_inference_joules",
}
REQUIRED_ALERTS = {"BatchlineModelNotReady", "BatchlineQueueGrowing", "BatchlineHighP99Latency"}


def test_promtool_accepts_the_config_and_the_rules() -> None:
    promtool = tool("promtool")
    run(promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml"))
    run(promtool, "check", "rules", str(RULES))


def test_promtool_rejects_a_broken_rule(tmp_path: Path) -> None:
    """The check above can fail: a rule with a PromQL error is refused."""
    broken = tmp_path / "broken.yml"
    broken.write_text(RULES.read_text().replace("rate(batchline_inferences_total[1m])", "rate(batchline_inferences_total[1m]", 1))
    assert run(tool("promtool"), "check", "rules", str(broken), check=False).returncode != 0


def test_recording_rules_compute_the_expected_values() -> None:
    """promtool test rules: input series -> expected values, worked out by hand in the file."""
    done = run(tool("promtool"), "test", "rules", UNIT_TESTS.name, cwd=UNIT_TESTS.parent)
    assert "SUCCESS" in done.stdout + done.stderr


def test_the_unit_tests_can_fail(tmp_path: Path) -> None:
    """Change one rule (cost per 1k inferences without the x1000) and the unit tests fail."""
    rules = tmp_path / "rules.yml"
    rules.write_text(RULES.read_text().replace("> 0) * 1000", "> 0)", 1))
    tests = tmp_path / "rules_test.yml"
    tests.write_text(UNIT_TESTS.read_text().replace("../../../deploy/prometheus/rules.yml", str(rules)))
    done = run(tool("promtool"), "test", "rules", str(tests), check=False)
    assert done.returncode != 0 and "cost_per_1k_inferences_dollars" in done.stdout + done.stderr


def test_the_required_rules_exist() -> None:
    assert REQUIRED_RECORDS <= set(recording_rules()), REQUIRED_RECORDS - set(recording_rules())
    assert REQUIRED_ALERTS <= set(alerting_rules()), REQUIRED_ALERTS - set(alerting_rules())
    names = [r.get("record") or r.get("alert") for g in rule_groups() for r in g["rules"]]
    assert len(names) == len(set(names)), "a rule is defined twice"


def test_every_rule_and_alert_has_a_unit_test() -> None:
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    tested_records = {t["expr"] for case in tests for t in case.get("promql_expr_test", [])}
    tested_alerts = {t["alertname"] for case in tests for t in case.get("alert_rule_test", [])
                     if t.get("exp_alerts")}
    assert set(recording_rules()) <= tested_records, set(recording_rules()) - tested_records
    assert set(alerting_rules()) <= tested_alerts, set(alerting_rules()) - tested_alerts


def test_rules_read_only_exported_metrics() -> None:
    for name, expr in {**recording_rules(), **{a: r["expr"] for a, r in alerting_rules().items()}}.items():
        assert not unknown_metrics(expr), f"{name} reads {unknown_metrics(expr)}, which the server does not export"


def test_the_autoscaling_queries_parse_and_read_exported_metrics(tmp_path: Path) -> None:
    expressions = {f"adapter {r['name']['as']}": render_adapter_query(r, "batchline", ["a", "b"]) for r in adapter_rules()}
    expressions["keda"] = keda_trigger()["metadata"]["query"]
    expressions["keda (kserve)"] = keda_trigger("kserve")["metadata"]["query"]
    for name, expr in expressions.items():
        assert not unknown_metrics(expr), f"{name} reads {unknown_metrics(expr)}"
    check_promql(expressions, tmp_path)
