"""deploy/compose.yaml (+ compose.gpu.yaml): valid for Docker Compose (its own validator,
offline), every file it mounts or builds from exists, and the services point at each other:
Prometheus scrapes the server's port, Grafana reads that Prometheus and the mounted dashboards."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.contract import DEPLOY, ROOT, run, tool

COMPOSE = DEPLOY / "compose.yaml"
COMPOSE_GPU = DEPLOY / "compose.gpu.yaml"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def binds(service: dict[str, Any]) -> dict[str, Path]:
    """container path -> host path of the service's bind mounts (short syntax, relative to deploy/)."""
    found = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        if source.startswith((".", "/")):
            found[target] = (DEPLOY / source).resolve()
    return found


def test_docker_compose_accepts_the_files() -> None:
    compose_bin = tool("docker-compose")
    run(compose_bin, "-f", str(COMPOSE), "config", "--quiet")
    run(compose_bin, "-f", str(COMPOSE), "-f", str(COMPOSE_GPU), "config", "--quiet")
    merged = yaml.safe_load(run(compose_bin, "-f", str(COMPOSE), "-f", str(COMPOSE_GPU), "config").stdout)
    server = merged["services"]["batchline"]
    assert server["build"]["args"]["VARIANT"] == "gpu"
    assert server["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_docker_compose_rejects_an_invalid_file(tmp_path: Path) -> None:
    """The validation above can fail: an unknown service key is refused."""
    bad = tmp_path / "compose.yaml"
    bad.write_text(COMPOSE.read_text().replace("    stop_grace_period: 45s", "    stop_grace_periods: 45s"))
    assert run(tool("docker-compose"), "-f", str(bad), "config", "--quiet", check=False).returncode != 0


def test_everything_compose_mounts_or_builds_exists(compose: dict[str, Any]) -> None:
    build = compose["services"]["batchline"]["build"]
    context = (DEPLOY / build["context"]).resolve()
    assert context == ROOT and (context / build["dockerfile"]).is_file()
    for name, service in compose["services"].items():
        for target, source in binds(service).items():
            assert source.exists(), f"{name} mounts {source} at {target}: missing"
        image = service["image"]
        assert re.fullmatch(r"[\w./-]+:[\w.-]+", image) and not image.endswith(":latest"), f"{name}: pin {image}"
    for volume in (v for s in compose["services"].values() for v in s.get("volumes", [])):
        source = volume.split(":")[0]
        if not source.startswith((".", "/")):
            assert source in compose["volumes"], f"named volume {source} is not declared"


def test_prometheus_scrapes_the_server_and_loads_the_rules(compose: dict[str, Any]) -> None:
    prometheus = compose["services"]["prometheus"]
    mounts = binds(prometheus)
    config_path = next(a.split("=", 1)[1] for a in prometheus["command"] if a.startswith("--config.file="))
    assert mounts[config_path] == DEPLOY / "prometheus" / "prometheus.yml"
    config = yaml.safe_load(mounts[config_path].read_text())
    for rule_file in config["rule_files"]:
        in_container = str(Path(config_path).parent / rule_file)
        assert mounts.get(in_container) == DEPLOY / "prometheus" / "rules.yml", f"{in_container} is not mounted"
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "batchline")
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for c in job["static_configs"] for t in c["targets"]]
    server = compose["services"]["batchline"]
    container_port = server["ports"][0].rsplit(":", 1)[1]
    assert targets == [f"batchline:{container_port}"]
    assert container_port == "8000"  # the image's BATCHLINE_HTTP_PORT and EXPOSE (test_dockerfile.py)


def test_grafana_reads_that_prometheus_and_the_dashboards(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    mounts = binds(grafana)
    provisioning = mounts["/etc/grafana/provisioning"]
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    (source,) = datasources
    assert source["type"] == "prometheus" and source["isDefault"]
    prometheus_port = compose["services"]["prometheus"]["ports"][0].rsplit(":", 1)[1]
    assert source["url"] == f"http://prometheus:{prometheus_port}"
    providers = yaml.safe_load((provisioning / "dashboards" / "batchline.yaml").read_text())["providers"]
    (provider,) = providers
    dashboards = mounts[provider["options"]["path"]]
    assert dashboards == DEPLOY / "grafana" / "dashboards"
    assert list(dashboards.glob("*.json")), "no dashboard in the provisioned folder"
    for path in dashboards.glob("*.json"):
        json.loads(path.read_text())
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(provider["options"]["path"] + "/")
    assert (dashboards / Path(home).name).is_file()


def test_the_server_stops_gracefully(compose: dict[str, Any]) -> None:
    server = compose["services"]["batchline"]
    assert server["stop_signal"] == "SIGTERM"
    grace = int(server["stop_grace_period"].removesuffix("s"))
    assert grace > 30, "uvicorn's graceful shutdown alone takes up to 30 s"
    assert server["healthcheck"]["test"] == ["CMD", "python", "/opt/batchline/healthcheck.py"]
