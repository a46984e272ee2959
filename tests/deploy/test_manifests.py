"""deploy/k8s/: every resource validates strictly (Kubernetes' own schemas, offline, through
kubernetes-validate; ours in tests/deploy/schemas/ for custom resources), the kustomizations
hold together, and the pieces agree with each other, with the server's CLI and with the image."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from server.cli import build_parser
from server.settings import ServerSettings
from tests.deploy.contract import (
    K8S,
    K8S_VERSIONS,
    ROOT,
    adapter_rule,
    adapter_rules,
    all_documents,
    documents,
    find,
    keda_trigger,
    manifest_files,
    rule_groups,
    validate_manifest,
)

RESOURCES = [(path, i, doc) for path in manifest_files() for i, doc in enumerate(documents(path))]
CUSTOM_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ScaledObject", "ServingRuntime", "InferenceService"}
UVICORN_DRAIN_S = 30  # server/cli.py: timeout_graceful_shutdown


def container(workload: dict[str, Any], name: str = "batchline") -> dict[str, Any]:
    (found,) = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def cli(args: list[str]):  # type: ignore[no-untyped-def]
    """The container's command line, parsed by the server's own parser."""
    return build_parser().parse_args(args)


# ---- schemas -------------------------------------------------------------------------------
@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(("path", "index", "document"), RESOURCES,
                         ids=[f"{p.relative_to(K8S)}#{i}-{d['kind']}" for p, i, d in RESOURCES])
def test_every_resource_validates_strictly(path: Path, index: int, document: dict[str, Any], version: str) -> None:
    used = validate_manifest(document, version)
    assert used == ("crd" if document["kind"] in CUSTOM_KINDS else "kubernetes"), (document["kind"], used)


@pytest.mark.parametrize(("kind", "mutate"), [
    ("Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0].update(imagePullPolicyy="Always")),
    ("Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"].update(periodSeconds="5s")),
    ("HorizontalPodAutoscaler", lambda d: d["spec"]["metrics"][0]["pods"]["target"].update(averagevalue="4")),
    ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].update(intervall="5s")),
    ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].update(interval="5 seconds")),
    ("PrometheusRule", lambda d: d["spec"]["groups"][0]["rules"][0].pop("expr")),
    ("ScaledObject", lambda d: d["spec"]["triggers"][0]["metadata"].update(threshold=4)),
    ("ScaledObject", lambda d: d["spec"].pop("scaleTargetRef")),
    ("ServingRuntime", lambda d: d["spec"]["containers"][0].update(ports=[{"port": 8080}])),
    ("ServingRuntime", lambda d: d["spec"].update(protocolVersions=["v3"])),
    ("InferenceService", lambda d: d["spec"]["predictor"]["model"].update(storageUri="batchline-models")),
    ("InferenceService", lambda d: d["spec"]["predictor"]["model"]["resources"].update(limit={"cpu": "1"})),
])
def test_the_validation_can_fail(kind: str, mutate) -> None:  # type: ignore[no-untyped-def]
    """A typo or a wrong type in each kind of resource is refused, by both kinds of schema."""
    document = copy.deepcopy(next(d for _, d in all_documents() if d["kind"] == kind))
    mutate(document)
    with pytest.raises(jsonschema.ValidationError):
        validate_manifest(document, K8S_VERSIONS[-1])


def test_every_custom_schema_is_used() -> None:
    from tests.deploy.contract import SCHEMAS, crd_schema_file

    used = {crd_schema_file(d) for _, d in all_documents() if d["kind"] in CUSTOM_KINDS}
    assert set(SCHEMAS.glob("*.json")) == used


# ---- kustomizations ------------------------------------------------------------------------
KUSTOMIZATIONS = sorted(K8S.rglob("kustomization.yaml"))


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS, ids=[str(k.parent.relative_to(K8S)) for k in KUSTOMIZATIONS])
def test_kustomizations_hold_together(kustomization: Path) -> None:
    """Each resource is a file of the folder (kustomize's load restrictor refuses files outside
    it) or a folder with a kustomization; no manifest of the folder is left out."""
    spec = yaml.safe_load(kustomization.read_text())
    assert spec["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and spec["kind"] == "Kustomization"
    listed_files = set()
    for resource in spec["resources"]:
        target = (kustomization.parent / resource).resolve()
        if target.is_dir():
            assert (target / "kustomization.yaml").is_file(), f"{resource} has no kustomization.yaml"
        else:
            assert target.is_file(), f"{resource} does not exist"
            assert target.parent == kustomization.parent, f"{resource} is outside the kustomization's folder"
            listed_files.add(target)
    in_folder = {p.resolve() for p in kustomization.parent.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert in_folder == listed_files, f"not listed: {in_folder - listed_files}"


def kinds(folder: str) -> list[str]:
    """The kinds `kubectl apply -k deploy/k8s/<folder>` creates."""
    spec = yaml.safe_load((K8S / folder / "kustomization.yaml").read_text())
    found = []
    for resource in spec["resources"]:
        target = (K8S / folder / resource).resolve()
        if target.is_dir():
            found += kinds(str(target.relative_to(K8S)))
        else:
            found += [d["kind"] for d in documents(target)]
    return found


def test_one_autoscaler_per_overlay() -> None:
    assert "HorizontalPodAutoscaler" not in kinds("base") and "ScaledObject" not in kinds("base")
    assert kinds("hpa").count("HorizontalPodAutoscaler") == 1 and "ScaledObject" not in kinds("hpa")
    assert kinds("keda").count("ScaledObject") == 1 and "HorizontalPodAutoscaler" not in kinds("keda")


def test_the_image_override_names_the_deployments_image() -> None:
    spec = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    (image,) = spec["images"]
    deployment_image = container(find("Deployment", "batchline"))["image"]
    assert deployment_image.split(":")[0] == image["name"]
    assert deployment_image == f"{image['newName']}:{image['newTag']}"


# ---- the Deployment ------------------------------------------------------------------------
def test_the_deployment_serves_with_probes_on_the_v2_health_endpoints() -> None:
    deployment = find("Deployment", "batchline")
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert "replicas" not in deployment["spec"], "the autoscaler owns the replica count"
    server = container(deployment)
    args = cli(server["command"][1:] + server["args"]) if server["command"] == ["batchline"] else pytest.fail("command")
    assert args.command == "serve" and args.host == "0.0.0.0"
    http, grpc = server["ports"]
    assert http["name"] == "http" and http["containerPort"] == args.http_port
    assert grpc["name"] == "grpc" and grpc["containerPort"] == args.grpc_port == 8001
    assert server["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert server["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert server["startupProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    startup = server["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120, "give the image two minutes to start"


def test_the_deployment_drains_before_it_is_killed() -> None:
    """preStop sleeps while the pod leaves the endpoints, then SIGTERM: uvicorn drains up to 30 s
    and the repository finishes the queue. The grace period covers all of it, with a margin."""
    deployment = find("Deployment", "batchline")
    pod = deployment["spec"]["template"]["spec"]
    command = container(deployment)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = int(command[1])
    assert pre_stop >= 5
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + UVICORN_DRAIN_S + 10
    strategy = deployment["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0, "a rollout never drops below the serving replicas"


def test_the_deployment_asks_for_one_gpu_and_runs_as_the_images_user() -> None:
    deployment = find("Deployment", "batchline")
    pod = deployment["spec"]["template"]["spec"]
    resources = container(deployment)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == "1"
    assert resources["requests"].get("nvidia.com/gpu", "1") == resources["limits"]["nvidia.com/gpu"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    dockerfile_user = re.search(r"^USER (\d+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert dockerfile_user and pod["securityContext"]["runAsUser"] == int(dockerfile_user.group(1))
    assert pod["securityContext"]["runAsNonRoot"] is True
    server = container(deployment)
    assert server["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "tmp", "mountPath": "/tmp"} in server["volumeMounts"]


@pytest.mark.parametrize(("kind", "name"), [("Deployment", "batchline"), ("ServingRuntime", "batchline")])
def test_environment_variables_are_server_settings(kind: str, name: str) -> None:
    """Every BATCHLINE_* variable is a field of ServerSettings (a typo would be ignored silently)."""
    resource = find(kind, name)
    containers = (resource["spec"]["containers"] if kind == "ServingRuntime"
                  else resource["spec"]["template"]["spec"]["containers"])
    fields = {f"BATCHLINE_{f.upper()}" for f in ServerSettings.model_fields}
    for variable in (e["name"] for c in containers for e in c.get("env", [])):
        if variable.startswith("BATCHLINE_"):
            assert variable in fields, f"{kind}: {variable} is not a server setting ({sorted(fields)})"


def test_the_service_monitor_and_pdb_select_the_pods() -> None:
    pod_labels = find("Deployment", "batchline")["spec"]["template"]["metadata"]["labels"]
    service = find("Service", "batchline")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    port, grpc = service["spec"]["ports"]
    assert port["targetPort"] == "http" and grpc["targetPort"] == "grpc" and grpc["port"] == 8001
    monitor = find("ServiceMonitor", "batchline")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["metadata"]["namespace"] in monitor["spec"]["namespaceSelector"]["matchNames"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"
    pdb = find("PodDisruptionBudget", "batchline")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_the_prometheus_rule_is_rules_yml() -> None:
    from tests.deploy.regenerate import TARGET, render

    assert find("PrometheusRule", "batchline")["spec"]["groups"] == rule_groups()
    assert TARGET.read_text() == render(), "run: python tests/deploy/regenerate.py"


# ---- autoscaling ---------------------------------------------------------------------------
def test_the_hpa_scales_the_deployment_on_an_adapter_metric() -> None:
    hpa = find("HorizontalPodAutoscaler", "batchline")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", find("Deployment", "batchline")["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    rule = adapter_rule(metric["pods"]["metric"]["name"])
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    assert float(metric["pods"]["target"]["averageValue"]) > 0
    pdb = find("PodDisruptionBudget", "batchline")
    assert hpa["spec"]["minReplicas"] >= pdb["spec"]["maxUnavailable"] + 1, "a drain must leave one replica serving"


def test_the_adapter_rules_are_well_formed() -> None:
    for rule in adapter_rules():
        assert 'namespace!=""' in rule["seriesQuery"] and 'pod!=""' in rule["seriesQuery"], rule["seriesQuery"]
        assert "sum by (<<.GroupBy>>)" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]
        assert re.fullmatch(r"\^[a-z_:]+\$", rule["name"]["matches"]), rule["name"]["matches"]
        series = rule["name"]["matches"].strip("^$")
        assert rule["seriesQuery"].startswith(series + "{")


@pytest.mark.parametrize(("folder", "selector"), [
    ("keda", 'namespace="batchline",job="batchline"'),
    ("kserve", 'namespace="batchline",pod=~"batchline-predictor-.*"'),
])
def test_keda_scales_like_the_hpa(folder: str, selector: str) -> None:
    """Same sizing: KEDA's query is the sum over pods of the adapter's per-pod query, and with
    AverageValue KEDA's HPA computes ceil(sum / threshold) = ceil(n x average / averageValue)."""
    hpa = find("HorizontalPodAutoscaler", "batchline")
    (metric,) = hpa["spec"]["metrics"]
    rule = adapter_rule(metric["pods"]["metric"]["name"])
    scaled = find("ScaledObject", folder=folder)
    trigger = keda_trigger(folder)
    series = rule["name"]["matches"].strip("^$")
    summed = (rule["metricsQuery"].replace("sum by (<<.GroupBy>>) (", "sum(")
              .replace("<<.Series>>", series).replace("<<.LabelMatchers>>", selector))
    assert trigger["metadata"]["query"] == summed
    assert trigger["metricType"] == "AverageValue"
    assert float(trigger["metadata"]["threshold"]) == float(metric["pods"]["target"]["averageValue"])
    assert scaled["spec"]["minReplicaCount"] == hpa["spec"]["minReplicas"]
    assert scaled["spec"]["maxReplicaCount"] == hpa["spec"]["maxReplicas"]
    assert scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa["spec"]["behavior"]
    assert trigger["metadata"]["serverAddress"].startswith("http")


def test_keda_targets_the_deployments() -> None:
    assert find("ScaledObject", folder="keda")["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": find("Deployment", "batchline")["metadata"]["name"]}
    isvc = find("InferenceService", "batchline")
    assert find("ScaledObject", folder="kserve")["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": f"{isvc['metadata']['name']}-predictor"}
    assert isvc["metadata"]["annotations"]["serving.kserve.io/autoscalerClass"] == "external"
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"


# ---- KServe --------------------------------------------------------------------------------
def test_the_serving_runtime_runs_batchline_on_the_v2_protocol() -> None:
    runtime = find("ServingRuntime", "batchline")
    (server,) = runtime["spec"]["containers"]
    assert server["name"] == "kserve-container"
    assert server["command"] == ["batchline"]
    args = cli(server["args"])
    assert args.command == "serve" and args.host == "0.0.0.0" and args.model_repository == Path("/mnt/models")
    (port,) = server["ports"]
    assert port["containerPort"] == args.http_port
    assert server["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": args.http_port}
    assert server["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": args.http_port}
    assert runtime["spec"]["protocolVersions"] == ["v2"]
    assert runtime["spec"]["annotations"]["prometheus.kserve.io/port"] == str(args.http_port)
    pod_monitor = find("PodMonitor", "batchline-predictor")
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] == port["name"]


def test_the_inference_service_uses_the_runtime() -> None:
    runtime = find("ServingRuntime", "batchline")
    isvc = find("InferenceService", "batchline")
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    formats = {(f["name"], f.get("version")) for f in runtime["spec"]["supportedModelFormats"]}
    assert (model["modelFormat"]["name"], model["modelFormat"].get("version")) in formats
    assert isvc["metadata"]["namespace"] == runtime["metadata"]["namespace"]
    pod_monitor = find("PodMonitor", "batchline-predictor")
    assert pod_monitor["spec"]["selector"]["matchLabels"] == {"serving.kserve.io/inferenceservice": isvc["metadata"]["name"]}
    pre_stop = int(runtime["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][1])
    assert isvc["spec"]["predictor"]["terminationGracePeriodSeconds"] >= pre_stop + UVICORN_DRAIN_S + 10
