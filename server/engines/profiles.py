"""TensorRT optimization profiles and cache folder, for plans and ORT's TensorRT EP.

A TensorRT engine with dynamic shapes is tuned per profile (min/opt/max shape of every input).
Plans get one profile per batch bucket, tuned at the bucket, so a batch the pipeline padded to a
bucket runs on kernels chosen for exactly its size; ORT's TensorRT EP, which runs profile 0 only,
gets one profile spanning them (`provider_shapes`). Pure: computed from the model's `EngineIO`
alone, so both derive from the same buckets and are tested without TensorRT.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.engines.spec import EngineIO
from server.errors import EngineError


@dataclass(frozen=True)
class Profile:
    """One optimization profile: per engine input, the min/opt/max shapes TensorRT tunes for."""

    batch: int
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]

    def as_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "shapes": {k: [list(s) for s in v] for k, v in self.shapes.items()}}


def engine_inputs(io: EngineIO) -> dict[str, list[int]]:
    """Engine input name -> dims without batch (-1 variable), token tensors last: the order
    profiles list inputs in, which is part of the ORT provider options and so of their cache key."""
    plain = {t.engine_name: list(t.dims) for t in io.inputs if t.token_of is None}
    return plain | {t.engine_name: list(t.dims) for t in io.inputs if t.token_of is not None}


def batch_buckets(io: EngineIO) -> list[int]:
    """The batch sizes to build for: the batch buckets, else the batch ladder."""
    if not io.batched:
        return [1]
    return list(io.batch_buckets or io.batch_ladder)


def optimization_profiles(io: EngineIO) -> list[Profile]:
    """One profile per batch bucket: batches (previous bucket, bucket] tuned at the bucket.

    Variable non-batch dims are the sequence of a text model: 1..max_length, tuned at the
    middle sequence bucket. Any other variable dim has no known bound and is refused.
    """
    tokens = io.tokens
    profiles, previous = [], 0
    for bucket in batch_buckets(io):
        shapes = {}
        for name, dims in engine_inputs(io).items():
            low, opt, high = [], [], []
            for dim in dims:
                if dim > 0:
                    bounds = (dim, dim, dim)
                elif tokens is not None:
                    buckets = tokens.sequence_buckets or (tokens.max_length,)
                    bounds = (1, buckets[len(buckets) // 2], tokens.max_length)
                else:
                    raise EngineError(f"input {name!r} has a variable dim with no known bound for TensorRT")
                low.append(bounds[0])
                opt.append(bounds[1])
                high.append(bounds[2])
            if io.batched:
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


def provider_shapes(io: EngineIO) -> dict[str, str]:
    """ONNX Runtime's TensorRT EP options for one profile spanning every batch bucket,
    "name:1x8x8,..." per min/opt/max.

    ORT parses and builds several profiles (an input named again starts the next) but its
    execution context stays on profile 0 (onnxruntime PR #31624, open), so a batch beyond the
    first bucket would fail: ORT gets the single spanning profile. Plans built by
    `batchline build --engine tensorrt` keep one profile per bucket; their engine picks one.
    """
    profile = spanning_profile(optimization_profiles(io))
    keys = ("trt_profile_min_shapes", "trt_profile_opt_shapes", "trt_profile_max_shapes")
    return {
        key: ",".join(f"{name}:{'x'.join(str(d) for d in shapes[i])}" for name, shapes in profile.shapes.items())
        for i, key in enumerate(keys)
    }
