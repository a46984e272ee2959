"""Report files of one bench run: MODE.json (everything), MODE.md (a table to paste into an issue
or PR) and MODE.png (a plot, when matplotlib is installed).

The JSON is the record: machine, exact command line, parameters and every measured level, so
a figure can be traced back to how it was made. The markdown and the plot are views of it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Row = Sequence[Any]


def markdown_table(headers: Sequence[str], rows: Sequence[Row]) -> str:
    def cell(value: Any) -> str:
        if value is None:
            return "–"
        if isinstance(value, float):
            return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
        if isinstance(value, int):
            return f"{value:,}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_lines(machine: dict[str, Any]) -> list[str]:
    libraries = ", ".join(f"{k} {v}" for k, v in machine["libraries"].items() if v)
    gpus = machine.get("gpus")
    source = machine.get("source") or {}
    return [
        (f"- CPU: {machine['cpu_model']}, {machine['logical_cpus']} logical CPUs"
        f" (bench process allowed on {machine['cpu_affinity_of_bench']})"),
        f"- GPU: {', '.join(g['name'] for g in gpus) if gpus else 'none (nvidia-smi absent or no GPU)'}",
        f"- Python {machine['python']}; {libraries}",
        f"- wrk: {machine['wrk'] or 'not installed'}",
        f"- source: {source.get('commit')}{' (dirty tree)' if source.get('dirty') else ''}",
        f"- platform: {machine['platform']}",
    ]


def write(
    out: Path,
    mode: str,
    record: dict[str, Any],
    headers: Sequence[str],
    rows: Sequence[Row],
    summary: Sequence[str] = (),
    plot: Any = None,
    sections: Sequence[str] = (),
) -> dict[str, str]:
    """Write MODE.json/.md/.png into `out`; `plot(path)` draws the PNG; `sections` are more
    markdown (further tables, recommendations) after the table and the figure. Returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": str(out / f"{mode}.json"), "markdown": str(out / f"{mode}.md")}
    png = out / f"{mode}.png"
    plot_note = None
    if plot is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            plot(png)
            files["png"] = str(png)
        except ImportError:
            plot_note = "no plot: matplotlib is not installed"
    record = {**record, "files": files}
    parameters = record.get("parameters", {})
    text = [
        f"# bench {mode}",
        "",
        f"Command: `{record['command_line']}`",
        f"Started: {record['started']}",
        "",
        *machine_lines(record["machine"]),
        "",
        "Parameters: " + ", ".join(f"{k}={v}" for k, v in parameters.items()),
        *([f"Note: {record['note']}"] if record.get("note") else []),
        "",
        *[f"**{line}**\n" for line in summary],
        markdown_table(headers, rows),
        "",
    ]
    if "png" in files:
        text += [f"![{mode}]({png.name})", ""]
    if plot_note:
        text += [plot_note, ""]
    for section in sections:
        text += [section.rstrip(), ""]
    for note in record.get("notes", []):
        text.append(f"- {note}")
    Path(files["markdown"]).write_text("\n".join(text).rstrip() + "\n")
    Path(files["json"]).write_text(json.dumps(record, indent=2) + "\n")
    return files


def figure(title: str):
    """A fresh figure and axes, closed by the caller through `save`."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    return fig, ax


def panels(title: str, count: int):
    """A figure of `count` side-by-side axes under one title (e.g. latency vs throughput, and
    throughput vs load), closed by the caller through `save`."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, count, figsize=(5.2 * count, 4.2), dpi=110, squeeze=False)
    fig.suptitle(title, fontsize=10)
    for ax in axes[0]:
        ax.grid(True, alpha=0.3)
    return fig, list(axes[0])


def grouped_bars(ax, groups: Sequence[str], series: Sequence[tuple[str, Sequence[float]]], legend: bool = True,
                 **style: Any) -> None:
    """One bar per series in each group, side by side, coloured by series (C0, C1, ...); the
    groups named under them. `legend=False`: a layer drawn behind another, left out of the legend."""
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=label if legend else None, color=f"C{i}", **style)
    ax.set_xticks(range(len(groups)), groups)
    if legend:
        ax.legend(fontsize=8)


LATENCY_STYLES = {"p50": "o-", "p90": "s-", "p99": "^-"}


def latency_curves(ax, xs: Sequence[float], latencies: Sequence[dict[str, Any]], label: str = "",
                   keys: Sequence[str] = ("p50", "p90", "p99"), linestyle: str | None = None,
                   color: str | None = None) -> None:
    """Latency percentiles (ms) against xs (throughput or offered rate), one line per percentile
    (marker per percentile; `color`/`linestyle` tell series, e.g. two servers, apart)."""
    for key in keys:
        style = LATENCY_STYLES.get(key, "o-")
        if linestyle:
            style = style[0] + linestyle
        points = sorted((x, lat[key]) for x, lat in zip(xs, latencies) if lat and lat.get(key) is not None)
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], style, label=f"{label} {key}".strip(),
                    **({"color": color} if color else {}))
    ax.set_ylabel("latency (ms)")


def log_axis(ax, axis: str = "y", base: int = 10) -> None:
    """A log scale with plain tick labels (3, 10, 30 rather than 3x10^0)."""
    from matplotlib.ticker import FuncFormatter

    getattr(ax, f"set_{axis}scale")("log", base=base)
    target = ax.yaxis if axis == "y" else ax.xaxis
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    target.set_major_formatter(plain)
    target.set_minor_formatter(FuncFormatter(lambda value, _: ""))


def hline(ax, y: float, label: str, color: str = "tab:red") -> None:
    ax.axhline(y, color=color, linestyle=":", linewidth=1.2, label=label)


def vline(ax, x: float, label: str, color: str = "tab:green", linestyle: str = "--") -> None:
    ax.axvline(x, color=color, linestyle=linestyle, linewidth=1.2, label=label)


def save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
