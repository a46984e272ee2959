"""Every engine Batchline serves with, one entry each: a new engine is its module plus one line here.

The rest of the house reads engine facts from here only: the artifact a version folder holds,
the platform Triton names, which block of a model config holds the engine's options and how
`--engine-threads` pins it, the packages that run it, and whether it runs on a GPU only. An
entry names its class as "module:Class", imported (`server.engines.engine_class`) when a model
first uses it, so importing this registry imports no runtime (torch alone takes seconds); a
runtime that is not installed fails that model's load, not the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from server.errors import EngineError
from server.versions import TENSORRT_DISTRIBUTIONS

if TYPE_CHECKING:
    from server.config import ModelConfig


@dataclass(frozen=True)
class EngineEntry:
    """One engine, as everything outside its own module knows it."""

    name: str  # `engine:` in a model config
    engine_class: str  # "module:Class", imported on first use
    artifact: str  # the artifact's file in a version folder, unless `model_filename` names another
    triton_platform: str  # what Triton calls models of this engine, in /config and the metadata alike
    options_field: str | None  # the ModelConfig block of the engine's own options; None: it has none
    threads_option: str | None  # the option in that block that `--engine-threads` sets; None: not pinned
    distributions: tuple[str, ...]  # the installed packages that run it, the first installed one named in logs
    gpu_only: bool = False  # its artifacts run on a GPU alone: built, judged and served there

    def with_threads(self, config: ModelConfig, threads: int) -> ModelConfig:
        """`config` with this engine pinned to `threads` intra-op threads: the server's
        `--engine-threads`, which wins over each model's own setting."""
        if self.options_field is None or self.threads_option is None:
            return config
        options = getattr(config, self.options_field)
        return config.model_copy(
            update={self.options_field: options.model_copy(update={self.threads_option: threads})}
        )


# name, class; artifact, Triton platform, options block, its thread option, packages; GPU only
ENGINES: dict[str, EngineEntry] = {
    entry.name: entry
    for entry in (
        EngineEntry("onnxruntime", "server.engines.onnxruntime:OnnxRuntimeEngine",
                    "model.onnx", "onnxruntime_onnx", "onnxruntime", "intra_op_num_threads",
                    ("onnxruntime-gpu", "onnxruntime")),
        EngineEntry("torch", "server.engines.torch:TorchEngine",
                    "model.pt2", "pytorch_libtorch", "torch", "num_threads", ("torch",)),
        EngineEntry("tensorrt", "server.engines.tensorrt:TensorRTEngine",
                    "model.plan", "tensorrt_plan", None, None, TENSORRT_DISTRIBUTIONS, gpu_only=True),
    )
}


def engine_entry(name: str) -> EngineEntry:
    """The entry of engine `name`; EngineError naming the known engines when there is none."""
    entry = ENGINES.get(name)
    if entry is None:
        raise EngineError(f"unknown engine {name!r} (engines: {', '.join(ENGINES)})")
    return entry


def artifact_file(config: ModelConfig, version_dir: Path) -> Path:
    """The artifact a version folder of `config` holds: its `model_filename`, else the engine's own."""
    return version_dir / (config.model_filename or engine_entry(config.engine).artifact)
