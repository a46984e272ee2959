"""What an engine is given: its verified artifact, its tensors, its precision and its own options.

Engines never see the model config: `EngineSpec.from_config` is the one place a config becomes
what an engine needs, so an engine cannot come to depend on serving settings (queues, instances,
OpenAI routes) and a new engine has a small, fixed thing to read. `EngineIO`, the tensors and
batch shapes alone, exists before any artifact does: the signature check at import and the
TensorRT profiles of a build work from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from server.config import ModelConfig, Precision, TensorConfig
from server.engines.digests import verify_artifact
from server.engines.registry import artifact_file, engine_entry
from server.errors import EngineError

TOKEN_DATATYPE = "INT64"  # what TextTokenizer.encode gives every token tensor

Options = TypeVar("Options")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor an engine is fed or gives."""

    name: str  # the config's name for it (a token tensor: its own)
    engine_name: str  # the name the engine knows it by: the keys of run()'s feed and results
    datatype: str  # the v2 datatype
    dims: tuple[int, ...]  # without the batch dim; -1 is variable (a token tensor: its sequence)
    token_of: str | None = None  # the text input a token tensor is made from; None for others


@dataclass(frozen=True)
class TokenSpec:
    """The facts of a text model's tokenization that shape its token tensors."""

    input_ids: str  # the token tensor whose last dim is the sequence
    max_length: int
    # the lengths sequences are padded to on an engine compiled per shape, and on any engine when
    # there is one (a fixed length); () none
    sequence_buckets: tuple[int, ...]


@dataclass(frozen=True)
class EngineIO:
    """The tensors an engine takes and gives, and the shapes its batches take."""

    model: str  # for messages
    inputs: tuple[TensorSpec, ...]  # in config order, a text input replaced by its token tensors
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int  # 0: the model does not batch, and its tensors have no batch dim
    batch_buckets: tuple[int, ...]  # the batch sizes a compiled engine was built for; () for none
    batch_ladder: tuple[int, ...]  # the batch sizes worth building for: the buckets, else powers of two
    tokens: TokenSpec | None  # a text model's tokenization

    @property
    def batched(self) -> bool:
        return self.max_batch_size > 0

    @classmethod
    def from_config(cls, config: ModelConfig) -> EngineIO:
        tokenize = config.tokenize
        inputs: list[TensorSpec] = []
        for tensor in config.inputs:
            if tokenize is not None and tensor.name == tokenize.input:
                names = (tokenize.input_ids, tokenize.attention_mask, tokenize.token_type_ids)
                inputs += [TensorSpec(n, n, TOKEN_DATATYPE, (-1,), token_of=tensor.name) for n in names if n]
            else:
                inputs.append(_tensor(tensor))
        tokens = None
        if tokenize is not None:
            buckets = tuple(tokenize.sequence_buckets or ())
            tokens = TokenSpec(tokenize.input_ids, tokenize.max_length, buckets)
        return cls(
            model=config.name,
            inputs=tuple(inputs),
            outputs=tuple(_tensor(t) for t in config.outputs),
            max_batch_size=config.max_batch_size,
            batch_buckets=tuple(config.batch_buckets or ()),
            batch_ladder=tuple(config.batch_ladder()),
            tokens=tokens,
        )


def _tensor(tensor: TensorConfig) -> TensorSpec:
    return TensorSpec(tensor.name, tensor.source_name, tensor.datatype, tuple(tensor.dims))


@dataclass(frozen=True)
class EngineSpec(Generic[Options]):
    """Everything an engine is given besides its device; `options` is its own block of the
    config (OnnxRuntimeOptions, TorchOptions; None for an engine without one)."""

    artifact: Path  # checked against the version folder's recorded digests
    io: EngineIO
    precision: Precision
    options: Options

    @classmethod
    def from_config(cls, config: ModelConfig, version_dir: Path) -> EngineSpec[Any]:
        """The spec of `config`'s version in `version_dir`. The artifact is checked against the
        folder's recorded digests before any engine reads it, so every engine gets the same
        check (`server/engines/digests.py`; a folder without a record loads with a warning)."""
        entry = engine_entry(config.engine)
        artifact = artifact_file(config, version_dir)
        if not artifact.is_file():
            raise EngineError(f"model artifact {artifact} is missing (was the model built?)")
        verify_artifact(artifact, version_dir)
        options: Any = getattr(config, entry.options_field) if entry.options_field else None  # the entry's own type
        return cls(artifact, EngineIO.from_config(config), config.precision, options)
