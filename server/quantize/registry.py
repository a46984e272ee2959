"""Which builder makes which (engine, precision), and from which source engines.

The top of the builders' floor: it imports every builder module and none of them imports it
(they take their types from `builders.py`). Anything not in the table is refused with the list
of what is supported.
"""

from __future__ import annotations

from server.quantize.builders import Builder
from server.quantize.errors import BuildError


def builders() -> dict[tuple[str, str], Builder]:
    """(target engine, precision) -> builder; imported lazily (torch, onnx are heavy)."""
    from server.quantize import onnx_builds, tensorrt, torch_builds

    return {
        ("onnxruntime", "fp32"): Builder(onnx_builds.fp32, onnx_builds.fp32_defaults, ("onnxruntime", "torch")),
        ("onnxruntime", "fp16"): Builder(onnx_builds.fp16, onnx_builds.fp16_defaults, ("onnxruntime", "torch")),
        ("onnxruntime", "int8"): Builder(onnx_builds.int8, onnx_builds.int8_defaults, ("onnxruntime", "torch")),
        ("torch", "fp16"): Builder(torch_builds.cast, torch_builds.cast_defaults, ("torch",)),
        ("torch", "bf16"): Builder(torch_builds.cast, torch_builds.cast_defaults, ("torch",)),
        ("torch", "int8"): Builder(torch_builds.int8, torch_builds.int8_defaults, ("torch",)),
        **{("tensorrt", p): Builder(tensorrt.build, tensorrt.defaults, ("onnxruntime", "torch"))
           for p in ("fp32", "fp16", "bf16", "int8")},
    }


def select(engine: str, precision: str, source_engine: str) -> Builder:
    table = builders()
    builder = table.get((engine, precision))
    if builder is None:
        supported = ", ".join(f"{e}/{p}" for e, p in sorted(table))
        raise BuildError(f"no {engine} {precision} build; supported: {supported}")
    if source_engine not in builder.sources:
        raise BuildError(
            f"a {engine} {precision} build starts from a {' or '.join(builder.sources)} model, not {source_engine}"
        )
    return builder
