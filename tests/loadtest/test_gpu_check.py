"""loadtest/gpu_check: the dry run end to end (the GPU flow on the CPU, tiny models, the real
server, a torch.compiled variant and one of two instances), its report checked figure by figure;
the budgets on a fake clock and the watchdog at the time limit; the server's compile lines; the
wheels for the GPU host, fetched from PyPI (a small list) and installed from the folder alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Self

import pytest

from loadtest import gpucheck, gpucheck_coverage, gpucheck_measure, gpucheck_wheels
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
    run_command(str(LAUNCHER), "--dry-run", "--wheels", str(wheels), "--work", str(out / "work"), str(out), timeout=1300)
    took = time.monotonic() - started
    return json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.md").read_text(), out, took


@pytest.mark.integration
def test_the_dry_run_completes_every_phase_each_with_its_budget(dry_run) -> None:  # type: ignore[no-untyped-def]
    record, markdown, out, took = dry_run
    assert record["schema"] == gpucheck.SCHEMA and record["mode"] == "dry-run"
    assert record["complete"] is True and record["partial"] == [] and record["exit_code"] == 0
    assert list(record["phases"]) == ["install", "build", "engine", "serve", "front_ends"]
    assert record["wheels"]["installed"] == [] and record["wheels"]["already_present"] == [
        f"numpy=={metadata.version('numpy')}"]
    assert record["machine"]["logical_cpus"] and record["machine"]["python"]
    for name, phase in record["phases"].items():
        assert phase["status"] == "done" and phase["took_s"] > 0, (name, phase)
        # each phase had its own budget (serve: what was left but the front ends' budget; the front
        # ends: what was left); whether a phase keeps to it is a matter of timing, which the tests
        # on a fake clock below check without a race
        if name == "serve":
            assert 0 < phase["budget_s"] <= (record["time_limit_s"] - gpucheck.REPORT_RESERVE_S
                                             - gpucheck.DRY_RUN.budgets["front_ends"]), phase
        elif name == "front_ends":
            assert gpucheck.DRY_RUN.budgets["front_ends"] <= phase["budget_s"], phase
        else:
            assert phase["budget_s"] == gpucheck.DRY_RUN.budgets[name], (name, phase)
    assert 0 < record["elapsed_s"] <= took <= record["time_limit_s"]
    assert record["device"]["device"] == "cpu" and record["device"]["torch"]
    assert record["onnx"]["status"] == "skipped" and record["onnx"]["reason"]
    assert (out / gpucheck.SERVER_LOG).read_text() and "phase serve: done" in (out / gpucheck.PROGRESS_LOG).read_text()
    assert markdown.startswith("# GPU check (dry-run): complete")
    assert record["dry_run_differences"] == list(gpucheck.DRY_RUN.differences)
    assert all(difference in markdown for difference in record["dry_run_differences"])


@pytest.mark.integration
def test_the_dry_run_lists_what_the_host_cannot_cover(dry_run) -> None:  # type: ignore[no-untyped-def]
    record, markdown = dry_run[0], dry_run[1]
    found = {item["what"]: item["why"] for item in record["not_covered"]}
    ort_cuda, tensorrt, ort_trt = (next(w for w in found if w.startswith(start)) for start in (
        "ONNX Runtime's CUDA execution provider", "TensorRT plans", "ONNX Runtime's TensorRT execution provider"))
    assert "I/O binding" in ort_cuda and "onnxruntime" in found[ort_cuda] and "tensorrt" in found[tensorrt]
    assert "onnxruntime-gpu" in found[ort_trt] and "the dry run runs on the CPU" in found.values()
    assert "## Not covered on this host" in markdown
    assert all(f"- {what}: {why}." in markdown for what, why in found.items())


def expected_variants(role: str) -> list[str]:
    """The dry run's variants of `role` in record order: each precision, its extras after it."""
    profile = gpucheck.DRY_RUN
    return [key for p in profile.precisions
            for key in (p, *(e.key for e in profile.extras if (e.role, e.precision) == (role, p)))]


def extra(role: str, kind: str) -> gpucheck_coverage.Extra:
    return next(e for e in gpucheck.DRY_RUN.extras if e.role == role and (e.compile_mode if kind == "compiled"
                                                                            else e.instances > 1))


@pytest.mark.integration
def test_the_dry_run_builds_each_model_in_each_precision(dry_run) -> None:  # type: ignore[no-untyped-def]
    record = dry_run[0]
    profile = gpucheck.DRY_RUN
    assert list(record["models"]) == list(gpucheck.ROLES)
    assert {e.role for e in profile.extras} == {"digits", "resnet"}
    for role, entry in record["models"].items():
        assert entry["about"]["parameters"] > 0 and entry["about"]["source"]
        assert list(entry["variants"]) == expected_variants(role)
        for precision, variant in entry["variants"].items():
            if role == "resnet" and precision == "int8":  # convolutions: torchao's INT8 does not apply
                assert variant["status"] == "unsupported" and "convolutions" in variant["reason"]
                continue
            assert variant["status"] == "built", (role, precision, variant)
            assert variant["name"] == f"{entry['name']}-{precision}" and variant["method"]
    assert record["models"]["bert"]["about"]["sequence"] == 16  # the tiny shapes
    compiled = record["models"]["digits"]["variants"][extra("digits", "compiled").key]
    assert (compiled["of"], compiled["compile_mode"], compiled["batch_buckets"]) == ("fp32", "default", [64])
    config = (dry_run[2] / "work" / "repository" / compiled["name"] / "config.yaml").read_text()
    assert "compile: true" in config and "batch_buckets:\n- 64" in config
    two = record["models"]["resnet"]["variants"][extra("resnet", "instances").key]
    assert (two["of"], two["instances"]) == ("fp32", 2) and "compile_mode" not in two
    assert "count: 2" in (dry_run[2] / "work" / "repository" / two["name"] / "config.yaml").read_text()


@pytest.mark.integration
def test_the_dry_run_measures_the_engine_per_bucket(dry_run) -> None:  # type: ignore[no-untyped-def]
    record = dry_run[0]
    for role, entry in record["models"].items():
        for precision, variant in entry["variants"].items():
            if variant["status"] != "built":
                continue
            engine = variant["engine"]
            assert "error" not in engine and engine["load_s"] > 0
            buckets = variant.get("batch_buckets") or gpucheck.DRY_RUN.buckets[role]
            if variant.get("instances", 1) > 1:  # the largest bucket the server may form, all instances at once
                buckets = [max(b for b in buckets if b <= gpucheck.DRY_RUN.max_batch[role])]
            assert [b["batch_size"] for b in engine["buckets"]] == buckets
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
def test_the_dry_run_compiles_every_bucket_alone_and_in_the_server(dry_run) -> None:  # type: ignore[no-untyped-def]
    record, markdown = dry_run[0], dry_run[1]
    variants = record["models"]["digits"]["variants"]
    compiled, plain = variants[extra("digits", "compiled").key], variants["fp32"]
    buckets = compiled["batch_buckets"]
    engine = compiled["engine"]
    assert [c["batch_size"] for c in engine["compile"]] == buckets and all(c["seconds"] > 0 for c in engine["compile"])
    # the same program, compiled: the same answers (a rounding may flip an argmax or two)
    assert engine["accuracy"] == pytest.approx(plain["engine"]["accuracy"], abs=0.01)
    server = compiled["server_compile"]  # read from the server's log: warm-up compiled every bucket at load
    assert [c["shape"] for c in server["compiles"]] == [f"batch {b}" for b in buckets], server
    assert set(buckets) <= set(server["warmup_batch_sizes"]) and all(c["seconds"] > 0 for c in server["compiles"])
    assert server["compile_s"] == round(sum(c["seconds"] for c in server["compiles"]), 2)
    assert server["warmup_to_ready_s"] >= 0 and "note" not in server
    assert compiled["served"]["error_count"] == 0 and compiled["served"]["items_s"] > 0
    assert "## torch.compile, per batch bucket" in markdown
    assert f"| digits | {extra('digits', 'compiled').key} | default | 64 |" in markdown


@pytest.mark.integration
def test_the_dry_run_reads_two_instances_against_one(dry_run) -> None:  # type: ignore[no-untyped-def]
    record, markdown = dry_run[0], dry_run[1]
    variants = record["models"]["resnet"]["variants"]
    two, one = variants[extra("resnet", "instances").key], variants["fp32"]
    engine = two["engine"]
    (together,) = engine["buckets"]
    assert engine["instances"] == together["instances"] == 2 and engine["one_instance"]["batch_size"] == 8
    assert together["items_s"] == pytest.approx(8 * together["runs"] / together["elapsed_s"], rel=0.01)
    assert engine["speedup"] == round(together["items_s"] / engine["one_instance"]["items_s"], 3)
    against = two["served"]["against_one_instance"]
    assert against == {"instances": 2, "one_instance_items_s": one["served"]["items_s"],
                       "speedup": round(two["served"]["items_s"] / one["served"]["items_s"], 3)}
    assert "## Instances on one device" in markdown and f"| resnet-tiny | {two['name'].split('-', 2)[-1]} | 2 | 8 |" in markdown


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
def test_the_dry_run_serves_digits_with_one_then_two_front_ends(dry_run) -> None:  # type: ignore[no-untyped-def]
    record, markdown, out = dry_run[0], dry_run[1], dry_run[2]
    profile = gpucheck.DRY_RUN
    [curve] = record["front_ends"]
    assert curve["curve"] == "digits:fp32:json" and curve["model"] == record["models"]["digits"]["variants"]["fp32"]["name"]
    assert (curve["concurrency"], curve["client_processes"]) == (profile.front_end_concurrency, profile.front_end_clients)
    assert [r["http_workers"] for r in curve["runs"]] == list(profile.front_ends) == [1, 2]
    one, two = curve["runs"]
    for served in (one, two):
        assert served["error_count"] == 0, served["first_error"]
        assert served["requests"] > 0 and served["validated_replies"] >= profile.front_end_concurrency
        assert served["items_per_request"] == profile.items_per_request["digits"]
        assert served["server"]["items"] >= served["requests"] * served["items_per_request"]
        assert 0 < served["latency_ms"]["p50"] <= served["latency_ms"]["p99"] and served["startup_s"] > 0
    assert one["against_one"] == 1.0 and two["against_one"] == round(two["req_s"] / one["req_s"], 3)
    assert "2 HTTP front-end processes share port" in (out / "server-front-ends-2.log").read_text()
    assert "HTTP front-end processes share port" not in (out / "server-front-ends-1.log").read_text()
    assert "## HTTP front-end processes" in markdown
    line = markdown_table(("front ends", "req/s", "items/s", "against one", "p50 ms", "p99 ms", "mean batch",
                           "merge ms", "run ms", "errors", "start s", "note"),
                          [(2, two["req_s"], two["items_s"], two["against_one"], two["latency_ms"]["p50"],
                            two["latency_ms"]["p99"], two["server"]["mean_batch"],
                            two["server"]["compute_input_ms_per_batch"], two["server"]["compute_infer_ms_per_batch"],
                            0, two["startup_s"], None)])
    assert line.splitlines()[-1] in markdown


def test_a_json_request_carries_its_numbers_and_asks_for_a_binary_reply() -> None:
    import numpy as np

    request = gpucheck_measure.json_request("digits-fp32", {"x": np.arange(6, dtype=np.float32).reshape(2, 3)},
                                            {"x": "FP32"}, "logits")
    document = json.loads(request.body)
    assert document["inputs"] == [{"name": "x", "shape": [2, 3], "datatype": "FP32", "data": [0, 1, 2, 3, 4, 5]}]
    assert document["outputs"] == [{"name": "logits", "parameters": {"binary_data": True}}]
    assert (request.items, request.binary, request.path) == (2, False, "/v2/models/digits-fp32/infer")
    assert request.headers == {"Content-Type": "application/json"}


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


# ---- budgets, on a fake clock --------------------------------------------------------------------
class FakeClock:
    """time.monotonic that moves only when told to."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_phase_gets_its_budget_and_is_marked_when_it_runs_past_it(tmp_path: Path) -> None:
    clock = FakeClock()
    run = gpucheck.Run(tmp_path, gpucheck.DRY_RUN, 100.0, ["--dry-run", "out"], clock=clock)
    assert run.left() == 90.0  # the reserve for the last report: a tenth of a short limit
    with run.phase("build", 30) as deadline:
        assert deadline == 1030.0
        clock.now += 30 + gpucheck.OVER_BUDGET_GRACE_S  # at the end of its grace: not over
    with run.phase("engine", 20) as deadline:
        assert deadline == 1051.0
        clock.now += 35  # one step (a compile, a load) longer than the time it had left
    with run.phase("serve", None) as deadline:  # what is left, and no more even with a larger budget
        assert deadline == run.deadline == 1090.0
    with run.phase("late", 60) as deadline:
        assert deadline == 1090.0
    phases = run.record["phases"]
    assert "over_budget_s" not in phases["build"] and phases["build"]["took_s"] == 31.0
    assert phases["engine"] == {"budget_s": 20, "status": "done", "took_s": 35.0, "over_budget_s": 15.0}
    assert (phases["serve"]["budget_s"], phases["late"]["budget_s"]) == (24.0, 24.0)
    assert run.record["partial"] == []  # over its budget is not cut short: the report says which it was
    markdown = (tmp_path / gpucheck.MARKDOWN_FILE).read_text()
    assert "| engine | 20 | 35.0 | 15.0 | done | – |" in markdown
    assert "phase engine: OVER its budget of 20 s by 15.0 s" in (tmp_path / gpucheck.PROGRESS_LOG).read_text()


def test_serve_keeps_back_the_front_end_curves_budget_but_never_goes_under_its_floor() -> None:
    profile = gpucheck.GPU
    reserve, floor = profile.budgets["front_ends"], profile.budgets["serve_floor"]
    assert gpucheck.serve_budget(400.0, profile) == 400.0 - reserve  # room for both
    assert gpucheck.serve_budget(floor + reserve / 2, profile) == floor  # the curve gets what is over the floor
    assert gpucheck.serve_budget(floor - 10, profile) == floor - 10  # under the floor: all of it, none kept back
    assert profile.front_ends[:2] == (1, 8), "one process first, then the far end: a curve cut short spans the range"


def test_a_front_end_count_that_cannot_start_is_recorded_and_one_with_no_time_left_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1 is measured; 2 fails to start, taking most of what is left; 4 has no time for a start:
    each is recorded with its reason, and the phase itself does not fail."""
    import contextlib
    import dataclasses
    import types

    import numpy as np

    from loadtest import gpucheck_frontends, localserver

    clock = FakeClock()
    profile = dataclasses.replace(gpucheck.DRY_RUN, front_ends=(1, 2, 4))
    run = gpucheck.Run(tmp_path, profile, 100.0, ["--dry-run", "out"], clock=clock)
    run.record["models"]["digits"] = {"name": "digits", "variants": {"fp32": {"name": "digits-fp32", "status": "built"}}}
    model = types.SimpleNamespace(inputs=[{"name": "x", "datatype": "FP32"}], output={"name": "logits"}, width=10,
                                  samples=lambda items, offset=0: {"x": np.zeros((items, 64), np.float32)})
    started: list[list[str]] = []

    @contextlib.contextmanager
    def server(repository: Path, *flags: str, **options: Any) -> Any:
        started.append(list(flags))
        if flags[flags.index("--http-workers") + 1] == "2":
            clock.now += 18
            raise RuntimeError("the server did not answer in time")
        yield "http://127.0.0.1:1"

    class FakeClients:
        def __init__(self, processes: int) -> None:
            self.processes = processes

        def __enter__(self) -> Self:
            return self

        def __exit__(self, *_: object) -> None:
            pass

        def closed_loop(self, url: str, requests: list[Any], *args: Any) -> dict[str, Any]:
            assert json.loads(requests[0].body)["inputs"][0]["shape"] == [profile.items_per_request["digits"], 64]
            clock.now += 8
            return {"req_s": 100.0, "items_s": 400.0, "latency_ms": {"p50": 1.0, "p99": 2.0}, "error_count": 0}

    monkeypatch.setattr(localserver, "running_server", server)
    monkeypatch.setattr(gpucheck_measure, "Clients", FakeClients)
    monkeypatch.setattr(gpucheck_measure, "wait_for_models", lambda url, names, *_: {n: "READY" for n in names})
    monkeypatch.setattr(gpucheck_measure, "model_stats", lambda url, name: None)
    gpucheck_frontends.front_ends_phase(run, {"models": {"digits": model}, "repository": tmp_path},
                                        deadline=clock.now + 30)
    [curve] = run.record["front_ends"]
    one, two, four = curve["runs"]
    assert (one["http_workers"], one["req_s"], one["against_one"], one["startup_s"]) == (1, 100.0, 1.0, 0.0)
    assert two == {"http_workers": 2, "error": "RuntimeError: the server did not answer in time"}
    assert four == {"http_workers": 4, "skipped": "the phase ran out of time"}
    assert [flags[flags.index("--http-workers") + 1] for flags in started] == ["1", "2"]
    assert run.record["partial"] == [
        "front ends: digits-fp32 2 not measured: RuntimeError: the server did not answer in time",
        "front ends: digits-fp32 4 not measured, the phase ran out of time"]
    markdown = (tmp_path / gpucheck.MARKDOWN_FILE).read_text()
    assert "| 2 | – | – | – | – | – | – | – | – | – | – | RuntimeError: the server did not answer in time |" in markdown


def test_a_second_curve_serves_its_model_with_binary_tensors_and_one_not_built_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Curves run in turn, each count read against its own curve's single process, each count's
    server log named by its model; a curve whose variant was not built is skipped with the reason."""
    import contextlib
    import dataclasses
    import types

    import numpy as np

    from loadtest import gpucheck_frontends, localserver
    from loadtest.gpucheck_frontends import Curve

    clock = FakeClock()
    curves = (Curve("digits", "fp32"), Curve("bert", "fp16", "binary"), Curve("resnet", "fp16", "binary"))
    profile = dataclasses.replace(gpucheck.DRY_RUN, front_ends=(1, 2), front_end_curves=curves)
    run = gpucheck.Run(tmp_path, profile, 100.0, ["--dry-run", "out"], clock=clock)
    run.record["models"]["digits"] = {"name": "digits", "variants": {"fp32": {"name": "digits-fp32", "status": "built"}}}
    run.record["models"]["bert"] = {"name": "bert", "variants": {"fp16": {"name": "bert-fp16", "status": "built"}}}
    model = types.SimpleNamespace(inputs=[{"name": "x", "datatype": "FP32"}], output={"name": "y"}, width=4,
                                  samples=lambda items, offset=0: {"x": np.zeros((items, 8), np.float32)})
    logs: list[str] = []
    seen: list[tuple[str, bool, str | None]] = []
    rates = iter([100.0, 150.0, 50.0, 200.0])

    @contextlib.contextmanager
    def server(repository: Path, *flags: str, log_path: Path, **options: Any) -> Any:
        logs.append(log_path.name)
        yield "http://127.0.0.1:1"

    class FakeClients:
        def __init__(self, processes: int) -> None:
            pass

        def __enter__(self) -> Self:
            return self

        def __exit__(self, *_: object) -> None:
            pass

        def closed_loop(self, url: str, requests: list[Any], *args: Any) -> dict[str, Any]:
            # what each load was, and the curve the record held as it ran (the phase catches errors)
            seen.append((requests[0].path, requests[0].binary, run.record["front_ends"][-1].get("model")))
            clock.now += 5
            return {"req_s": next(rates), "items_s": 1.0, "latency_ms": {"p50": 1.0, "p99": 2.0}, "error_count": 0}

    monkeypatch.setattr(localserver, "running_server", server)
    monkeypatch.setattr(gpucheck_measure, "Clients", FakeClients)
    monkeypatch.setattr(gpucheck_measure, "wait_for_models", lambda url, names, *_: {n: "READY" for n in names})
    monkeypatch.setattr(gpucheck_measure, "model_stats", lambda url, name: None)
    gpucheck_frontends.front_ends_phase(run, {"models": {"digits": model, "bert": model}, "repository": tmp_path},
                                        deadline=clock.now + 90)
    # digits' requests in JSON, bert's in binary; the curve under way is in the record already, so a
    # report written during it holds its counts
    assert seen == [("/v2/models/digits-fp32/infer", False, "digits-fp32")] * 2 + [
        ("/v2/models/bert-fp16/infer", True, "bert-fp16")] * 2
    digits, bert, resnet = run.record["front_ends"]
    assert [r["against_one"] for r in digits["runs"]] == [1.0, 1.5]
    assert [r["against_one"] for r in bert["runs"]] == [1.0, 4.0]
    assert (bert["curve"], bert["request"]) == ("bert:fp16:binary", "binary tensors both ways")
    assert resnet == {"curve": "resnet:fp16:binary", "skipped": "the resnet fp16 variant was not built"}
    assert logs == ["server-front-ends-1.log", "server-front-ends-2.log",
                    "server-bert-fp16-front-ends-1.log", "server-bert-fp16-front-ends-2.log"]
    markdown = (tmp_path / gpucheck.MARKDOWN_FILE).read_text()
    assert "bert-fp16 served with `--http-workers N`" in markdown
    assert "resnet:fp16:binary: not measured, the resnet fp16 variant was not built." in markdown


def test_the_command_line_runs_the_curves_alone_building_only_what_they_serve() -> None:
    from loadtest.gpucheck_frontends import Curve

    args = gpucheck.parser().parse_args(["--phases", "front_ends", "--curve", "bert:fp16:binary",
                                         "--curve", "resnet:bf16:binary", "--front-ends", "1,2,4", "out"])
    profile = gpucheck.chosen(gpucheck.GPU, args)
    assert profile.phases == ("front_ends",) and profile.front_ends == (1, 2, 4)
    assert profile.front_end_curves == (Curve("bert", "fp16", "binary"), Curve("resnet", "bf16", "binary"))
    assert (profile.roles, profile.only, profile.extras) == (("resnet", "bert"), (("bert", "fp16"), ("resnet", "bf16")), ())
    assert profile.builds("bert", "fp16") and not profile.builds("bert", "bf16") and not profile.builds("resnet", "fp16")
    # with the serve phase, everything is built as before; the default curve is digits' JSON one
    profile = gpucheck.chosen(gpucheck.GPU, gpucheck.parser().parse_args(["--phases", "serve,front_ends", "out"]))
    assert (profile.roles, profile.only, profile.extras) == (gpucheck.ROLES, None, gpucheck.GPU.extras)
    assert all(profile.builds(r, p) for r in gpucheck.ROLES for p in profile.precisions)
    assert profile.front_end_curves == (Curve("digits", "fp32", "json"),)
    for wrong in (["--phases", "serve,warp"], ["--curve", "gpt:fp16"], ["--curve", "bert:fp16:xml"],
                  ["--front-ends", "1,0"], ["--front-ends", "two"]):
        with pytest.raises(SystemExit):
            gpucheck.parser().parse_args([*wrong, "out"])


def test_the_servers_batch_times_are_read_per_batch_not_per_request() -> None:
    """A request's compute figures carry its batch's whole time (Triton's counting), so summed over
    requests they count a batch once per request: a batch's time comes from the per-size figures."""
    stage_ms = {"compute_input": 2, "compute_infer": 20, "compute_output": 1}

    def stats(batches: int, requests: int, queue_ns: int) -> dict[str, Any]:
        per_request = {s: {"count": requests, "ns": ms * 1_000_000 * requests} for s, ms in stage_ms.items()}
        return {"execution_count": batches, "inference_count": requests,
                "inference_stats": {"queue": {"count": requests, "ns": queue_ns}, **per_request},
                "batch_stats": [{"batch_size": requests // batches,
                                 **{s: {"count": batches, "ns": ms * 1_000_000 * batches} for s, ms in stage_ms.items()}}]}

    before, after = stats(10, 640, 640 * 3_000_000), stats(30, 1920, 1920 * 3_000_000)
    delta = gpucheck_measure.stats_delta(before, after)
    assert delta == {"batches": 20, "items": 1280, "mean_batch": 64.0, "queue_ms_per_request": 3.0,
                     "compute_input_ms_per_batch": 2.0, "compute_infer_ms_per_batch": 20.0,
                     "compute_output_ms_per_batch": 1.0}
    assert gpucheck_measure.stats_delta(None, after) is None


@pytest.mark.integration
def test_the_dry_run_of_one_binary_curve_alone_builds_and_serves_only_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_command(str(LAUNCHER), "--dry-run", "--phases", "front_ends", "--curve", "digits:fp32:binary",
                "--front-ends", "1", str(out), timeout=600)
    record = json.loads((out / "gpu_check.json").read_text())
    assert record["complete"], record["partial"]
    assert list(record["phases"]) == ["build", "front_ends"] and list(record["models"]) == ["digits"]
    assert list(record["models"]["digits"]["variants"]) == ["fp32"]
    [curve] = record["front_ends"]
    [one] = curve["runs"]
    assert (curve["curve"], one["http_workers"], one["error_count"]) == ("digits:fp32:binary", 1, 0)
    assert one["server"]["compute_infer_ms_per_batch"] > 0 and one["requests"] > 0
    markdown = (out / "gpu_check.md").read_text()
    assert "## HTTP front-end processes" in markdown and "## Engine alone and served" not in markdown
    assert "| build |" in markdown and "| front_ends |" in markdown


def test_the_engine_phase_measures_nothing_past_its_deadline(tmp_path: Path) -> None:
    import torch

    clock = FakeClock()
    run = gpucheck.Run(tmp_path, gpucheck.DRY_RUN, 100.0, ["--dry-run", "out"], clock=clock)
    run.record["models"]["digits"] = {"name": "digits", "variants": {
        "fp32": {"name": "digits-fp32", "status": "built"}, "int8": {"status": "unsupported", "reason": "-"}}}
    context = {"models": {"digits": object()}, "repository": tmp_path / "none", "device": torch.device("cpu")}
    gpucheck.engine_phase(run, context, deadline=clock.now - 1)  # no engine is even loaded
    assert run.record["models"]["digits"]["variants"]["fp32"]["engine"] == {"skipped": "the engine phase ran out of time"}
    assert run.record["partial"] == ["digits-fp32: engine alone not measured, the phase ran out of time"]


def test_the_engine_alone_skips_the_buckets_and_compiles_that_would_end_past_the_deadline() -> None:
    clock, ran = FakeClock(), []

    def run_batch(inputs: dict) -> None:
        ran.append(len(inputs["x"]))

    def batches(size: int) -> list[dict]:
        return [{"x": [0] * size}]

    results, skipped = gpucheck_measure.engine_buckets(run_batch, batches, [1, 8], 0.01, clock.now + 0.005,
                                                       lambda: None, clock)
    assert (results, skipped, ran) == ([], [1, 8], [])
    results, skipped = gpucheck_measure.engine_buckets(run_batch, batches, [1, 8], 0.01, clock.now + 1,
                                                       lambda: None, clock)
    assert [r["batch_size"] for r in results] == [1, 8] and skipped == [] and set(ran) == {1, 8}
    assert gpucheck_measure.first_runs(run_batch, batches, [1, 8], clock.now - 1, lambda: None, clock) == []
    timed = gpucheck_measure.first_runs(run_batch, batches, [1, 8], clock.now, lambda: None, clock)
    assert [t["batch_size"] for t in timed] == [1, 8]


def test_instances_at_once_run_each_on_a_thread_of_its_own() -> None:
    import threading

    seen: dict[int, set[str]] = {0: set(), 1: set()}

    def runner(index: int):  # type: ignore[no-untyped-def]
        def run_batch(inputs: dict) -> None:
            seen[index].add(threading.current_thread().name)
            time.sleep(0.001)
        return run_batch

    result = gpucheck_measure.engines_at_once([runner(0), runner(1)], [{"x": None}], 4, 0.05)
    assert result["instances"] == 2 and result["runs"] >= 10 and result["batch_size"] == 4
    assert result["items_s"] == pytest.approx(4 * result["runs"] / result["elapsed_s"], rel=0.01)
    assert len(seen[0]) == len(seen[1]) == 1 and seen[0] != seen[1]


# ---- the server's log, and what the host cannot cover ---------------------------------------------
SERVER_LOG = """\
2026-01-02 10:00:00,000 INFO server.model: model digits-fp32-compiled/1: warm-up at batch sizes [1, 64, 256]: every bucket
2026-01-02 10:00:01,500 INFO server.engines.torch: compiled digits-fp32-compiled batch 1 in 1.25 s
2026-01-02 10:00:01,600 INFO server.engines.torch: compiled digits-fp32 batch 1 in 9.00 s
2026-01-02 10:00:03,000 INFO server.engines.torch: compiled digits-fp32-compiled batch 64 in 1.40 s
2026-01-02 10:00:03,100 INFO server.engines.torch: recorded the CUDA graph of digits-fp32-compiled batch 64 for thread t-0 in 0.02 s
2026-01-02 10:00:04,000 INFO server.engines.torch: compiled digits-fp32-compiled batch 256 in 0.75 s
2026-01-02 10:00:04,250 INFO server.model: model digits-fp32-compiled/1 ready: instance digits-fp32-compiled-1-0 engine=torch
"""


def test_the_compile_lines_of_the_servers_log_are_read_per_model() -> None:
    found = gpucheck_coverage.server_compiles(SERVER_LOG, "digits-fp32-compiled")
    assert found == {
        "compiles": [{"shape": "batch 1", "seconds": 1.25}, {"shape": "batch 64", "seconds": 1.4},
                     {"shape": "batch 256", "seconds": 0.75}],
        "compile_s": 3.4, "warmup_batch_sizes": [1, 64, 256], "warmup_to_ready_s": 4.25,
        "graphs_recorded_again": [{"shape": "batch 64", "seconds": 0.02}],
    }
    missing = gpucheck_coverage.server_compiles(SERVER_LOG, "bert-base-fp32")
    assert missing["compiles"] == [] and missing["warmup_to_ready_s"] is None and "no `compiled" in missing["note"]


def test_without_a_compiler_the_compiled_variant_is_unsupported_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    assert "Triton" in gpucheck_coverage.compiler_problem("cuda") and "C++" in gpucheck_coverage.compiler_problem("cpu")
    monkeypatch.setenv("CC", "/opt/cc")
    assert gpucheck_coverage.compiler_problem("cuda") is None


def test_what_a_gpu_host_cannot_cover_follows_its_stack() -> None:
    cpu_build = {i["what"].split(" (")[0].split(",")[0]: i["why"] for i in gpucheck_coverage.not_covered(
        "gpu", ["CPUExecutionProvider"])}
    assert "too big to carry" in cpu_build["ONNX Runtime's CUDA execution provider"]
    assert "onnxruntime-gpu" in cpu_build["ONNX Runtime's TensorRT execution provider"]
    assert not any(w.startswith("anything on a GPU") for w in cpu_build)  # the GPU run does run on one
    gpu_build = gpucheck_coverage.not_covered("gpu", ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert "builds torch.export programs only" in gpu_build[0]["why"]


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
