"""The build cache key: a build is redone only when something that shapes its artifact changed.

The key hashes the source artifact's bytes (not its path or mtime), the target engine and
precision, the resolved options, the evaluation and calibration data, the versions of the
libraries that build and run it, and a revision of the build code itself. A published version
whose build.json carries the same key is reused as is.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from server.versions import installed_versions

# Bump when a builder's output changes for identical inputs (new conversion code, fixed bug).
BUILDER_REVISION = 1
LIBRARIES = ("onnxruntime", "onnx", "torch", "torchao", "numpy", "tensorrt")


def library_versions(names: tuple[str, ...] = LIBRARIES) -> dict[str, str]:
    """Installed versions of the libraries that shape a build ("absent" when not installed: the
    word existing cache keys were made with)."""
    return {name: version or "absent" for name, version in installed_versions(names).items()}


def cache_key(
    *,
    source_digest: str,
    source_config: dict[str, Any],
    engine: str,
    precision: str,
    device: str,
    options: dict[str, Any],
    data_fingerprint: str,
    versions: dict[str, str],
) -> str:
    """A stable hex digest over everything a build depends on."""
    material = {
        "revision": BUILDER_REVISION,
        "source": source_digest,
        "source_config": source_config,
        "engine": engine,
        "precision": precision,
        "device": device,
        "options": options,
        "data": data_fingerprint,
        "versions": versions,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()
