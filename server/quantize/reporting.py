"""The build report: what was built, how well it keeps FP32's quality, how fast it runs.

One `BuildReport` is written per build as `build.json` (the machine-readable record, also the
cache entry), `build.md` (a table for people) and `build.png` (speed vs quality of every build
of the same source). `report()` reprints the newest one for `batchline build --report`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.layout import is_version_folder

REPORT_FILE = "build.json"
MARKDOWN_FILE = "build.md"
CHART_FILE = "build.png"
REJECTED_DIR = "rejected"


@dataclass
class BuildReport:
    """Everything known about one build; `servable` says whether its version may serve."""

    variant: str
    source: dict[str, Any]
    engine: str
    precision: str
    options: dict[str, Any]
    cache_key: str
    device: str = "cpu"  # where it was evaluated and timed
    method: str = ""
    notes: list[str] = field(default_factory=list)
    version: int | None = None
    location: str = ""
    servable: bool = False
    cache_hit: bool = False
    library_versions: dict[str, str] = field(default_factory=dict)
    artifact: dict[str, Any] = field(default_factory=dict)
    quality: dict[str, Any] = field(default_factory=dict)
    benchmark: dict[str, Any] | None = None
    built_at: str = ""
    build_seconds: float = 0.0
    build_peak_rss_mb: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False, ensure_ascii=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BuildReport:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def load(cls, path: Path) -> BuildReport:
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))

    @property
    def gate_passed(self) -> bool:
        return bool(self.quality.get("passed"))

    def speedups(self, against: str = "reference") -> dict[int, float]:
        """FP32's mean latency over the build's, per batch size timed in the same run: against
        the FP32 source (`reference`) or the FP32 export in the build's own engine
        (`fp32_same_engine`). Empty without timing."""
        bench = self.benchmark or {}
        fp32 = {b["batch"]: b["latency_ms"] for b in (bench.get(against) or {}).get("buckets", [])}
        return {b["batch"]: fp32[b["batch"]] / b["latency_ms"] for b in bench.get("buckets", []) if b["batch"] in fp32}

    def summary(self) -> str:
        """One line: what happened to this build."""
        where = f"version {self.version}" if self.version is not None else f"not published ({self.location})"
        verdict = "gate passed" if self.gate_passed else "GATE FAILED"
        hit = "cache hit, " if self.cache_hit else ""
        return f"{self.variant}: {hit}{verdict}, {where}"

    def markdown(self) -> str:
        """The report as markdown: header, quality table, speed table, notes."""
        src = self.source
        lines = [
            f"# Build {self.variant}" + (f" version {self.version}" if self.version is not None else ""),
            "",
            f"- {self.summary()}",
            (f"- built for the {self.device.upper()}; source: `{src.get('model')}` version {src.get('version')} ({src.get('engine')}, fp32),"
            f" {_mb(src.get('size_bytes'))} -> {_mb(self.artifact.get('size_bytes'))}"
            f" ({self.artifact.get('file', '?')})"),
            f"- engine {self.engine}, precision {self.precision}: {self.method}",
            f"- options: {json.dumps(self.options, sort_keys=True)}",
            (f"- cache key `{self.cache_key[:16]}`, built {self.built_at} in {self.build_seconds:.1f}s"
            f" (build process peak RSS {self.build_peak_rss_mb:.0f} MB)"),
            "",
            "## Quality vs FP32",
            "",
            "| metric | build | FP32 | gate |",
            "|---|---|---|---|",
        ]
        checks = {c["metric"]: c for c in self.quality.get("checks", [])}
        reference = self.quality.get("reference", {})
        for metric, value in self.quality.get("metrics", {}).items():
            check = checks.get(metric)
            gate = f"{check['op']} {check['threshold']:.4f}: {'pass' if check['passed'] else 'FAIL'}" if check else "(reported)"
            lines.append(f"| {metric} | {_fmt(value)} | {_fmt(reference.get(metric, ''))} | {gate} |")
        enforced = self.quality.get("enforced", True)
        data = f" ({self.quality['data']})" if self.quality.get("data") else ""
        lines += ["", (f"Gate ({self.quality.get('kind', '?')}) {'enforced' if enforced else 'NOT enforced (build.gate.enforce: false)'}"
                  f" on {self.quality.get('samples', '?')} held-out samples{data}."), ""]
        bench = self.benchmark
        if bench:
            lines += [
                f"## Speed (engine alone on {bench.get('device', 'cpu')}, "
                f"{bench.get('threads')} thread, {bench.get('seconds')}s per batch size"
                + (f", sequence length {bench['sequence_length']}" if bench.get("sequence_length") else "")
                + ")",
                "",
                "| batch | build latency ms | FP32 latency ms | build items/s | FP32 items/s | speedup |",
                "|---|---|---|---|---|---|",
            ]
            ref = {b["batch"]: b for b in (bench.get("reference") or {}).get("buckets", [])}
            same_engine = {b["batch"]: b for b in (bench.get("fp32_same_engine") or {}).get("buckets", [])}
            speedups, same_speedups = self.speedups(), self.speedups("fp32_same_engine")
            same_lines: list[str] = []
            for row in bench.get("buckets", []):
                r = ref.get(row["batch"])
                same = same_engine.get(row["batch"])
                if same:
                    same_lines.append(
                        f"| {row['batch']} | {same['latency_ms']:.3f} | {same['throughput']:.1f} |"
                        f" {same_speedups[row['batch']]:.2f}x |"
                    )
                if r:
                    lines.append(
                        f"| {row['batch']} | {row['latency_ms']:.3f} | {r['latency_ms']:.3f} |"
                        f" {row['throughput']:.1f} | {r['throughput']:.1f} | {speedups[row['batch']]:.2f}x |"
                    )
                else:
                    lines.append(f"| {row['batch']} | {row['latency_ms']:.3f} | | {row['throughput']:.1f} | | |")
            if same_lines:
                lines += ["", f"The FP32 export in {self.engine} itself (the precision's share of the gain):", "",
                          "| batch | FP32 latency ms | FP32 items/s | build speedup over it |", "|---|---|---|---|",
                          *same_lines]
            reference = bench.get("reference") or {}
            ref_rss, ref_gpu = reference.get("peak_rss_mb"), reference.get("gpu_memory_mb")
            gpu = bench.get("gpu_memory_mb")
            gpu_text = "none (CPU)" if str(bench.get("device", "cpu")) == "cpu" else "not readable (NVML)"
            if gpu is not None:
                gpu_text = f"{gpu:.0f} MB" + (f" (FP32: {ref_gpu:.0f} MB)" if ref_gpu is not None else "")
            lines += ["", f"Peak RSS serving the build: {bench.get('peak_rss_mb', 0):.0f} MB"
                      + (f" (FP32: {ref_rss:.0f} MB)" if ref_rss else "")
                      + f"; GPU memory: {gpu_text}.", ""]
        else:
            lines += ["Speed: not measured for this build.", ""]
        if self.notes:
            lines += ["## Notes", "", *(f"- {n}" for n in self.notes), ""]
        return "\n".join(lines)


def _mb(size: Any) -> str:
    if not isinstance(size, (int, float)):
        return "?"
    return f"{size / 1e6:.2f} MB" if size >= 1e6 else f"{size / 1e3:.1f} KB"


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def find_reports(variant_dir: Path) -> list[tuple[Path, BuildReport]]:
    """Every report of a variant, published versions and rejected builds, oldest first."""
    found: list[tuple[Path, BuildReport]] = []
    if not variant_dir.is_dir():
        return found
    candidates = [p for p in variant_dir.iterdir() if is_version_folder(p)]
    rejected = variant_dir / REJECTED_DIR
    if rejected.is_dir():
        candidates += [p for p in rejected.iterdir() if p.is_dir()]
    for folder in candidates:
        path = folder / REPORT_FILE
        if path.is_file():
            try:
                found.append((folder, BuildReport.load(path)))
            except (ValueError, TypeError):
                continue  # a damaged report is as good as none: the build will be redone
    return sorted(found, key=lambda item: (item[1].built_at, (item[0] / REPORT_FILE).stat().st_mtime_ns))


def report(repository: Path, variant: str) -> str:
    """The newest build report of `variant` as markdown (for `batchline build --report`)."""
    reports = find_reports(repository / variant)
    if not reports:
        from server.quantize.errors import BuildError

        raise BuildError(f"no build report for '{variant}' in {repository}")
    folder, newest = reports[-1]
    text = newest.markdown()
    chart = folder / CHART_FILE
    return text + (f"\nChart: {chart}\n" if chart.is_file() else "")
