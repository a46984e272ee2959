"""One PNG per build: speed against quality for every build of the same source model.

The point of quantizing is a trade, so the chart puts each precision where it lands: x is the
speedup over FP32 (engine alone, at the largest timed batch), y the gate's first metric (accuracy
relative to FP32's, mean cosine, top-1 agreement or mean relative error), with the gate's
threshold drawn as a line.
"""

from __future__ import annotations

from pathlib import Path

from server.quantize.reporting import BuildReport


def _gate_figure(report: BuildReport) -> tuple[float, str, float] | None:
    """The gate's first check for the chart: (value, axis label, threshold); accuracy is shown
    relative to FP32's."""
    checks = report.quality.get("checks") or []
    if not checks:
        return None
    check = checks[0]
    if check["metric"] == "accuracy":
        scale = max(report.quality.get("reference", {}).get("accuracy", 1.0), 1e-9)
        return check["value"] / scale, "accuracy / FP32 accuracy", check["threshold"] / scale
    return check["value"], f"{check['metric'].replace('_', ' ')} vs FP32", check["threshold"]


def _point(report: BuildReport) -> tuple[float, float] | None:
    bench = report.benchmark or {}
    rows = bench.get("buckets") or []
    ref = {r["batch"]: r for r in (bench.get("reference") or {}).get("buckets", [])}
    figure = _gate_figure(report)
    if not rows or rows[-1]["batch"] not in ref or figure is None:
        return None
    return ref[rows[-1]["batch"]]["latency_ms"] / rows[-1]["latency_ms"], figure[0]


def write_chart(reports: list[BuildReport], out: Path) -> bool:
    """Draw the builds that were timed; False (and no file) when none was."""
    points = [(r, p) for r in reports if (p := _point(r)) is not None]
    if not points:
        return False
    try:
        import matplotlib
    except ImportError:  # the chart is a convenience; the JSON and markdown reports carry the figures
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = points[0][0]
    figure_of_first = _gate_figure(first)
    assert figure_of_first is not None
    _, label, threshold = figure_of_first
    figure, axes = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    fp32 = 0.0 if "error" in label else 1.0  # FP32 against itself: no error, full agreement
    axes.scatter([1.0], [fp32], marker="*", s=160, color="black", label="FP32 source", zorder=3)
    for report, (speedup, quality) in points:
        colour = "tab:green" if report.gate_passed else "tab:red"
        axes.scatter([speedup], [quality], s=70, color=colour, zorder=3)
        axes.annotate(report.variant, (speedup, quality), textcoords="offset points",
                      xytext=(6, 4), fontsize=8)
    axes.axhline(threshold, color="tab:red", linestyle="--", linewidth=1, label="quality gate")
    batch = (first.benchmark or {}).get("buckets", [{}])[-1].get("batch")
    axes.set_xlabel(f"speedup over FP32 (engine alone, batch {batch}, 1 thread)")
    axes.set_ylabel(label)
    axes.set_title(f"{first.source.get('model')}: speed vs quality per build (green: gate passed)")
    axes.grid(alpha=0.3)
    axes.legend(loc="lower left", fontsize=8)
    figure.tight_layout()
    figure.savefig(out)
    plt.close(figure)
    return True
