"""`batchline import PATH --name NAME`: a model folder (config + version 1) from a user's model.

Triton completes a config from the model the same way: names, datatypes and dims come from the
artifact's own signature (an ONNX graph, a torch.export program); a first dim that is variable on
every input and output is the batch dim. The written config is plain YAML to review and edit.
What the artifact leaves open (a tensor of unknown rank, a type v2 cannot name, first dims that
disagree) is an error that says what to decide, never a guess. The draft is checked against the
artifact with the same check the server runs at load, and the version's SHA256SUMS is recorded.

A local Hugging Face folder (a sentence-transformers embedding model, a sequence classifier) is
exported to ONNX first, with its tokenizer carried over and the text tokenized in the server
(server/hf_export.py), and the export is checked against the original before anything appears.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from server.config import validated_config
from server.engines.digests import record_digests
from server.engines.registry import ENGINES
from server.engines.signature import EngineSignature, TensorSignature, check_signature
from server.engines.spec import EngineIO
from server.errors import BatchlineError
from server.layout import FIRST_VERSION, INPUTS_FILE, config_path, eval_dir, version_dir
from server.settings import RepositorySettings, add_setting_flags, settings_from

if TYPE_CHECKING:
    from server.hf_export import HfSource

# the engines whose artifacts import reads a signature from, by their artifact's file type
ENGINE_BY_SUFFIX = {Path(ENGINES[name].artifact).suffix: name for name in ("onnxruntime", "torch")}
DEFAULT_MAX_BATCH_SIZE = 32
DEFAULT_MAX_QUEUE_SIZE = 1024
DEFAULT_TIMEOUT_US = 30_000_000
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # a folder name, and a path segment of the v2 URLs


class ImportRefused(BatchlineError):
    """The artifact cannot become a config without a decision only its owner can make."""


def read_signature(artifact: Path) -> tuple[str, EngineSignature]:
    """The engine that serves `artifact` and the artifact's inputs and outputs."""
    engine = ENGINE_BY_SUFFIX.get(artifact.suffix)
    if engine is None:
        known = ", ".join(ENGINE_BY_SUFFIX)
        raise ImportRefused(f"{artifact}: not a model file this server imports (file types: {known})")
    if not artifact.is_file():
        raise ImportRefused(f"{artifact}: no such file")
    if engine == "onnxruntime":
        return engine, _onnx_signature(artifact)
    return engine, _program_signature(artifact)


def _onnx_signature(artifact: Path) -> EngineSignature:
    import onnxruntime as ort

    from server.engines.onnxruntime import tensor_signature

    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(str(artifact), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT raises its own types for every kind of bad file
        raise ImportRefused(f"{artifact}: ONNX Runtime cannot load it: {exc}") from exc
    return EngineSignature(
        inputs=tuple(tensor_signature(i) for i in session.get_inputs()),
        outputs=tuple(tensor_signature(o) for o in session.get_outputs()),
    )


def _program_signature(artifact: Path) -> EngineSignature:
    import torch

    from server.engines.torch import EXPORT_LOCK, batch_range, program_signature, structure_problem

    try:
        with EXPORT_LOCK:
            program = torch.export.load(str(artifact))
    except Exception as exc:  # torch raises many types for a file that is not a program
        raise ImportRefused(f"{artifact}: not a torch.export program torch {torch.__version__} loads: {exc}") from exc
    problem = structure_problem(program)
    if problem is not None:
        raise ImportRefused(f"{artifact}: {problem}")
    signature = program_signature(program)
    return dataclasses.replace(signature, batch_range=batch_range(program),
                               precision=_program_precision(artifact, program))


_PRECISION_OF_WEIGHTS = {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16"}


def _program_precision(artifact: Path, program: Any) -> str:
    """What a program's floating weights are: its config's precision, which the engine casts
    floating inputs to (an FP16 program given FP32 inputs fails, Float and Half). Weights of
    several kinds (casts of its own inside) take FP32 in."""
    kinds = {str(t.dtype) for t in [*program.state_dict.values(), *program.constants.values()]
             if hasattr(t, "dtype") and t.dtype.is_floating_point}
    kind = kinds.pop() if len(kinds) == 1 else "torch.float32"
    if kind not in _PRECISION_OF_WEIGHTS:
        raise ImportRefused(f"{artifact}: its weights are {kind}; the torch engine serves fp32, fp16 or bf16: "
                            "export it in float32")
    return _PRECISION_OF_WEIGHTS[kind]


def draft_config(
    name: str,
    engine: str,
    signature: EngineSignature,
    max_batch_size: int | None = None,
    dims: dict[str, list[int]] | None = None,
) -> dict[str, Any]:
    """The config of `signature` as a plain mapping. `max_batch_size`: None detects the batch
    dim (and uses DEFAULT_MAX_BATCH_SIZE), 0 serves unbatched; `dims` gives the full shape of
    tensors whose rank the artifact leaves open."""
    dims = dims or {}
    tensors = [*signature.inputs, *signature.outputs]
    for tensor in tensors:
        if tensor.datatype is None:
            raise ImportRefused(f"tensor '{tensor.name}' has type {tensor.native_type or 'unknown'}, which the v2 "
                                "protocol cannot carry: re-export the model with another type for it")
        if tensor.datatype == "BF16":  # numpy has no bfloat16 of its own: no engine here takes or gives one
            raise ImportRefused(f"tensor '{tensor.name}' is BF16, which no engine here takes or gives as a tensor: "
                                "export it with FP32 tensors (a torch program may then be served in bf16 with "
                                "`precision: bf16`, or built so with `batchline build --precision bf16`)")
    unknown = sorted(set(dims) - {t.name for t in tensors})
    if unknown:
        raise ImportRefused(f"--dims names {unknown[0]!r}, which the model does not have "
                            f"(its tensors: {', '.join(t.name for t in tensors)})")
    shapes = {t.name: _shape(t, dims) for t in tensors}
    batched = _batched(signature, shapes, max_batch_size)
    config: dict[str, Any] = {"name": name, "engine": engine, "max_batch_size": 0}
    precision = signature.precision or _tensor_precision(tensors)
    if precision != "fp32":
        config["precision"] = precision
    if batched:
        config["max_batch_size"] = _max_batch_size(signature.batch_range, max_batch_size)
    config["inputs"] = [_tensor(t, shapes[t.name], batched) for t in signature.inputs]
    config["outputs"] = [_tensor(t, shapes[t.name], batched) for t in signature.outputs]
    if batched:
        config["dynamic_batching"] = bounded_batching()
    return config


def bounded_batching() -> dict[str, Any]:
    """Dynamic batching with a bounded queue and a timeout, as the shipped models have."""
    return {
        "max_queue_delay_microseconds": 0,
        "default_queue_policy": {
            "max_queue_size": DEFAULT_MAX_QUEUE_SIZE,
            "default_timeout_microseconds": DEFAULT_TIMEOUT_US,
        },
    }


def _shape(tensor: TensorSignature, dims: dict[str, list[int]]) -> list[int | None]:
    given = dims.get(tensor.name)
    if given is not None:
        if tensor.shape is not None and len(given) != len(tensor.shape):
            raise ImportRefused(f"--dims gives '{tensor.name}' {len(given)} dims; the model says {len(tensor.shape)}")
        return [None if d == -1 else d for d in given]
    if tensor.shape is None:
        raise ImportRefused(f"the model does not say the rank of '{tensor.name}': give its full shape, the batch "
                            f"dim first if it has one, e.g. --dims {tensor.name}=-1,3 (-1 for a variable dim)")
    return list(tensor.shape)


def _tensor_precision(tensors: list[TensorSignature]) -> str:
    """What an artifact that says no more computes in, from its floating tensors: fp16 when
    they are all FP16 (a graph converted to half), else fp32."""
    floats = {t.datatype for t in tensors if t.datatype in ("FP16", "FP32", "FP64")}
    return "fp16" if floats == {"FP16"} else "fp32"


def _max_batch_size(exported: tuple[int, int | None] | None, asked: int | None) -> int:
    """What the config serves: `asked` (else DEFAULT_MAX_BATCH_SIZE), within the batch sizes a
    program was `exported` for. One that takes no batch of 1 or 2 is refused: the server forms
    batches from one request up (a lower bound of 2 is what torch.export writes for any dim it
    may specialize, and such programs run a batch of 1)."""
    if exported is None:
        return asked or DEFAULT_MAX_BATCH_SIZE
    lower, upper = exported
    if lower > 2:
        raise ImportRefused(f"the program takes batches of {lower} or more: the server forms batches of 1 and up; "
                            "export it with a batch dim of min=1")
    if upper is not None and asked is not None and asked > upper:
        raise ImportRefused(f"--max-batch-size {asked}: the program was exported for batches of at most {upper}")
    return min(asked or DEFAULT_MAX_BATCH_SIZE, upper or DEFAULT_MAX_BATCH_SIZE)


def _batched(signature: EngineSignature, shapes: dict[str, list[int | None]], max_batch_size: int | None) -> bool:
    """Whether the first dim is a batch dim: variable on every input and output."""
    if max_batch_size == 0:
        return False
    variable = {name: bool(shape) and shape[0] is None for name, shape in shapes.items()}
    inputs_variable = all(variable[t.name] for t in signature.inputs)
    if inputs_variable and all(variable.values()):
        return True
    if max_batch_size is None and not inputs_variable:
        return False  # a fixed first dim on an input: the model takes what it was exported for
    fixed = sorted(name for name, is_variable in variable.items() if not is_variable)
    if max_batch_size is not None:
        raise ImportRefused(f"--max-batch-size {max_batch_size}: the first dim of {', '.join(fixed)} is not variable, "
                            "so requests cannot be batched; re-export with a dynamic batch axis or use --max-batch-size 0")
    raise ImportRefused(f"every input's first dim is variable but not that of {', '.join(fixed)}: is the first dim "
                        "a batch dim? --max-batch-size N says yes, --max-batch-size 0 serves it unbatched")


def _tensor(tensor: TensorSignature, shape: list[int | None], batched: bool) -> dict[str, Any]:
    dims = [-1 if d is None else d for d in (shape[1:] if batched else shape)]
    return {"name": tensor.name, "datatype": tensor.datatype, "dims": dims}


def import_model(
    artifact: Path,
    repository: Path,
    name: str,
    max_batch_size: int | None = None,
    dims: dict[str, list[int]] | None = None,
    max_length: int | None = None,
    say: Callable[[str], None] | None = None,
) -> Path:
    """Write `repository/name` (config.yaml and 1/ with the artifact and its SHA256SUMS) and
    return it. Nothing is written unless the whole folder is ready: it appears by one rename.
    `artifact` may be a Hugging Face folder (`max_length` then overrides its token window);
    `say` hears the progress and the check's figures of a folder's export."""
    if not NAME.fullmatch(name):
        raise ImportRefused(f"--name {name!r}: use letters, digits, '_', '.' and '-' (starting with a letter or "
                            "digit, at most 128): it names a folder and appears in URLs")
    target = repository / name
    if target.exists():
        raise ImportRefused(f"{target} exists already: choose another --name, or remove it first")
    if artifact.is_dir():
        if dims:
            raise ImportRefused("--dims is for model files: a folder's tensors come from its own config")
        return _import_folder(artifact, repository, name, max_batch_size, max_length, say or _quiet)
    if max_length is not None:
        raise ImportRefused("--max-length is for Hugging Face folders: a model file's inputs are its own")
    engine, signature = read_signature(artifact)
    raw = draft_config(name, engine, signature, max_batch_size, dims)
    config = validated_config(raw, f"the config drafted from {artifact}")
    check_signature(EngineIO.from_config(config), signature)
    data_files = external_data_files(artifact) if engine == "onnxruntime" else []
    with _staged(repository, name) as staging:
        version = version_dir(staging, FIRST_VERSION)
        shutil.copyfile(artifact, version / ENGINES[engine].artifact)
        for relative in data_files:  # beside the graph, where it names them
            (version / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(artifact.parent / relative, version / relative)
        record_digests(version)
        config_path(staging).write_text(_config_text(raw, artifact), encoding="utf-8")
    return target


def external_data_files(artifact: Path) -> list[Path]:
    """The files an ONNX graph keeps its weights in (models over 2 GB, many exports), relative
    to the graph's folder, as the graph names them; a name that leaves that folder is refused."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    model = onnx.load(str(artifact), load_external_data=False)
    files: set[Path] = set()
    for tensor in _tensors(model.graph):
        if uses_external_data(tensor):
            location = Path(ExternalDataInfo(tensor).location)
            if location.is_absolute() or ".." in location.parts:
                raise ImportRefused(f"{artifact.name} keeps weights in {location}, outside its folder: "
                                    "save the model with its data files beside it")
            if not (artifact.parent / location).is_file():
                raise ImportRefused(f"{artifact.name} keeps weights in {location}, which is not beside it")
            files.add(location)
    return sorted(files)


def _tensors(graph: Any) -> Iterator[Any]:
    """Every tensor of an ONNX graph that may hold data: initializers and tensor attributes, in
    subgraphs (If, Loop, Scan) too."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("g"):
                yield from _tensors(attribute.g)
            for subgraph in attribute.graphs:
                yield from _tensors(subgraph)


@contextmanager
def _staged(repository: Path, name: str) -> Iterator[Path]:
    """A hidden folder (with 1/, and eval/ for the data its builds are judged on) in the
    repository that becomes `repository/name` by one rename when the block succeeds, and is
    removed when it does not."""
    repository.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.import-", dir=repository))
    try:
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the model from a server running as another user
        version_dir(staging, FIRST_VERSION).mkdir()
        eval_dir(staging).mkdir()
        yield staging
        os.replace(staging, repository / name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _quiet(_: str) -> None:
    pass


def _import_folder(
    folder: Path, repository: Path, name: str, max_batch_size: int | None, max_length: int | None,
    say: Callable[[str], None],
) -> Path:
    """A Hugging Face folder: read (every refusal before any weight loads), exported to ONNX with
    its tokenizer, checked against the config as the server checks it at load and against the
    original model's outputs, then published."""
    from server import hf_export

    if max_batch_size == 0:
        raise ImportRefused("--max-batch-size 0: a text model is served batched; give N > 0 or leave it out")
    try:
        source = hf_export.read_folder(folder, max_length)
    except hf_export.ExportRefused as exc:
        raise ImportRefused(exc.message) from exc
    raw = draft_text_config(name, source, max_batch_size)
    config = validated_config(raw, f"the config drafted from {folder}")
    with _staged(repository, name) as staging:
        version = version_dir(staging, FIRST_VERSION)
        graph = version / ENGINES["onnxruntime"].artifact
        try:
            module = hf_export.export_source(source, graph, say)
        except hf_export.ExportRefused as exc:
            raise ImportRefused(exc.message) from exc
        shutil.copyfile(source.tokenizer_file, version / "tokenizer.json")
        check_signature(EngineIO.from_config(config), _onnx_signature(graph))
        say(f"checking the export against the original on {len(hf_export.CHECK_SENTENCES)} texts ...")
        report = hf_export.check_export(source, graph, version / "tokenizer.json", module)
        for line in report.lines:
            say(f"  {line}")
        record_digests(version)
        config_path(staging).write_text(_folder_config_text(raw, source, report.reference), encoding="utf-8")
    return repository / name


def draft_text_config(name: str, source: HfSource, max_batch_size: int | None = None) -> dict[str, Any]:
    """The config of an exported folder: a BYTES `text` input tokenized in the server, one output
    (`embedding`, or `logits` as the model returns them: softmax or sigmoid is the client's
    choice, as with TEI's raw scores and Triton's exported classifiers), bounded batching."""
    tokenize: dict[str, Any] = {"input": "text", "tokenizer": "tokenizer.json", "max_length": source.max_length}
    if "token_type_ids" not in source.token_inputs:
        tokenize["token_type_ids"] = None
    if source.pad_id:
        tokenize["pad_id"] = source.pad_id
    tokenize["sequence_buckets"] = source.tokenize_spec().sequence_buckets
    if source.kind == "embedding":
        output = {"name": "embedding", "datatype": "FP32", "dims": [source.dim], "engine_name": source.output_name}
    else:
        output = {"name": "logits", "datatype": "FP32", "dims": [source.dim]}
    return {
        "name": name,
        "engine": "onnxruntime",
        "precision": "fp32",
        "max_batch_size": max_batch_size or DEFAULT_MAX_BATCH_SIZE,
        "inputs": [{"name": "text", "datatype": "BYTES", "dims": [1]}],
        "outputs": [output],
        "preprocess": {"tokenize": tokenize},
        "dynamic_batching": bounded_batching(),
    }


def _config_text(raw: dict[str, Any], artifact: Path) -> str:
    header = (
        f"# Written by `batchline import` from {artifact.name}: names, datatypes and dims are the model's.\n"
        "# Review max_batch_size, dynamic_batching and instance_group for your traffic and machine.\n"
    )
    return header + yaml.safe_dump(raw, sort_keys=False, default_flow_style=None)


def _folder_config_text(raw: dict[str, Any], source: HfSource, reference: str) -> str:
    lines = [
        f"# Written by `batchline import` from the Hugging Face folder {source.folder.name}: {source.describe()},",
        f"# exported to ONNX and checked against {reference}.",
        "# Clients send UTF-8 text; the server tokenizes it with the model's own tokenizer.json.",
    ]
    if source.labels:
        labels = ", ".join(f"{i} {json.dumps(label, ensure_ascii=False)}" for i, label in enumerate(source.labels))
        lines.append(f"# logits, one per label: {labels}")
    lines += [f"# Note: {note}" for note in source.notes]
    lines.append("# Review max_batch_size, dynamic_batching and instance_group for your traffic and machine.")
    return "\n".join(lines) + "\n" + yaml.safe_dump(raw, sort_keys=False, default_flow_style=None, allow_unicode=True)


def parse_dims(values: list[str]) -> dict[str, list[int]]:
    """--dims NAME=D1,D2,... (repeatable) as a mapping; -1 marks a variable dim."""
    parsed: dict[str, list[int]] = {}
    for value in values:
        name, sep, text = value.partition("=")
        try:
            dims = [int(d) for d in text.split(",")] if sep and text else None
        except ValueError:
            dims = None
        if not name or dims is None or any(d == 0 or d < -1 for d in dims):
            raise ImportRefused(f"--dims {value!r}: expected NAME=D1,D2,... with each dim positive or -1")
        parsed[name] = dims
    return parsed


def add_import_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "import",
        help="add a model (ONNX file, torch.export program, or Hugging Face folder) to the repository, its "
        "config read from the model",
        description="Write a model folder (config.yaml and version 1) for PATH into the repository. Names, "
        "datatypes and dims come from the model; a first dim that is variable on every input and output is the "
        "batch dim. A Hugging Face folder (a sentence-transformers embedding model, or a *ForSequenceClassification "
        "model) is exported to ONNX with its tokenizer and checked against the original first. The config is plain "
        "YAML to review; the version's SHA256SUMS is recorded.",
    )
    parser.add_argument(
        "path", type=Path,
        help="the model: a .onnx file, a .pt2 torch.export program, or a local Hugging Face folder",
    )
    parser.add_argument("--name", required=True, help="the model's name in the repository")
    parser.add_argument(
        "--max-batch-size", type=int, default=None, metavar="N",
        help=f"most items per batch (default: {DEFAULT_MAX_BATCH_SIZE} when the model has a batch dim); "
        "0 serves it unbatched",
    )
    parser.add_argument(
        "--dims", action="append", default=[], metavar="NAME=D1,D2",
        help="the full shape of a tensor whose rank the model leaves open, batch dim first; -1 is variable (repeatable)",
    )
    parser.add_argument(
        "--max-length", type=int, default=None, metavar="N",
        help="Hugging Face folders: tokens per text, past which text is cut (default: the folder's own)",
    )
    add_setting_flags(parser, RepositorySettings)
    parser.set_defaults(handler=run_import)
    return parser


def run_import(args: argparse.Namespace) -> int:
    repository = settings_from(args, RepositorySettings).model_repository
    if args.max_batch_size is not None and args.max_batch_size < 0:
        print("batchline import: --max-batch-size must be 0 or more", file=sys.stderr)
        return 2
    try:
        folder = import_model(args.path, repository, args.name, args.max_batch_size, parse_dims(args.dims),
                              args.max_length, say=print)
    except BatchlineError as exc:
        print(f"batchline import: {exc.message}", file=sys.stderr)
        return 2
    except OSError as exc:  # a folder it cannot read, a repository it cannot write
        print(f"batchline import: {exc}", file=sys.stderr)
        return 2
    print(f"imported {args.path} as {folder}; review {config_path(folder)}, then: "
          f"batchline serve --model-repository {repository} --model {args.name}\n"
          f"to build quantized variants of it, put items like your traffic in {folder / INPUTS_FILE} "
          f"(one array per input, named as in the config; labels.npy optional), then: "
          f"batchline build {args.name} --model-repository {repository} --engine onnxruntime --precision int8")
    return 0
