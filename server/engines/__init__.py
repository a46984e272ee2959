"""Engine plug-ins; each is imported only when a model uses it (torch is slow to import)."""

from __future__ import annotations

from pathlib import Path

from server.config import ModelConfig
from server.devices import Device
from server.engines.base import Engine
from server.engines.signature import check_signature
from server.errors import EngineError


def create_engine(config: ModelConfig, version_dir: Path, device: Device) -> Engine:
    """Load the engine the config names on `device` and check the config against the model's
    own signature; raises EngineError with the reason."""
    try:
        if config.engine == "onnxruntime":
            from server.engines.onnxruntime import OnnxRuntimeEngine as engine_class
        elif config.engine == "tensorrt":
            from server.engines.tensorrt import TensorRTEngine as engine_class
        else:
            from server.engines.torch import TorchEngine as engine_class
    except ImportError as exc:
        raise EngineError(f"the {config.engine} engine is not installed: {exc}") from exc
    engine = engine_class(config, version_dir, device)
    try:
        check_signature(config, engine.signature())
    except BaseException:
        engine.close()
        raise
    return engine
