"""`ensure_built`: at model load, make sure a config that declares `build:` has a matching version.

A variant's config may say how it is built (`build: {source, engine, precision, options, gate}`)
instead of shipping an artifact. At load, the variant's latest version is reused if its
build.json carries the cache key of that spec; otherwise it is built now (minutes for a
transformer: call this off the event loop). A build that fails its enforced gate raises, so the
model is unavailable with the reason while every other model serves.
"""

from __future__ import annotations

import logging
from pathlib import Path

from server.config import ModelConfig
from server.errors import ConfigError, EngineError

logger = logging.getLogger("server.quantize")


def ensure_built(repository: Path, model_name: str, config: ModelConfig, *, benchmark: bool = False) -> int | None:
    """The version to serve for `model_name`; None when its config declares no build.

    Raises ConfigError for a spec that cannot be built (unknown source, unsupported combination)
    and EngineError when the build fails or does not pass its quality gate.
    """
    if config.build is None:
        return None
    from server.quantize.api import build, published_build
    from server.quantize.errors import EvalDataUnavailable

    spec = config.build
    if spec.source == model_name:
        raise ConfigError(f"{model_name}: build.source names the model itself")
    if not (Path(repository) / spec.source).is_dir():
        raise ConfigError(f"{model_name}: build.source '{spec.source}' is not in the repository")
    try:
        report = build(
            Path(repository), spec.source, spec.engine, spec.precision, name=model_name, device=spec.device,
            options=dict(spec.options), gate=spec.gate, benchmark=benchmark,
            progress=lambda message: logger.info("%s", message),
            recorded=False,  # recorded traffic changes as it is served: it would rebuild at every load
        )
    except EvalDataUnavailable as exc:
        published = published_build(Path(repository), model_name, spec)
        if published is None:
            raise EngineError(f"{model_name}: no build of this spec is published, and none can be made here: "
                              f"{exc.message}") from exc
        report = published
        logger.warning("%s: serving version %s as it was built and gated; it cannot be rebuilt or re-judged "
                       "here (%s)", model_name, report.version, exc.message)
    except (EngineError, ConfigError):  # BuildError is an EngineError: its message says why
        raise
    except Exception as exc:  # a library's own error while converting: name it, keep the server up
        raise EngineError(f"{model_name}: building from '{spec.source}' failed: {type(exc).__name__}: {exc}") from exc
    if not report.servable:
        failed = [c for c in report.quality.get("checks", []) if not c["passed"]]
        detail = ", ".join(f"{c['metric']} {c['value']:.4f}, not {c['op']} {c['threshold']:.4f}" for c in failed)
        raise EngineError(f"{model_name}: the {spec.engine} {spec.precision} build failed its quality gate ({detail})")
    return report.version
