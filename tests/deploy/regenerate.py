"""Rewrite deploy/k8s/base/prometheusrule.yaml from deploy/prometheus/rules.yml (their groups
must be identical; tests/deploy/test_manifests.py checks).

    python tests/deploy/regenerate.py
"""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
TARGET = ROOT / "deploy" / "k8s" / "base" / "prometheusrule.yaml"
HEADER = """\
# The rules of deploy/prometheus/rules.yml for prometheus-operator: spec.groups must stay
# identical to that file's groups (tests/deploy/test_manifests.py checks). Regenerate, don't edit:
#   python tests/deploy/regenerate.py
# `release` matches kube-prometheus-stack's default ruleSelector: set it to your Prometheus' selector.
"""


def render() -> str:
    document = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "batchline",
            "namespace": "batchline",
            "labels": {"app.kubernetes.io/name": "batchline", "release": "kube-prometheus-stack"},
        },
        "spec": {"groups": yaml.safe_load(RULES.read_text())["groups"]},
    }
    return HEADER + yaml.safe_dump(document, sort_keys=False, width=120, allow_unicode=True)


if __name__ == "__main__":
    TARGET.write_text(render())
    print(f"wrote {TARGET.relative_to(ROOT)}")
