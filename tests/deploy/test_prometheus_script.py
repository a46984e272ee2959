"""scripts/prometheus.sh: starts Debian's prometheus on loopback with a config of its own that
scrapes the target and evaluates rules.yml, reports it, refuses a second start, and stops it by
its PID. The target here is a stand-in that serves fixed Batchline metrics, so the autoscaling
queries have known answers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.deploy.contract import (
    PROMETHEUS_SCRIPT,
    adapter_rule,
    keda_trigger,
    render_adapter_query,
    run,
    running_prometheus,
    tool,
    value,
    wait_for,
)

START = time.time()


def metrics() -> bytes:
    """Two models: 3 and 2 requests waiting now; digits accrues 1.5 queue-seconds per second
    (a mean of 1.5 waiting, by Little's law), minilm 0.5."""
    elapsed = time.time() - START
    return f"""\
# TYPE batchline_queue_depth gauge
batchline_queue_depth{{model="digits",version="1"}} 3.0
batchline_queue_depth{{model="minilm",version="1"}} 2.0
# TYPE batchline_queue_duration_seconds histogram
batchline_queue_duration_seconds_sum{{model="digits",version="1"}} {1.5 * elapsed}
batchline_queue_duration_seconds_sum{{model="minilm",version="1"}} {0.5 * elapsed}
# TYPE batchline_model_ready gauge
batchline_model_ready{{model="digits",version="1"}} 1.0
batchline_model_ready{{model="minilm",version="1"}} 1.0
""".encode()


class _Metrics(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = metrics() if self.path == "/metrics" else b"not found"
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def target() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def script(*arguments: str, check: bool = True, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return run("bash", str(PROMETHEUS_SCRIPT), *arguments, env={"PROMETHEUS": tool("prometheus"), **(env or {})},
               check=check, timeout=60)


def test_start_scrape_evaluate_stop(target: str, tmp_path: Path) -> None:
    folder = tmp_path / "prometheus"
    with running_prometheus(folder, target) as url:
        assert url.startswith("http://127.0.0.1:")
        pid = int((folder / "prometheus.pid").read_text())
        assert "prometheus" in Path(f"/proc/{pid}/cmdline").read_text()
        assert script("status", "--dir", str(folder)).stdout.strip() == url
        again = script("start", "--dir", str(folder), "--port", "0", "--target", target, check=False)
        assert again.returncode == 1 and "already running" in again.stderr

        wait_for(lambda: value(url, f'up{{job="batchline",instance="{target}"}}') == 1, 30, "the target is scraped")
        # the rules are loaded and evaluated: (3 + 2) queued on the one replica
        wait_for(lambda: value(url, 'sum(batchline:queue_depth_per_replica{namespace="batchline",job="batchline"})') == 5,
                 30, "the recording rule is evaluated")
        # The KEDA query, verbatim (the script's default labels are a ServiceMonitor's), and the
        # adapter's per-pod query: equal (one pod), above 0, at most 1.5 + 0.5 (a [1m] rate over
        # the seconds scraped so far reads part of it).
        keda = keda_trigger()["metadata"]["query"]
        adapter = render_adapter_query(adapter_rule("batchline_queue_depth_mean"), "batchline", ["local"])
        wait_for(lambda: (value(url, keda) or 0) > 0.05, 30, "the KEDA query answers")
        at = time.time()
        assert value(url, keda, at) == pytest.approx(value(url, adapter, at))
        assert 0 < (value(url, keda, at) or 0) <= 2.05
    assert not Path(f"/proc/{pid}").exists() or "prometheus" not in Path(f"/proc/{pid}/cmdline").read_text()
    assert not (folder / "prometheus.pid").exists()
    assert script("status", "--dir", str(folder), check=False).returncode == 1
    assert script("stop", "--dir", str(folder)).returncode == 0  # stopping twice is fine


def test_start_says_how_to_install_prometheus(tmp_path: Path) -> None:
    done = script("start", "--dir", str(tmp_path), env={"PROMETHEUS": str(tmp_path / "no-prometheus")}, check=False)
    assert done.returncode == 3 and "apt-get install -y prometheus" in done.stderr


def test_start_refuses_a_port_in_use(tmp_path: Path) -> None:
    with running_prometheus(tmp_path / "first", "127.0.0.1:9") as url:
        port = url.rsplit(":", 1)[1]
        done = script("start", "--dir", str(tmp_path / "second"), "--port", port, check=False)
        assert done.returncode == 1 and "in use" in done.stderr
        assert not (tmp_path / "second" / "prometheus.pid").exists()


def test_start_reports_a_prometheus_that_will_not_start(tmp_path: Path) -> None:
    """A config Prometheus refuses (an interval that is no duration): its log, nothing left running."""
    done = script("start", "--dir", str(tmp_path), "--port", "0", "--interval", "soon", check=False)
    assert done.returncode == 1 and "prometheus exited" in done.stderr and "soon" in done.stderr
    assert not (tmp_path / "prometheus.pid").exists()


def test_usage(tmp_path: Path) -> None:
    done = script("restart", check=False)
    assert done.returncode == 2 and "scripts/prometheus.sh start" in done.stderr
