"""Engine plug-ins, listed in `server/engines/registry.py`; each is imported only when a model
uses it (torch is slow to import)."""

from __future__ import annotations

import importlib
from pathlib import Path

from server.config import ModelConfig
from server.devices import Device
from server.engines.base import Engine
from server.engines.registry import EngineEntry, engine_entry
from server.engines.signature import check_signature
from server.engines.spec import EngineSpec
from server.errors import EngineError


def create_engine(config: ModelConfig, version_dir: Path, device: Device) -> Engine:
    """Load the engine the config names on `device` and check the config against the model's
    own signature; raises EngineError with the reason."""
    loaded = engine_class(engine_entry(config.engine))
    spec = EngineSpec.from_config(config, version_dir)
    engine = loaded(spec, device)
    try:
        check_signature(spec.io, engine.signature())
    except BaseException:
        engine.close()
        raise
    return engine


def engine_class(entry: EngineEntry) -> type[Engine]:
    """The entry's class, its runtime imported now; EngineError when that is not installed."""
    module, _, name = entry.engine_class.partition(":")
    try:
        loaded = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise EngineError(f"the {entry.name} engine is not installed: {exc}") from exc
    if not (isinstance(loaded, type) and issubclass(loaded, Engine)):
        raise EngineError(f"{entry.engine_class} is not an engine")
    return loaded
