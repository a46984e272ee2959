"""loadtest/gpu_check: the dry run end to end (the GPU flow on the CPU, tiny models, the real
server), its report checked figure by figure; the watchdog at the time limit; the wheels for the
GPU host, fetched from PyPI (a small list) and installed from the folder alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from importlib import metadata
from pathlib import Path

import pytest

from loadtest import gpucheck, gpucheck_wheels
from loadtest.gpucheck_report import SUMMARY_HEADERS
from loadtest.report import markdown_table
from tests.deploy.contract import tool
from tests.loadtest.conftest import run_command

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "loadtest" / "gpu_check"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, Path, float]:
    out = tmp_path_factory.mktemp("gpu-check")
    # The install phase as on the GPU host, from a folder whose one requirement is met here already.
    wheels = tmp_path_factory.mktemp("wheels")
    (wheels / "requirements.txt").write_text(f"numpy=={metadata.version('numpy')}\n")
    started = time.monotonic()
    run_command(str(LAUNCHER), "--dry-run", "--wheels", str(wheels), str(out), timeout=300)
    took = time.monotonic() - started
    return json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.md").read_text(), out, took


@pytest.mark.integration
def test_the_dry_run_completes_every_phase_in_its_budget(dry_run) -> None:  # type: ignore[no-untyped-def]
    record, markdown, out, took = dry_run
    assert record["schema"] == gpucheck.SCHEMA and record["mode"] == "dry-run"
    assert record["complete"] is True and record["partial"] == [] and record["exit_code"] == 0
    assert list(record["phases"]) == ["install", "build", "engine", "serve"]
    assert record["wheels"]["installed"] == [] and record["wheels"]["already_present"] == [
        f"numpy=={metadata.version('numpy')}"]
    assert record["machine"]["logical_cpus"] and record["machine"]["python"]
    for name, phase in record["phases"].items():
        assert phase["status"] == "done", (name, phase)
        assert 0 < phase["took_s"] <= phase["budget_s"] + 1, (name, phase)
    assert 0 < record["elapsed_s"] <= took <= record["time_limit_s"]
    assert record["device"]["device"] == "cpu" and record["device"]["torch"]
    assert record["onnx"]["status"] == "skipped" and record["onnx"]["reason"]
    assert (out / gpucheck.SERVER_LOG).read_text() and "phase serve: done" in (out / gpucheck.PROGRESS_LOG).read_text()
    assert markdown.startswith("# GPU check (dry-run): complete")


@pytest.mark.integration
def test_the_dry_run_builds_each_model_in_each_precision(dry_run) -> None:  # type: ignore[no-untyped-def]
    record = dry_run[0]
    profile = gpucheck.DRY_RUN
    assert list(record["models"]) == list(gpucheck.ROLES)
    for role, entry in record["models"].items():
        assert entry["about"]["parameters"] > 0 and entry["about"]["source"]
        assert list(entry["variants"]) == list(profile.precisions)
        for precision, variant in entry["variants"].items():
            if role == "resnet" and precision == "int8":  # convolutions: torchao's INT8 does not apply
                assert variant["status"] == "unsupported" and "convolutions" in variant["reason"]
                continue
            assert variant["status"] == "built", (role, precision, variant)
            assert variant["name"] == f"{entry['name']}-{precision}" and variant["method"]
    assert record["models"]["bert"]["about"]["sequence"] == 16  # the tiny shapes


@pytest.mark.integration
def test_the_dry_run_measures_the_engine_per_bucket(dry_run) -> None:  # type: ignore[no-untyped-def]
    record = dry_run[0]
    for role, entry in record["models"].items():
        for precision, variant in entry["variants"].items():
            if variant["status"] != "built":
                continue
            engine = variant["engine"]
            assert "error" not in engine and engine["load_s"] > 0
            assert [b["batch_size"] for b in engine["buckets"]] == gpucheck.DRY_RUN.buckets[role]
            for bucket in engine["buckets"]:
                assert bucket["runs"] >= 5 and bucket["elapsed_s"] > 0
                assert bucket["items_s"] == pytest.approx(bucket["batch_size"] * bucket["runs"] / bucket["elapsed_s"],
                                                          rel=0.01, abs=0.1)
                assert 0 < bucket["latency_ms"]["min"] <= bucket["latency_ms"]["p50"] <= bucket["latency_ms"]["p99"]
            gpu = engine["gpu"]
            assert gpu["available"] is False and "NVML" in gpu["reason"]  # this machine has none
            if role == "digits":  # trained on scikit-learn's digits: far better than chance (0.1)
                assert 0.3 < engine["accuracy"] <= 1.0, (precision, engine["accuracy"])
            else:
                assert "accuracy" not in engine


@pytest.mark.integration
def test_the_dry_run_serves_every_variant_and_reads_it_against_the_engine(dry_run) -> None:  # type: ignore[no-untyped-def]
    record = dry_run[0]
    profile = gpucheck.DRY_RUN
    assert all(state == "READY" for state in record["serve"]["states"].values())
    for role, entry in record["models"].items():
        for variant in entry["variants"].values():
            if variant["status"] != "built":
                continue
            served = variant["served"]
            assert served["error_count"] == 0 and served["errors"] == {}, served["first_error"]
            assert served["concurrency"] == profile.concurrency[role]
            assert served["client_processes"] == profile.client_processes
            assert served["items_per_request"] == profile.items_per_request[role]
            assert served["requests"] > 0 and served["validated_replies"] >= profile.concurrency[role]
            assert served["items_s"] == pytest.approx(
                served["requests"] * served["items_per_request"] / served["duration_s"], abs=0.01)
            latency = served["latency_ms"]
            assert 0 < latency["p50"] <= latency["p99"] <= latency["max"]
            # the ratio is the served rate over the engine's best bucket the server may form
            allowed = [b for b in variant["engine"]["buckets"] if b["batch_size"] <= profile.max_batch[role]]
            best = max(allowed, key=lambda b: b["items_s"])
            assert (served["engine_items_s"], served["engine_batch"]) == (best["items_s"], best["batch_size"])
            assert served["ratio_to_engine"] == round(served["items_s"] / best["items_s"], 3) > 0
            server = served["server"]  # the server's own count over the load (warm-up and drain included)
            assert server["batches"] > 0 and server["items"] >= served["requests"] * served["items_per_request"]
            assert 1 <= server["mean_batch"] <= profile.max_batch[role]
            assert server["compute_infer_ms_per_batch"] > 0


@pytest.mark.integration
def test_the_dry_run_markdown_shows_the_figures_of_the_record(dry_run) -> None:  # type: ignore[no-untyped-def]
    record, markdown = dry_run[0], dry_run[1]
    rows = {(r["model"], r["precision"]): r for r in record["summary"]}
    for entry in record["models"].values():
        for precision, variant in entry["variants"].items():
            row = rows[(entry["name"], precision)]
            if variant["status"] != "built":
                assert row["note"] == f"{variant['status']}: {variant['reason']}"
                continue
            served = variant["served"]
            assert (row["served_items_s"], row["ratio_to_engine"]) == (served["items_s"], served["ratio_to_engine"])
            assert (row["p50_ms"], row["p99_ms"]) == (served["latency_ms"]["p50"], served["latency_ms"]["p99"])
            assert row["engine_best_items_s"] == served["engine_items_s"] and row["accuracy"] == variant["engine"].get("accuracy")
            line = markdown_table(SUMMARY_HEADERS, [(
                row["model"], row["precision"], row["engine_best_items_s"], row["engine_best_batch"],
                row["served_items_s"], row["ratio_to_engine"], row["p50_ms"], row["p99_ms"], row["mean_batch"],
                row["gpu_util_pct"], row["gpu_memory_mib"], row["power_w"], row["accuracy"])]).splitlines()[-1]
            assert line in markdown, line
    assert "- resnet-tiny int8: unsupported: " in markdown
    assert "## Engine alone, per batch bucket" in markdown and "| build |" in markdown


def test_the_watchdog_writes_what_there_is_and_stops_the_run_at_the_limit(tmp_path: Path) -> None:
    """A phase that never ends: the run still stops by its limit, with a report marked partial
    and its child processes (the server, the clients) killed."""
    script = textwrap.dedent(f"""
        import subprocess, time
        from pathlib import Path
        from loadtest.gpucheck import DRY_RUN, Run
        child = subprocess.Popen(["sleep", "60"])
        Path({str(tmp_path / "child")!r}).write_text(str(child.pid))
        run = Run(Path({str(tmp_path / "out")!r}), DRY_RUN, 4.0, ["--dry-run", "out"])
        run.watch()
        with run.phase("build", None):
            time.sleep(60)
    """)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=False)
    took = time.monotonic() - started
    assert done.returncode == 3, done.stderr
    assert took < 30  # 4 s of limit, plus the interpreter's start
    record = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert record["complete"] is False and "watchdog" in record["stopped"] and record["stopped"] in record["partial"]
    assert record["phases"]["build"]["status"] == "running"
    assert (tmp_path / "out" / "gpu_check.md").read_text().startswith("# GPU check (dry-run): PARTIAL")
    pid = int((tmp_path / "child").read_text())
    stat = Path(f"/proc/{pid}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", "the child still runs"


# ---- wheels for the GPU host ---------------------------------------------------------------------
def test_the_carried_requirements_are_the_projects_less_the_hosts(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(textwrap.dedent("""
        [project]
        name = "x"
        dependencies = ["fastapi>=0.1", "numpy>=1.26", "uvicorn[standard]>=0.1", "PyYAML>=6", "no-such-dist-here>=1"]
        [project.optional-dependencies]
        gpu = ["onnxruntime-gpu>=1.18", "torch>=2.11", "nvidia-ml-py>=12"]
        torchao = ["torchao==0.18.0"]
        test = ["pytest>=8"]
    """))
    carried, left_out = gpucheck_wheels.carried_requirements(pyproject, ("gpu", "torchao"))
    assert carried == [
        f"fastapi=={metadata.version('fastapi')}",  # pinned to what the tests here ran with
        f"uvicorn[standard]=={metadata.version('uvicorn')}",
        "no-such-dist-here>=1",  # not installed here: as declared
        "torchao==0.18.0",
    ]
    assert left_out["numpy"] == left_out["pyyaml"] == left_out["torch"] == "on the GPU host already"
    assert "budget" in left_out["onnxruntime-gpu"] and "pytest" not in left_out


def test_the_server_needs_no_module_the_wheels_leave_out() -> None:
    carried, left_out = gpucheck_wheels.carried_requirements()
    names = {gpucheck_wheels.normalize(gpucheck_wheels._name(r)) for r in carried}
    assert {"fastapi", "fastapi-offline", "orjson", "pydantic", "pydantic-settings", "uvicorn"} <= names
    assert not names & gpucheck_wheels.HOST_PROVIDES and "onnxruntime-gpu" in left_out


def test_fetch_then_install_from_the_folder_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two pure-Python wheels from PyPI: one this interpreter lacks (installed into the target),
    one it has at that very version (left to the interpreter's own)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    present = f"annotated-types=={metadata.version('annotated-types')}"
    folder = tmp_path / "whl"
    found = gpucheck_wheels.fetch(folder, ["tomli-w", present])
    names = sorted(w.path.name for w in found)
    assert len(names) == 2 and names[0].startswith("annotated_types-") and names[1].startswith("tomli_w-")
    assert all(name.endswith("-py3-none-any.whl") for name in names)
    assert (folder / "requirements.txt").read_text() == f"tomli-w\n{present}\n"
    assert gpucheck_wheels.describe(found).splitlines()[-1].endswith("total, 2 wheels")
    with pytest.raises(gpucheck_wheels.WheelError, match="over the budget"):
        gpucheck_wheels.check_budget(found, 1024)

    installed = gpucheck_wheels.install(folder, tmp_path / "site")
    assert [n.split("==")[0] for n in installed["installed"]] == ["tomli_w"] and installed["already_present"] == [present]
    assert (tmp_path / "site" / "tomli_w" / "__init__.py").is_file()
    assert not (tmp_path / "site" / "annotated_types").exists()
    assert sys.path[0] == str(tmp_path / "site") and os.environ["PYTHONPATH"].startswith(str(tmp_path / "site"))
    done = subprocess.run([sys.executable, "-c", "import tomli_w; print(tomli_w.__file__)"], capture_output=True,
                          text=True, check=True)  # a child process finds it too
    assert done.stdout.startswith(str(tmp_path / "site"))


def test_the_fetch_command_takes_binary_wheels_for_the_host_and_fails_over_its_budget(tmp_path: Path) -> None:
    orjson = f"orjson=={metadata.version('orjson')}"
    done = subprocess.run([str(LAUNCHER), "--fetch-wheels", str(tmp_path), "--requirement", orjson,
                           "--budget-mib", "0.01"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1 and "over the budget of 0.0 MiB" in done.stderr, done.stderr
    (wheel,) = tmp_path.glob("*.whl")
    assert "-cp312-cp312-" in wheel.name and "manylinux" in wheel.name and "x86_64" in wheel.name
    assert f"{wheel.name}" in done.stdout and "total, 1 wheels" in done.stdout


def test_the_launcher_passes_shellcheck() -> None:
    run_command(tool("shellcheck"), "--severity=style", str(LAUNCHER))
