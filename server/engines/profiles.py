"""TensorRT optimization profiles and cache folder, for plans and ORT's TensorRT EP.

A TensorRT engine with dynamic shapes is tuned per profile (min/opt/max shape of every input).
Plans get one profile per batch bucket, tuned at the bucket, so a batch the pipeline padded to a
bucket runs on kernels chosen for exactly its size; ORT's TensorRT EP, which runs profile 0 only,
gets one profile spanning them (`provider_shapes`). Pure: computed from the config alone, so both
derive from the same buckets and are tested without TensorRT.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.config import ModelConfig
from server.errors import EngineError


@dataclass(frozen=True)
class Profile:
    """One optimization profile: per engine input, the min/opt/max shapes TensorRT tunes for."""

    batch: int
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]

    def as_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "shapes": {k: [list(s) for s in v] for k, v in self.shapes.items()}}


def engine_inputs(config: ModelConfig) -> dict[str, list[int]]:
    """Engine input name -> dims without batch (-1 variable), tokenizer outputs included."""
    tokenize = config.tokenize
    inputs = {t.source_name: list(t.dims) for t in config.inputs if not (tokenize and t.name == tokenize.input)}
    if tokenize:
        for name in (tokenize.input_ids, tokenize.attention_mask, tokenize.token_type_ids):
            if name:
                inputs[name] = [-1]
    return inputs


def batch_buckets(config: ModelConfig) -> list[int]:
    """The batch sizes to build for: the config's batch_buckets, else its batch ladder."""
    if not config.batched:
        return [1]
    return list(config.batch_buckets) if config.batch_buckets else config.batch_ladder()


def optimization_profiles(config: ModelConfig) -> list[Profile]:
    """One profile per batch bucket: batches (previous bucket, bucket] tuned at the bucket.

    Variable non-batch dims are the sequence of a text model: 1..max_length, tuned at the
    middle sequence bucket. Any other variable dim has no known bound and is refused.
    """
    tokenize = config.tokenize
    profiles, previous = [], 0
    for bucket in batch_buckets(config):
        shapes = {}
        for name, dims in engine_inputs(config).items():
            low, opt, high = [], [], []
            for dim in dims:
                if dim > 0:
                    bounds = (dim, dim, dim)
                elif tokenize is not None:
                    buckets = tokenize.sequence_buckets or [tokenize.max_length]
                    bounds = (1, buckets[len(buckets) // 2], tokenize.max_length)
                else:
                    raise EngineError(f"input {name!r} has a variable dim with no known bound for TensorRT")
                low.append(bounds[0])
                opt.append(bounds[1])
                high.append(bounds[2])
            if config.batched:
                shapes[name] = ((previous + 1, *low), (bucket, *opt), (bucket, *high))
            else:
                shapes[name] = (tuple(low), tuple(opt), tuple(high))
        profiles.append(Profile(bucket, shapes))
        previous = bucket
    return profiles


def cache_root() -> Path:
    """Where plans and timing caches persist across builds: $BATCHLINE_TENSORRT_CACHE, else
    ~/.cache/batchline/tensorrt. Keyed files only, so one folder may serve many GPUs."""
    configured = os.environ.get("BATCHLINE_TENSORRT_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "batchline" / "tensorrt"


def spanning_profile(profiles: list[Profile]) -> Profile:
    """One profile over every bucket: the first's min, the largest's opt and max (a loaded
    server forms full batches, so TensorRT tunes for those)."""
    first, last = profiles[0], profiles[-1]
    return Profile(last.batch, {name: (first.shapes[name][0], *last.shapes[name][1:]) for name in last.shapes})


def provider_shapes(config: ModelConfig) -> dict[str, str]:
    """ONNX Runtime's TensorRT EP options for one profile spanning every batch bucket,
    "name:1x8x8,..." per min/opt/max.

    ORT parses and builds several profiles (an input named again starts the next) but its
    execution context stays on profile 0 (onnxruntime PR #31624, open), so a batch beyond the
    first bucket would fail: ORT gets the single spanning profile. Plans built by
    `batchline build --engine tensorrt` keep one profile per bucket; their engine picks one.
    """
    profile = spanning_profile(optimization_profiles(config))
    keys = ("trt_profile_min_shapes", "trt_profile_opt_shapes", "trt_profile_max_shapes")
    return {
        key: ",".join(f"{name}:{'x'.join(str(d) for d in shapes[i])}" for name, shapes in profile.shapes.items())
        for i, key in enumerate(keys)
    }
