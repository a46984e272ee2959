"""The GPU check's markdown: a view of gpu_check.json, the record, for people and issues."""

from __future__ import annotations

from typing import Any

from loadtest.report import markdown_table

SUMMARY_HEADERS = (
    "model", "precision", "engine items/s", "at batch", "served items/s", "served / engine", "p50 ms", "p99 ms",
    "mean batch", "GPU util %", "GPU mem MiB", "power W", "accuracy",
)


def summary_rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per model and precision: the figures people compare, pulled from the record."""
    rows = []
    for entry in record.get("models", {}).values():
        for precision, variant in entry.get("variants", {}).items():
            engine = variant.get("engine") or {}
            served = variant.get("served") or {}
            buckets = engine.get("buckets") or []
            best = max(buckets, key=lambda b: b["items_s"]) if buckets else {}
            if served.get("engine_items_s") is not None:  # the ceiling the served rate was read against
                best = {"items_s": served["engine_items_s"], "batch_size": served["engine_batch"]}
            gpu = served.get("gpu") or {}
            server = served.get("server") or {}
            rows.append({
                "model": entry["name"],
                "precision": precision,
                "status": variant["status"],
                "engine_best_items_s": best.get("items_s"),
                "engine_best_batch": best.get("batch_size"),
                "served_items_s": served.get("items_s"),
                "ratio_to_engine": served.get("ratio_to_engine"),
                "p50_ms": (served.get("latency_ms") or {}).get("p50"),
                "p99_ms": (served.get("latency_ms") or {}).get("p99"),
                "mean_batch": server.get("mean_batch"),
                "gpu_util_pct": (gpu.get("utilization_pct") or {}).get("mean"),
                "gpu_memory_mib": (gpu.get("memory_used_mib") or {}).get("max"),
                "power_w": (gpu.get("power_w") or {}).get("mean"),
                "accuracy": engine.get("accuracy"),
                "note": _note(variant),
            })
    return rows


def _note(variant: dict[str, Any]) -> str | None:
    if variant["status"] != "built":
        return f"{variant['status']}: {variant.get('reason')}"
    for stage in ("engine", "served"):
        part = variant.get(stage) or {}
        for key in ("error", "skipped"):
            if key in part:
                return f"{stage}: {part[key]}"
    return None


def markdown(record: dict[str, Any]) -> str:
    device = record.get("device") or {}
    status = "complete" if record.get("complete") else "PARTIAL"
    lines = [
        f"# GPU check ({record['mode']}): {status}",
        "",
        f"Command: `{record['command_line']}`  ",
        f"Started {record['started']}, took {record.get('elapsed_s')} s of its {record['time_limit_s']:.0f} s limit.  ",
        (f"Device: {device.get('name', '?')} ({device.get('device', '?')}), torch {device.get('torch', '?')},"
         f" CUDA {device.get('cuda') or 'none'}."),
        "",
    ]
    if record.get("partial"):
        lines += ["**Partial:**", "", *[f"- {reason}" for reason in record["partial"]], ""]
    rows = record.get("summary") or []
    lines += [
        "## Engine alone and served",
        "",
        ("Engine: the server's engine called directly, the best items/s over the batch buckets the server"
         " may form. Served: many concurrent clients (closed loop, binary tensors) through the HTTP server;"
         " served / engine is the share of that ceiling the server delivers. GPU figures are NVML's over the"
         " served load."),
        "",
        markdown_table(SUMMARY_HEADERS, [
            (r["model"], r["precision"], r["engine_best_items_s"], r["engine_best_batch"], r["served_items_s"],
             r["ratio_to_engine"], r["p50_ms"], r["p99_ms"], r["mean_batch"], r["gpu_util_pct"], r["gpu_memory_mib"],
             r["power_w"], r["accuracy"])
            for r in rows if r["status"] == "built"
        ]),
        "",
    ]
    notes = [f"- {r['model']} {r['precision']}: {r['note']}" for r in rows if r["note"]]
    if notes:
        lines += ["Not measured, or not fully:", "", *notes, ""]
    lines += ["## Engine alone, per batch bucket", "", markdown_table(
        ("model", "precision", "batch", "items/s", "p50 ms", "p99 ms", "runs"),
        [(entry["name"], precision, b["batch_size"], b["items_s"], b["latency_ms"]["p50"], b["latency_ms"]["p99"], b["runs"])
         for entry in record.get("models", {}).values()
         for precision, variant in entry.get("variants", {}).items()
         for b in (variant.get("engine") or {}).get("buckets", [])],
    ), ""]
    lines += ["## Models", ""]
    for entry in record.get("models", {}).values():
        about = ", ".join(f"{k} {v}" for k, v in entry.get("about", {}).items())
        methods = "; ".join(f"{p}: {v.get('method') or v.get('reason')}" for p, v in entry.get("variants", {}).items())
        lines += [f"- **{entry['name']}**: {about}.  ", f"  Variants: {methods}."]
    onnx = record.get("onnx")
    if onnx:
        lines += [f"- ONNX Runtime: {onnx['status']}: {onnx['reason']}."]
    lines += ["", "## Phases", "", markdown_table(
        ("phase", "budget s", "took s", "status", "error"),
        [(name, p.get("budget_s"), p.get("took_s"), p.get("status"), p.get("error")) for name, p in record["phases"].items()],
    ), ""]
    wheels = record.get("wheels")
    if wheels:
        installed = ", ".join(wheels["installed"]) or "none"
        present = ", ".join(wheels["already_present"]) or "none"
        lines += [f"Wheels from {wheels['folder']} ({wheels['seconds']} s): installed {installed}; already here: {present}.",
                  ""]
    serve = record.get("serve")
    if serve and serve.get("states"):
        not_ready = {k: v for k, v in serve["states"].items() if v != "READY"}
        lines += [f"Server: started in {serve.get('startup_s')} s; {len(serve['states']) - len(not_ready)}"
                  f"/{len(serve['states'])} models ready" + (f"; not ready: {not_ready}" if not_ready else "") + ".", ""]
    return "\n".join(lines)
