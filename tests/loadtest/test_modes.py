"""Smoke tests of the bench modes compare, batchsize, precision and builds, and of the suite's report:
seconds each, against fake servers of known speed (loadtest/fakeserver.py) or the real digits
server. They check the tools and their reports, not the servers' speed."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from loadtest import fakeserver, suite, variants
from tests.integration.conftest import MODELS
from tests.loadtest.conftest import assert_figure, bench

needs_wrk = pytest.mark.usefixtures("wrk")  # fails, never skips, without it


@needs_wrk
def test_compare_two_servers_side_by_side(tmp_path: Path) -> None:
    """A fake server at 1 ms per request against one at 5 ms: B must come out slower. The slow
    one completes at most 1 s / 5 ms + 1 = 201 requests in its 1 s level, whatever the machine;
    the fast one, with 8 connections, min(1000, 8 / (1 ms + o)) per second, o the round trip
    the machine adds: the peaks' ratio stays under 0.8 unless o exceeds 30 ms."""
    with fakeserver.running(1.0) as fast, fakeserver.running(5.0) as slow:
        bench("compare", "--url-a", fast, "--url-b", slow, "--label-a", "fast", "--label-b", "slow",
              "--name-b", "digits-elsewhere", "--concurrency", "1,8", "--duration", "1", "--warmup", "0",
              "--rates", "50", "--out", str(tmp_path))
    record = json.loads((tmp_path / "compare.json").read_text())
    fast_side, slow_side = record["results"]["fast"], record["results"]["slow"]
    assert slow_side["model_name"] == "digits-elsewhere" and slow_side["server"]["name"] == "fakeserver"
    assert [level["concurrency"] for level in fast_side["closed"]] == [1, 8]
    for side in (fast_side, slow_side):
        assert all(level["error_count"] == 0 and level["requests"] > 0 for level in side["closed"])
        assert side["open"][0]["ok"] > 0 and side["open"][0]["error_count"] == 0
    assert record["headline"]["ratio_b_over_a"] < 0.8
    markdown = assert_figure(tmp_path, "compare")
    assert "slow/fast" in markdown and "## Open loop" in markdown


@needs_wrk
@pytest.mark.integration
def test_batchsize_sweep_reads_the_busy_share(digits_url: str, tmp_path: Path) -> None:
    bench("batchsize", "--url", digits_url, "--sizes", "1,8", "--duration", "1", "--warmup", "0", "--out", str(tmp_path))
    record = json.loads((tmp_path / "batchsize.json").read_text())
    levels = record["results"]
    assert [level["items"] for level in levels] == [1, 8]
    for level in levels:
        assert level["error_count"] == 0 and level["items_s"] == pytest.approx(level["req_s"] * level["items"], rel=0.01)
        assert 0 < level["signals"]["busy_fraction"] <= 1.0
        assert level["signals"]["stats"]["items_per_execution"] >= level["items"]
    assert record["headline"]["busy_share_source"] == "/metrics"
    assert "items/request" in assert_figure(tmp_path, "batchsize")


@needs_wrk
def test_batchsize_without_metrics_says_na(tmp_path: Path) -> None:
    with fakeserver.running(1.0, metrics=False) as url:
        bench("batchsize", "--url", url, "--sizes", "1,4", "--duration", "1", "--warmup", "0", "--out", str(tmp_path))
    markdown = assert_figure(tmp_path, "batchsize")
    assert "| n/a |" in markdown and "busy share n/a" in markdown


def _repository(root: Path, variant_names: list[str]) -> Path:
    """digits (its built version shared by symlink) plus hand-made variants of it."""
    root.mkdir()
    base = yaml.safe_load((MODELS / "digits/config.yaml").read_text())
    (root / "digits").mkdir()
    (root / "digits/config.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
    (root / "digits/1").symlink_to(MODELS / "digits/1", target_is_directory=True)
    for name in variant_names:
        engine, precision = name.split("-")[1:3]
        config = base | {"name": name, "engine": engine, "precision": precision,
                         "build": {"source": "digits", "engine": engine, "precision": precision}}
        (root / name).mkdir()
        (root / name / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        if engine == "torch":  # built: a version folder (the FP32 artifact under another name)
            (root / name / "2").symlink_to(MODELS / "digits/1", target_is_directory=True)
    (root / "unrelated").mkdir()
    (root / "unrelated/config.yaml").write_text("name: unrelated\nengine: torch\n")
    return root


@needs_wrk
def test_precision_sweep_over_hand_made_variants(tmp_path: Path) -> None:
    repository = _repository(tmp_path / "models", ["digits-torch-fp32", "digits-onnxruntime-int8"])
    found = variants.find(repository, "digits")
    assert [(v.name, v.built) for v in found] == [
        ("digits", True), ("digits-onnxruntime-int8", False), ("digits-torch-fp32", True)]
    out = tmp_path / "out"
    with fakeserver.running(0.5) as url:  # serves any model name: the closed loop runs per variant
        bench("precision", "--model", "digits", "--model-repository", str(repository), "--batch-sizes", "1,8",
              "--engine-duration", "0.2", "--rounds", "2", "--url", url, "--concurrency", "1", "--duration", "1", "--warmup", "0",
              "--out", str(out))
    record = json.loads((out / "precision.json").read_text())
    by_name = {entry["name"]: entry for entry in record["results"]}
    assert by_name["digits"]["engine_ceiling_items_s"] > 0 and by_name["digits-torch-fp32"]["engine_ceiling_items_s"] > 0
    assert "version folder" in by_name["digits-onnxruntime-int8"]["skipped"]
    assert by_name["digits-torch-fp32"]["closed"][0]["requests"] > 0
    assert by_name["digits-torch-fp32"]["build"]["source"] == "digits" and len(by_name["digits"]["rounds"]) == 2
    markdown = assert_figure(out, "precision")
    assert "digits-torch-fp32" in markdown and "vs fp32" in markdown and "skipped" in markdown


def test_precision_without_variants_reports_fp32_alone(tmp_path: Path) -> None:
    repository = _repository(tmp_path / "models", [])
    bench("precision", "--model", "digits", "--model-repository", str(repository), "--batch-sizes", "1",
          "--engine-duration", "0.1", "--out", str(tmp_path / "out"))
    record = json.loads((tmp_path / "out/precision.json").read_text())
    assert [entry["name"] for entry in record["results"]] == ["digits"]
    assert "FP32 alone" in assert_figure(tmp_path / "out", "precision")


def test_suite_report_plots_served_against_the_engine_ceiling(tmp_path: Path) -> None:
    def levels(scale: float) -> list[dict]:
        return [{"concurrency": c, "req_s": scale * c, "items_s": scale * c,
                 "latency_ms": {"p50": 1.0, "p99": 2.0}} for c in (1, 8)]

    results = {model: {"engine": {"engine_ceiling_items_s": 1000.0, "best_batch_size": 8},
                       "on": {"levels": levels(100), "executions": 10, "inferences": 40, "dispatch_reasons": {},
                              "batch_cap": 16},
                       "off": {"levels": levels(50)}} for model in ("digits", "minilm")}
    args = argparse.Namespace(argv=["python", "-m", "loadtest.suite"], concurrency=[1, 8])
    suite.write_report(tmp_path, results, args)
    markdown = assert_figure(tmp_path, "suite")
    assert "## minilm" in markdown and json.loads((tmp_path / "suite.json").read_text())["machine"]["cpu_model"]


def test_every_mode_has_help_and_keeps_its_own_defaults() -> None:
    """Modes share option groups (argparse parents): one mode's defaults must not leak into another's."""
    from loadtest import bench

    parser = bench.build_parser()
    for mode in bench.MODES:
        extra = {"compare": ["--url-a", "a", "--url-b", "b"], "batching": ["--url-on", "a", "--url-off", "b"]}
        args = parser.parse_args([mode, "--out", "x", *extra.get(mode, [])])
        assert args.mode == mode
        if mode in ("closed", "batching", "compare", "precision"):
            assert args.concurrency == [1, 8, 32, 64], mode
    assert parser.parse_args(["batchsize", "--out", "x"]).concurrency == [1]
    choices = next(a for a in parser._actions if a.dest == "mode").choices
    for mode, sub in choices.items():
        assert sub.format_help().strip(), mode


def test_builds_tabulates_the_gate_and_the_speed(tmp_path: Path) -> None:
    """Two of the CPU list's builds (all of it takes a minute or more)."""
    out = tmp_path / "out"
    before = sorted(MODELS.iterdir())
    bench("builds", "--model", "digits", "--model-repository", str(MODELS), "--only",
          "onnxruntime-int8,torch-bf16", "--batch-sizes", "1,8", "--bench-seconds", "0.05", "--out", str(out))
    record = json.loads((out / "builds.json").read_text())
    assert record["parameters"]["builds"] == ["onnxruntime-int8", "torch-bf16"]
    reports = {entry["name"]: entry["report"] for entry in record["results"]}
    assert reports["digits-onnxruntime-int8"]["quality"]["passed"]
    assert [b["batch"] for b in reports["digits-torch-bf16"]["benchmark"]["buckets"]] == [1, 8]
    markdown = assert_figure(out, "builds")
    assert "| digits-onnxruntime-int8 | pass |" in markdown and "speedup @8" in markdown
    assert sorted(MODELS.iterdir()) == before  # the real repository is never written


def test_builds_lists_what_cannot_be_built_and_refuses_unknown_names(tmp_path: Path) -> None:
    bench("builds", "--model", "minilm", "--only", "torch-bf16", "--out", str(tmp_path / "out"))
    record = json.loads((tmp_path / "out/builds.json").read_text())
    assert "starts from a torch model" in record["results"][0]["refused"]
    assert any("not built" in note for note in record["notes"])
    done = subprocess.run([sys.executable, "-m", "loadtest.bench", "builds", "--only", "tensorrt-fp8", "--out",
                           str(tmp_path / "x")], capture_output=True, text=True, check=False)
    assert done.returncode != 0 and "not in the cpu list" in done.stderr
