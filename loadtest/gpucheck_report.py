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
    if record.get("dry_run_differences"):
        lines += ["**What this dry run does unlike the GPU run:**", "",
                  *[f"- {difference}" for difference in record["dry_run_differences"]], ""]
    rows = record.get("summary") or []
    phases = (record.get("profile") or {}).get("phases") or ()
    if phases and "engine" not in phases and "serve" not in phases:  # the front-end curves alone (--phases)
        lines += front_ends(record)
        return "\n".join([*lines, *models_and_phases(record)])
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
    lines += compiled_and_instances(record)
    lines += front_ends(record)
    lines += models_and_phases(record)
    return "\n".join(lines)


def models_and_phases(record: dict[str, Any]) -> list[str]:
    """How each model was made, what the host cannot cover, the phases, the wheels, the server's start."""
    lines = ["## Models", ""]
    for entry in record.get("models", {}).values():
        about = ", ".join(f"{k} {v}" for k, v in entry.get("about", {}).items())
        methods = "; ".join(f"{p}: {v.get('method') or v.get('reason')}" for p, v in entry.get("variants", {}).items())
        lines += [f"- **{entry['name']}**: {about}.  ", f"  Variants: {methods}."]
    onnx = record.get("onnx")
    if onnx:
        lines += [f"- ONNX Runtime: {onnx['status']}: {onnx['reason']}."]
    lines += [""]
    if record.get("not_covered"):
        lines += ["## Not covered on this host", "",
                  "A complete run covers what the tables show, and not these:", "",
                  *[f"- {item['what']}: {item['why']}." for item in record["not_covered"]], ""]
    lines += ["## Phases", "", markdown_table(
        ("phase", "budget s", "took s", "over budget s", "status", "error"),
        [(name, p.get("budget_s"), p.get("took_s"), p.get("over_budget_s"), p.get("status"), p.get("error"))
         for name, p in record["phases"].items()],
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
    return lines


def compiled_and_instances(record: dict[str, Any]) -> list[str]:
    """The compiled variants against their plain one (compile times from the engine alone and
    from the server's log), and the variants of several instances against one."""
    compiled, instances = [], []
    for entry in record.get("models", {}).values():
        variants = entry.get("variants", {})
        for key, variant in variants.items():
            if variant.get("status") != "built" or "of" not in variant:
                continue
            plain = variants.get(variant["of"], {})
            engine, served = variant.get("engine") or {}, variant.get("served") or {}
            if variant.get("compile_mode"):
                server = variant.get("server_compile") or {}
                compiled.append((
                    entry["name"], key, variant["compile_mode"], _listed(variant.get("batch_buckets")),
                    _seconds(engine.get("compile")), _seconds(server.get("compiles")), server.get("warmup_to_ready_s"),
                    _best(engine), _best(plain.get("engine") or {}), served.get("items_s"),
                    (plain.get("served") or {}).get("items_s"), engine.get("accuracy"),
                    (plain.get("engine") or {}).get("accuracy"),
                ))
            elif variant.get("instances", 1) > 1:
                one = engine.get("one_instance") or {}
                against = served.get("against_one_instance") or {}
                instances.append((
                    entry["name"], key, variant["instances"], _best(engine, "batch_size"), one.get("items_s"),
                    _best(engine), engine.get("speedup"), against.get("one_instance_items_s"), served.get("items_s"),
                    against.get("speedup"),
                ))
    lines: list[str] = []
    if compiled:
        lines += ["## torch.compile, per batch bucket", "",
                  ("Compile s: each bucket's first run (its compile, and its CUDA graph in reduce-overhead mode) in"
                   " the engine alone, and as the server's log has it at load (`compiled ...` lines); warm-up to"
                   " ready: from the warm-up's first line to the model ready, every bucket compiled and run."),
                  "", markdown_table(
                      ("model", "variant", "mode", "buckets", "compile s, engine alone", "compile s, server",
                       "warm-up to ready s", "engine items/s", "plain engine items/s", "served items/s",
                       "plain served items/s", "accuracy", "plain accuracy"), compiled), ""]
    if instances:
        lines += ["## Instances on one device", "",
                  ("Engine alone: the instances each on a thread of its own at the largest bucket the server may"
                   " form (on a GPU each on its own CUDA stream), against one instance alone. Served: the same load"
                   " as the plain variant's, which has one instance."),
                  "", markdown_table(
                      ("model", "variant", "instances", "batch", "engine, one instance", "engine, all", "speedup",
                       "served, one instance", "served, all", "served speedup"), instances), ""]
    return lines


def front_ends(record: dict[str, Any]) -> list[str]:
    """The front-end curves: each model's served rate per count of HTTP front-end processes."""
    curves = record.get("front_ends")
    if not curves:
        return []
    lines = ["## HTTP front-end processes", ""]
    for curve in curves:
        if "skipped" in curve:
            lines += [f"{curve['curve']}: not measured, {curve['skipped']}.", ""]
            continue
        rows = []
        for served in sorted(curve["runs"], key=lambda r: r["http_workers"]):
            latency = served.get("latency_ms") or {}
            server = served.get("server") or {}
            rows.append((served["http_workers"], served.get("req_s"), served.get("items_s"), served.get("against_one"),
                         latency.get("p50"), latency.get("p99"), server.get("mean_batch"),
                         server.get("compute_input_ms_per_batch"), server.get("compute_infer_ms_per_batch"),
                         served.get("error_count"), served.get("startup_s"), served.get("skipped") or served.get("error")))
        lines += [(f"{curve['model']} served with `--http-workers N` (1: the server process alone),"
                   f" {curve['concurrency']} clients from {curve['client_processes']} processes,"
                   f" {curve['items_per_request']} items a request, {curve['request']}; against one: req/s over the"
                   " single process's. The server's own mean times a batch, on its instance's thread: merge ms, its"
                   " requests' inputs merged into the engine's (compute input); run ms, the engine's run (compute"
                   " infer)."),
                  "", markdown_table(
                      ("front ends", "req/s", "items/s", "against one", "p50 ms", "p99 ms", "mean batch", "merge ms",
                       "run ms", "errors", "start s", "note"), rows), ""]
    return lines


def _best(engine: dict[str, Any], field: str = "items_s") -> Any:
    buckets = engine.get("buckets") or []
    return max(buckets, key=lambda b: b["items_s"])[field] if buckets else None


def _seconds(compiles: list[dict[str, Any]] | None) -> str | None:
    """`1: 2.1, 64: 0.3 (2.4)`: each bucket's seconds, and their sum."""
    if not compiles:
        return None
    parts = ", ".join(f"{c.get('batch_size') or c.get('shape')}: {c['seconds']:.2f}" for c in compiles)
    return f"{parts} ({sum(c['seconds'] for c in compiles):.2f})"


def _listed(values: list[int] | None) -> str | None:
    return " ".join(map(str, values)) if values else None
