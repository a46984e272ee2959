"""A build's speed against FP32, read from its report one way (tests/loadtest/test_builds_table.py:
the benchmarks' table reads the same)."""

from __future__ import annotations

from server.quantize.reporting import BuildReport


def _report(**benchmark: object) -> BuildReport:
    return BuildReport(
        variant="m-onnxruntime-int8", source={"model": "m"}, engine="onnxruntime", precision="int8", options={},
        cache_key="k", quality={"passed": True, "metrics": {"accuracy": 0.9}},
        artifact={"file": "model.onnx", "size_bytes": 2_500_000}, benchmark=dict(benchmark) or None,
    )


def _buckets(*latencies: tuple[int, float]) -> dict[str, object]:
    return {"buckets": [{"batch": b, "latency_ms": ms, "throughput": b / ms * 1e3} for b, ms in latencies]}


def test_speedup_is_fp32s_latency_over_the_builds_at_each_batch_timed_by_both() -> None:
    report = _report(**_buckets((1, 2.0), (8, 4.0), (32, 10.0)),
                     reference=_buckets((1, 3.0), (8, 10.0)), fp32_same_engine=_buckets((1, 2.5)))
    assert report.speedups() == {1: 1.5, 8: 2.5}
    assert report.speedups("fp32_same_engine") == {1: 1.25}
    assert _report().speedups() == {}
    markdown = report.markdown()
    assert "| 1.50x |" in markdown and "| 2.50x |" in markdown and "| 1.25x |" in markdown

