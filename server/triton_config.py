"""A model config rendered as Triton's model-configuration JSON (GET /v2/models/{m}/config),
for the fields that exist in both, so Triton tooling reads it unchanged."""

from __future__ import annotations

from typing import Any

from server.config import ModelConfig, TensorConfig
from server.engines.registry import ENGINES


def triton_data_type(datatype: str) -> str:
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def _tensor(tensor: TensorConfig) -> dict[str, Any]:
    return {"name": tensor.name, "data_type": triton_data_type(tensor.datatype), "dims": tensor.dims}


def triton_model_config(config: ModelConfig, placement: str = "") -> dict[str, Any]:
    """Triton's model config document, its platform the engine's in the registry. `placement` (where
    the served version runs: devices, GPU model, driver, CUDA, engine library) goes in its
    parameters map, which Triton's clients, HTTP and gRPC alike, read as they are (v2 model
    metadata has no place for it)."""
    policy = config.version_policy
    if policy.all is not None:
        version_policy: dict[str, Any] = {"all": {}}
    elif policy.specific is not None:
        version_policy = {"specific": {"versions": policy.specific.versions}}
    else:
        version_policy = {"latest": {"num_versions": policy.latest.num_versions if policy.latest else 1}}
    document: dict[str, Any] = {
        "name": config.name,
        "platform": ENGINES[config.engine].triton_platform,
        "backend": config.engine,
        "max_batch_size": config.max_batch_size,
        "input": [_tensor(t) for t in config.inputs],
        "output": [_tensor(t) for t in config.outputs],
        "instance_group": [
            {
                "name": f"{config.name}_{i}",
                "kind": f"KIND_{g.kind}",
                "count": g.count,
                "gpus": g.gpus or [],
            }
            for i, g in enumerate(config.instance_group)
        ],
        "version_policy": version_policy,
        "parameters": _parameters(config, placement),
    }
    if config.dynamic_batching is not None:
        document["dynamic_batching"] = config.dynamic_batching.model_dump(exclude_none=True)
    return document


def _parameters(config: ModelConfig, placement: str = "") -> dict[str, dict[str, str]]:
    """The precision the engine runs, and for a build what it was built as (a torch INT8 program
    runs with precision fp32 and build_precision int8); where it runs, once loaded."""
    parameters: dict[str, str] = {"precision": config.precision}
    if placement:
        parameters["placement"] = placement
    if config.build is not None:
        parameters |= {"build_source": config.build.source, "build_engine": config.build.engine,
                       "build_precision": config.build.precision, "build_device": config.build.device}
    return {key: {"string_value": value} for key, value in parameters.items()}
