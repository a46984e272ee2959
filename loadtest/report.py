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
) -> dict[str, str]:
    """Write MODE.json/.md/.png into `out`; `plot(path)` draws the PNG. Returns the paths."""
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


def save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
