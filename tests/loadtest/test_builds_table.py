"""`bench builds` reads each build's figures from its report, as `batchline build --report` does."""

from __future__ import annotations

from loadtest.builds import table_row
from tests.unit.quantize.test_report_speedups import _buckets, _report


def test_the_benchmarks_table_reads_the_same_speedups() -> None:
    report = _report(**_buckets((1, 2.0), (8, 4.0)), reference=_buckets((1, 3.0), (8, 10.0)))
    row = table_row({"name": report.variant, "report": report.to_dict()}, ["accuracy"], [1, 8, 32])
    assert row == ["m-onnxruntime-int8", "pass", 0.9, 2.5, 1.5, 2.5, None, None]
