"""What an engine takes and gives, and the one check of a model config against it.

Each engine reads its signature from its own artifact (an ONNX Runtime session, a torch.export
program's placeholders, a TensorRT plan). `check_signature` compares it with the config, as the
engine's `EngineIO` states it, once at load, for every engine alike: a config that misdescribes
its model is refused, naming the tensor, what the config says and what the model has, instead of
loading, advertising shapes and types the model does not produce, and failing (or answering
otherwise) at run time.
Static signatures can be partial (a dim or a rank the artifact leaves open), so warm-up also
checks what the engine really returns, with `check_results`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from server.engines.spec import EngineIO, TensorSpec
from server.errors import ConfigMismatch, EngineError, InvalidInput
from server.protocol.datatypes import v2_datatype

FLOAT_DATATYPES = frozenset({"FP16", "BF16", "FP32", "FP64"})

Shape = tuple[int | None, ...]


@dataclass(frozen=True)
class TensorSignature:
    """One tensor as the engine knows it."""

    name: str
    datatype: str | None  # the v2 datatype; None when the protocol has no name for the engine's type
    shape: Shape | None  # with the batch dim; None marks a variable dim; None for all: rank unknown
    native_type: str = ""  # the engine's own type name, for messages about types v2 cannot name


@dataclass(frozen=True)
class EngineSignature:
    """Every input and output of a loaded artifact."""

    inputs: tuple[TensorSignature, ...]
    outputs: tuple[TensorSignature, ...]
    positional: bool = False  # matched to the config's tensors by position (a program's arguments)
    casts_float_inputs: bool = False  # floating inputs are cast to the engine's precision on the way in
    # the batch sizes the artifact was exported for (lower, upper or None), where it says
    batch_range: tuple[int, int | None] | None = None
    precision: str | None = None  # what its floating weights are, where the artifact says (a program's)


@dataclass(frozen=True)
class DeclaredTensor:
    """A tensor as the config says the engine sees it: after tokenization and `engine_name`."""

    engine_name: str
    label: str  # how messages name it, in the config's words
    datatype: str
    shape: tuple[int, ...]  # with the batch dim when the model batches; -1 is variable


def engine_inputs(io: EngineIO) -> list[DeclaredTensor]:
    """What the engine is fed, in config order (a text input as its token tensors)."""
    declared: list[DeclaredTensor] = []
    for tensor in io.inputs:
        if tensor.token_of is not None:
            # one row of tokens per text, as long as its sequence bucket (fixed if only one)
            rows = _batch_dim(io) if io.batched else 1
            buckets = io.tokens.sequence_buckets if io.tokens else ()
            sequence = buckets[0] if len(buckets) == 1 else -1
            label = f"input '{tensor.engine_name}' (a token tensor of '{tensor.token_of}')"
            declared.append(DeclaredTensor(tensor.engine_name, label, tensor.datatype, (rows, sequence)))
            continue
        declared.append(_declared(io, "input", tensor))
    return declared


def engine_outputs(io: EngineIO) -> list[DeclaredTensor]:
    """The declared outputs under the names the engine gives them, in config order."""
    return [_declared(io, "output", t) for t in io.outputs]


def _declared(io: EngineIO, kind: str, tensor: TensorSpec) -> DeclaredTensor:
    label = f"{kind} '{tensor.name}'"
    if tensor.engine_name != tensor.name:
        label += f" (engine name '{tensor.engine_name}')"
    return DeclaredTensor(tensor.engine_name, label, tensor.datatype, _shape(io, tensor.dims))


def _batch_dim(io: EngineIO) -> int:
    """-1, or the one batch size every batch is padded to (a single batch bucket)."""
    return io.batch_buckets[0] if len(io.batch_buckets) == 1 else -1


def _shape(io: EngineIO, dims: tuple[int, ...]) -> tuple[int, ...]:
    return ((_batch_dim(io),) if io.batched else ()) + dims


def check_signature(io: EngineIO, signature: EngineSignature) -> None:
    """Refuse a config whose tensors the engine does not have, or has with other types or dims.

    Allowed differences: a dim the engine leaves variable that the config fixes; an output whose
    float type differs from the declared float type (the pipeline casts outputs to the declared
    datatype, so an FP16 or BF16 build serves an FP32 config); likewise float inputs of an engine
    that casts them to its precision (torch). All problems are reported at once.
    """
    problems = _mismatches("input", engine_inputs(io), signature.inputs, signature)
    problems += _mismatches("output", engine_outputs(io), signature.outputs, signature)
    if problems:
        raise ConfigMismatch(f"the config does not describe the model '{io.model}': " + "; ".join(problems))


def _mismatches(
    kind: str, declared: list[DeclaredTensor], actual: Sequence[TensorSignature], signature: EngineSignature
) -> list[str]:
    """What differs between the declared tensors of one kind and the engine's, in words."""
    problems: list[str]
    if signature.positional:
        if len(declared) != len(actual):
            names = ", ".join(t.name for t in actual)
            return [f"the config declares {len(declared)} {kind}s, the model has {len(actual)} ({names})"]
        pairs = list(zip(declared, actual))
        problems = []
    else:
        by_name = {t.name: t for t in actual}
        pairs = [(d, by_name[d.engine_name]) for d in declared if d.engine_name in by_name]
        known = ", ".join(sorted(by_name))
        problems = [
            f"{d.label}: the model has no {kind} '{d.engine_name}' (its {kind}s: {known})"
            for d in declared
            if d.engine_name not in by_name
        ]
        if kind == "input":  # the engine cannot run without every input it takes
            fed = {d.engine_name for d in declared}
            problems += [
                f"the model takes input '{t.name}', which the config does not feed"
                for t in actual
                if t.name not in fed
            ]
    for want, have in pairs:
        if not (
            _datatypes_agree(kind, want.datatype, have.datatype, signature)
            and _shapes_agree(kind, want.shape, have.shape)
        ):
            engine_name = f" ({kind} '{have.name}')" if signature.positional else ""
            problems.append(
                f"{want.label}: the config says {want.datatype} {list(want.shape)},"
                f" the model has {_described(have)}{engine_name}"
            )
    return problems


def _datatypes_agree(kind: str, declared: str, actual: str | None, signature: EngineSignature) -> bool:
    if declared == actual:
        return True
    floats = declared in FLOAT_DATATYPES and actual in FLOAT_DATATYPES
    return floats and (kind == "output" or signature.casts_float_inputs)


def _shapes_agree(kind: str, declared: tuple[int, ...], actual: Shape | None) -> bool:
    """Ranks equal; a fixed engine dim must be declared as such, except that a variable (-1)
    output dim promises clients nothing the engine breaks. A variable input dim promises that
    any size is taken, which an engine of fixed size refuses."""
    if actual is None:
        return True
    if len(declared) != len(actual):
        return False
    return all(
        have is None or want == have or (want == -1 and kind == "output")
        for want, have in zip(declared, actual)
    )


def _described(tensor: TensorSignature) -> str:
    datatype = tensor.datatype or tensor.native_type or "an unknown type"
    if tensor.shape is None:
        return f"{datatype} of a rank it does not state"
    return f"{datatype} {[-1 if d is None else d for d in tensor.shape]}"


def check_results(io: EngineIO, results: dict[str, np.ndarray], rows: int | None) -> None:
    """Check what one batch really returned (warm-up) against the declared outputs: every output
    present, of a compatible datatype, and shaped as declared with `rows` items (None: the model
    does not batch)."""
    problems = []
    for want in engine_outputs(io):
        array = results.get(want.engine_name)
        if array is None:
            problems.append(f"{want.label}: the model returned no such output")
            continue
        expected = tuple(rows if rows is not None and i == 0 else d for i, d in enumerate(want.shape))
        datatype = _returned_datatype(array)
        shape_ok = array.ndim == len(expected) and all(e in (-1, s) for e, s in zip(expected, array.shape))
        type_ok = datatype == want.datatype or {datatype, want.datatype} <= FLOAT_DATATYPES
        if not (shape_ok and type_ok):
            problems.append(
                f"{want.label}: the config says {want.datatype} {list(want.shape)}, the model returned"
                f" {datatype} {list(array.shape)}" + (f" for a batch of {rows}" if rows is not None else "")
            )
    if problems:
        raise EngineError("; ".join(problems))


def _returned_datatype(array: np.ndarray[Any, Any]) -> str:
    try:
        return v2_datatype(array.dtype)
    except InvalidInput:  # a dtype v2 has no name for (complex, datetime, ...)
        return str(array.dtype)
