"""A local Hugging Face folder as an ONNX graph the server serves, checked against the original.

Two kinds of folder are exported, as TEI and Optimum serve them: a sentence-transformers model
(modules.json: Transformer -> Pooling -> optional Normalize) becomes one graph that returns the
pooled (and normalised) sentence embedding, and a transformers `*ForSequenceClassification`
model becomes one that returns its logits. The text is tokenized in the server with the
folder's own `tokenizer.json`, so the graph takes token tensors. Everything is read from the
folder; what it leaves open, or what the graph would compute otherwise than the original (a
Dense module, a default prompt, another pooling), is refused with what to do instead.

The export is checked before anything is published: ONNX Runtime, fed by the server's own
tokenizer, against sentence-transformers (or, when it is not installed, the transformers
module with the same pooling in torch), over varied texts, in one padded batch and one at a
time. Nothing here downloads: every load is `local_files_only`, and the hub is set offline.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version as package_version
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Literal

# Before transformers or huggingface_hub is imported anywhere in this process: never fetch.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch

from server.config import Tokenize
from server.errors import BatchlineError
from server.ladder import doubling
from server.preprocess import TextTokenizer

Kind = Literal["embedding", "classification"]
Say = Callable[[str], None]

POOLING_MODES = ("mean", "cls", "max")
SUPPORTED = (
    "a sentence-transformers folder (modules.json: Transformer -> Pooling (mean, cls or max) -> optional "
    "Normalize), or a transformers folder whose config.json architecture is a *ForSequenceClassification"
)
# The graph's output names. Not "embedding": with the dynamo exporter that name collides with an
# internal node's, and ONNX Runtime refuses the model; the config maps the API name onto it.
EMBEDDING_OUTPUT = "sentence_embedding"
LOGITS_OUTPUT = "logits"
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")

# Embeddings: cosine per text, the quality figure of the minilm build and of `batchline build`.
MIN_COSINE = 0.999
# Logits: fp32 on both sides, only the order of operations differs (ONNX Runtime's fused kernels,
# padding in a batch): that moves logits by ~1e-6 to 1e-5 (measured: MiniLM-sized encoders and
# tiny random ones). 1e-3 is ~100x that noise and still far below a change anyone would see
# (a softmax probability moves by < 0.05%); argmax must agree wherever the top two logits are
# more than that apart.
MAX_LOGIT_DIFF = 1e-3
# Pooling configs written before sentence-transformers 6: one boolean per mode.
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# Transformers' "unset" model_max_length (VERY_LARGE_INTEGER): no length at all.
_NO_LENGTH = 1_000_000

# Varied on purpose: empty, one word, punctuation, non-ASCII, upper case, and texts longer than
# any usual max_length so truncation is exercised.
CHECK_SENTENCES: list[str] = [
    "",
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "What?!... No way -- really???",
    "KServe v2 inference protocol over HTTP and gRPC.",
    "Dynamic batching trades a little latency for much more throughput.",
    "Ünïcödé tëxt with àccents, 東京タワー, and emoji 🙂🚀.",
    "Москва — столица России.",
    "¿Dónde está la biblioteca?",
    "1234567890 3.14159 $100 50% #tag @user",
    "   leading and trailing whitespace   ",
    "A sentence about cats.",
    "A sentence about dogs.",
    "Stock markets fell sharply on Tuesday after the announcement.",
    "def f(x): return x ** 2  # some code",
    "https://example.com/path?query=1&other=two",
    "word " * 300,
    "This paragraph is deliberately long so that it exceeds the model's "
    "sequence limit and has to be truncated by the tokenizer. " * 20,
    " ".join(f"token{i}" for i in range(400)),
    "Short again.",
]


class ExportRefused(BatchlineError):
    """The folder is not one this module exports as it is; the message says what is supported or what to decide."""


class ExportCheckFailed(BatchlineError):
    """The exported graph does not compute what the original does; the message carries the figures."""


@dataclass(frozen=True)
class HfSource:
    """What a folder says about its model: enough to export it, tokenize for it and describe it."""

    folder: Path
    model_dir: Path  # config.json, the weights and tokenizer.json (a sentence-transformers folder's Transformer)
    kind: Kind
    architecture: str
    max_length: int
    token_inputs: tuple[str, ...]  # the graph's inputs, in TOKEN_INPUTS order
    pad_id: int
    dim: int  # embedding size, or the number of labels
    vocab_size: int
    pooling: str | None = None  # embeddings: mean, cls or max
    normalize: bool = False
    labels: tuple[str, ...] = ()  # classification: the label of each logit
    notes: tuple[str, ...] = ()  # what a user should know when serving it (prompts, similarity, problem type)

    @property
    def tokenizer_file(self) -> Path:
        return self.model_dir / "tokenizer.json"

    @property
    def output_name(self) -> str:
        return EMBEDDING_OUTPUT if self.kind == "embedding" else LOGITS_OUTPUT

    def tokenize_spec(self, text_input: str = "text") -> Tokenize:
        """The server's tokenization of this model (the check uses it too, so it checks what serves)."""
        return Tokenize(
            input=text_input,
            max_length=self.max_length,
            pad_id=self.pad_id,
            token_type_ids="token_type_ids" if "token_type_ids" in self.token_inputs else None,
            sequence_buckets=sequence_buckets(self.max_length),
        )

    def describe(self) -> str:
        if self.kind == "embedding":
            steps = f"{self.pooling} pooling" + (", normalised" if self.normalize else "")
            return f"sentence-transformers ({self.architecture}, {steps}, dim {self.dim})"
        return f"{self.architecture} ({self.dim} labels)"


def sequence_buckets(max_length: int) -> list[int]:
    """Powers of two from 16 below max_length, then max_length: little padding, few shapes."""
    return doubling(16, max_length)


# ---------------------------------------------------------------------------------------------
# Reading a folder: every refusal happens here, before any weight is loaded.


def read_folder(folder: Path, max_length: int | None = None) -> HfSource:
    """The model in `folder`, or ExportRefused saying why not. `max_length` overrides the folder's."""
    if (folder / "modules.json").is_file():
        return _sentence_transformers(folder, max_length)
    if (folder / "config.json").is_file():
        return _sequence_classification(folder, max_length)
    raise ExportRefused(f"{folder}: not a Hugging Face model folder (no modules.json, no config.json); "
                        f"this command imports {SUPPORTED}")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportRefused(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportRefused(f"{path}: cannot read it as JSON: {exc}") from exc


def _sentence_transformers(folder: Path, max_length: int | None) -> HfSource:
    modules = _read_json(folder / "modules.json")
    if not isinstance(modules, list) or not all(isinstance(m, dict) and "type" in m for m in modules):
        raise ExportRefused(f"{folder / 'modules.json'}: expected a list of modules, each with a type")
    modules = sorted(modules, key=lambda m: int(m.get("idx", 0)))
    kinds = [str(m["type"]).rsplit(".", 1)[-1] for m in modules]
    if kinds[:2] != ["Transformer", "Pooling"] or kinds[2:] not in ([], ["Normalize"]):
        raise ExportRefused(f"{folder}: the sentence-transformers pipeline is {' -> '.join(kinds)}; supported: "
                            "Transformer -> Pooling -> optional Normalize (another module would be left out of "
                            "the export). Export it to ONNX yourself and import the .onnx file")
    model_dir = folder / str(modules[0].get("path", ""))
    st_config = _read_json(model_dir / "sentence_bert_config.json") if (
        model_dir / "sentence_bert_config.json").is_file() else {}
    task = st_config.get("transformer_task", "feature-extraction")
    if task != "feature-extraction":
        raise ExportRefused(f"{folder}: its Transformer module runs the task {task!r}; supported: feature-extraction")
    pooling, dim = _pooling(folder / str(modules[1].get("path", "")) / "config.json")
    normalize = kinds[2:] == ["Normalize"]
    if normalize:
        norm_dir = folder / str(modules[2].get("path", ""))
        norm = _read_json(norm_dir / "config.json") if (norm_dir / "config.json").is_file() else {}
        if norm.get("module_input_name", EMBEDDING_OUTPUT) != EMBEDDING_OUTPUT:
            raise ExportRefused(f"{folder}: its Normalize module normalises {norm['module_input_name']!r}; "
                                "supported: the sentence embedding")
    notes = _prompt_notes(folder)
    facts = _transformer_facts(folder, model_dir, "embedding", max_length, st_config.get("max_seq_length"))
    if st_config.get("do_lower_case") and not _tokenizer_lowercases(model_dir / "tokenizer.json"):
        raise ExportRefused(f"{folder}: sentence_bert_config.json says do_lower_case, and sentence-transformers "
                            "lowercases each text before tokenizing, but tokenizer.json does not: the server would "
                            "see other tokens. Give tokenizer.json a Lowercase normalizer, or clients must send "
                            "lowercase text and you can remove do_lower_case")
    hidden = facts.pop("dim")
    if hidden != dim:
        raise ExportRefused(f"{folder}: the Pooling module expects {dim}-dim token embeddings, the model gives "
                            f"{hidden}: the folder's modules do not fit together")
    return HfSource(folder=folder, model_dir=model_dir, kind="embedding", pooling=pooling, normalize=normalize,
                    dim=dim, notes=notes, **facts)


def _pooling(path: Path) -> tuple[str, int]:
    """The one pooling mode of a Pooling module's config (its current format or the older one) and its dim."""
    config = _read_json(path)
    include_prompt = config.get("include_prompt", True)
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        modes = [mode] if isinstance(mode, str) else list(mode)
    else:  # older sentence-transformers: one boolean per mode; none set means mean, as it reads them
        modes = [mode for key, mode in _LEGACY_POOLING_KEYS.items() if config.get(key)] or ["mean"]
    if len(modes) != 1:
        raise ExportRefused(f"{path}: the Pooling module concatenates {', '.join(modes)}; supported: one pooling "
                            f"mode of {', '.join(POOLING_MODES)}")
    if modes[0] not in POOLING_MODES:
        raise ExportRefused(f"{path}: pooling mode {modes[0]!r} is not supported; supported pooling modes: "
                            f"{', '.join(POOLING_MODES)}")
    if not include_prompt:
        raise ExportRefused(f"{path}: include_prompt is false (the prompt's tokens are left out of the pooling), "
                            "which the server cannot do: it does not tell a prompt from the text")
    dim = config.get("embedding_dimension", config.get("word_embedding_dimension"))
    if not isinstance(dim, int) or dim <= 0:
        raise ExportRefused(f"{path}: no embedding dimension (embedding_dimension or word_embedding_dimension)")
    return modes[0], dim


def _prompt_notes(folder: Path) -> tuple[str, ...]:
    """Prompts the server does not add: a default one is refused, named ones are noted for clients."""
    path = folder / "config_sentence_transformers.json"
    config = _read_json(path) if path.is_file() else {}
    prompts = {str(k): str(v) for k, v in (config.get("prompts") or {}).items()}
    default = config.get("default_prompt_name")
    if default:
        raise ExportRefused(
            f"{path}: sentence-transformers prepends the prompt {default!r} ({prompts.get(default, '')!r}) to every "
            "text by default; the server sends each text to the model as it comes. To have clients send prompts "
            "themselves, set default_prompt_name to null there and import again")
    notes = []
    named = {k: v for k, v in prompts.items() if v}
    if named:
        notes.append("clients add the prompt the model was trained with to each text: "
                     + ", ".join(f"{k} {json.dumps(v, ensure_ascii=False)}" for k, v in named.items()))
    if config.get("similarity_fn_name"):
        notes.append(f"compare embeddings by {config['similarity_fn_name']}, as the model was trained")
    return tuple(notes)


def _tokenizer_lowercases(path: Path) -> bool:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    return bool(tokenizer.encode("ABC Xyz").ids == tokenizer.encode("abc xyz").ids)


def _sequence_classification(folder: Path, max_length: int | None) -> HfSource:
    config = _read_json(folder / "config.json")
    _refuse_remote_code(folder / "config.json", config)
    architectures = config.get("architectures") or []
    if len(architectures) != 1 or not str(architectures[0]).endswith("ForSequenceClassification"):
        named = ", ".join(map(str, architectures)) or "none"
        hint = ""
        if len(architectures) == 1 and str(architectures[0]).endswith("Model"):
            hint = (" (a bare encoder: without sentence-transformers' modules.json its pooling is unknown; save it "
                    "with sentence-transformers to say which)")
        raise ExportRefused(f"{folder}: config.json names the architecture {named}{hint}; this command imports "
                            f"{SUPPORTED}")
    facts = _transformer_facts(folder, folder, "classification", max_length, None)
    id2label = config.get("id2label") or {}
    count = int(facts.pop("dim"))
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count))
    notes = []
    problem = config.get("problem_type")
    if problem == "multi_label_classification":
        notes.append("trained multi-label: apply a sigmoid to each logit")
    elif problem == "single_label_classification":
        notes.append("trained single-label: a softmax over the logits gives probabilities")
    elif problem == "regression":
        notes.append("trained as a regression: the logits are the predicted values")
    return HfSource(folder=folder, model_dir=folder, kind="classification", dim=count, labels=labels,
                    notes=tuple(notes), **facts)


def _refuse_remote_code(path: Path, config: dict[str, Any]) -> None:
    if config.get("auto_map"):
        raise ExportRefused(f"{path}: the model needs its own code (auto_map), which this command does not run; "
                            "export it to ONNX yourself and import the .onnx file")


def _transformer_facts(
    folder: Path, model_dir: Path, kind: Kind, asked: int | None, st_max_length: int | None
) -> dict[str, Any]:
    """Architecture, token inputs, padding, length and output size, read without loading weights."""
    config_path = model_dir / "config.json"
    raw = _read_json(config_path)
    _refuse_remote_code(config_path, raw)
    tokenizer_config = model_dir / "tokenizer_config.json"
    if tokenizer_config.is_file():
        _refuse_remote_code(tokenizer_config, _read_json(tokenizer_config))
    if not (model_dir / "tokenizer.json").is_file():
        raise ExportRefused(
            f"{model_dir}: no tokenizer.json. The server tokenizes with a fast tokenizer's tokenizer.json; "
            "transformers writes one for most slow tokenizers: python -c \"from transformers import AutoTokenizer; "
            f"AutoTokenizer.from_pretrained('{model_dir}').save_pretrained('{model_dir}')\"")
    weights = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
    if not any((model_dir / w).is_file() for w in weights):
        raise ExportRefused(f"{model_dir}: no weights ({', '.join(weights)})")

    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
        MODEL_MAPPING,
    )

    try:
        config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises ValueError, KeyError, OSError for configs it cannot read
        raise ExportRefused(f"{config_path}: transformers {package_version('transformers')} cannot read it: {exc}") from exc
    mapping = MODEL_MAPPING if kind == "embedding" else MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING
    try:
        classes = mapping[type(config)]
    except KeyError:
        raise ExportRefused(f"{config_path}: transformers has no {'encoder' if kind == 'embedding' else 'sequence-classification'} "
                            f"model for model_type {config.model_type!r}") from None
    model_class = _model_class(classes, getattr(config, "architectures", None) or [])
    parameters = inspect.signature(model_class.forward).parameters
    if "attention_mask" not in parameters:
        raise ExportRefused(f"{config_path}: {model_class.__name__} takes no attention_mask, so padded batches "
                            "would change its answers")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # as above: many types for a tokenizer transformers cannot build
        raise ExportRefused(f"{model_dir}: transformers cannot load its tokenizer: {exc}") from exc
    if tokenizer.pad_token_id is None:
        raise ExportRefused(f"{model_dir}: the tokenizer has no padding token, which batches need: set pad_token in "
                            "tokenizer_config.json (and the model's pad_token_id) to a token the model knows")
    # token_type_ids only where the model reads them and its tokenizer gives them (BERT); a model
    # whose tokenizer does not (RoBERTa) gets its own default, as in transformers.
    inputs = ["input_ids", "attention_mask"]
    if "token_type_ids" in parameters and "token_type_ids" in tokenizer.model_input_names:
        inputs.append("token_type_ids")
    positions = getattr(config, "max_position_embeddings", None)
    length = _max_length(folder, asked, st_max_length, tokenizer.model_max_length, positions)
    dim = config.hidden_size if kind == "embedding" else config.num_labels
    return {"architecture": model_class.__name__, "max_length": length, "token_inputs": tuple(inputs),
            "pad_id": int(tokenizer.pad_token_id), "dim": int(dim), "vocab_size": int(config.vocab_size)}


def _model_class(classes: Any, architectures: list[str]) -> Any:
    """The class transformers' Auto classes build: a model type may map to a few (funnel: the
    full and the base model), and then the first the config's `architectures` names wins, else
    the first."""
    if not isinstance(classes, (tuple, list)):
        return classes
    named = {c.__name__: c for c in classes if c is not None}
    return next((named[a] for a in architectures if a in named), classes[0])


def _max_length(folder: Path, asked: int | None, st_max: int | None, tokenizer_max: int | None,
                positions: int | None) -> int:
    """The folder's token window (sentence-transformers' max_seq_length, else the tokenizer's), or
    --max-length; a question when there is none or it exceeds the model's positions."""
    limit = f" (at most {positions}, the model's max_position_embeddings)" if positions else ""
    if asked is not None:
        if asked <= 0 or (positions and asked > positions):
            raise ExportRefused(f"--max-length {asked}: give a positive number of tokens{limit}")
        return asked
    found = st_max if st_max else (tokenizer_max if tokenizer_max and tokenizer_max < _NO_LENGTH else None)
    if found is None:
        raise ExportRefused(f"{folder}: the folder does not say how many tokens the model reads (no max_seq_length, "
                            f"no model_max_length in tokenizer_config.json): give --max-length N{limit}")
    if positions and found > positions:
        raise ExportRefused(f"{folder}: its tokenizer reads up to {found} tokens but the model has "
                            f"{positions} positions: give --max-length N{limit}")
    return int(found)


# ---------------------------------------------------------------------------------------------
# The graph: the transformers module plus what sentence-transformers adds after it.


class SentenceEncoder(torch.nn.Module):
    """Encoder + masked pooling (+ L2 norm): sentence-transformers' pipeline as one module, so the
    server needs no post-step."""

    def __init__(self, encoder: torch.nn.Module, pooling: str = "mean", normalize: bool = True) -> None:
        super().__init__()
        if pooling not in POOLING_MODES:
            raise ValueError(f"pooling {pooling!r}: expected one of {POOLING_MODES}")
        self.encoder = encoder
        self.pooling = pooling
        self.normalize = normalize

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        tokens = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            tokens["token_type_ids"] = token_type_ids
        hidden = self.encoder(**tokens).last_hidden_state
        pooled = pool(hidden, attention_mask, self.pooling)
        return torch.nn.functional.normalize(pooled, p=2.0, dim=1) if self.normalize else pooled


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """sentence-transformers' pooling of right-padded tokens (the server pads on the right)."""
    if mode == "cls":
        return hidden[:, 0]
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "max":
        return hidden.masked_fill(mask == 0, float("-inf")).max(dim=1).values
    summed = (hidden * mask).sum(dim=1)
    counts = mask.sum(dim=1).clamp(min=1e-9)  # same clamp as sentence-transformers
    return summed / counts


class SequenceClassifier(torch.nn.Module):
    """A *ForSequenceClassification model that returns its logits tensor alone."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        tokens = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            tokens["token_type_ids"] = token_type_ids
        return self.model(**tokens).logits


def load_module(source: HfSource) -> torch.nn.Module:
    """The source's weights in fp32, wrapped as the graph to export, in eval mode."""
    import transformers
    from transformers import AutoModel, AutoModelForSequenceClassification

    transformers.logging.set_verbosity_error()  # the weight-loading bar and notes nobody can act on
    transformers.utils.logging.disable_progress_bar()
    loader = AutoModel if source.kind == "embedding" else AutoModelForSequenceClassification
    try:
        model = loader.from_pretrained(str(source.model_dir), dtype=torch.float32, local_files_only=True,
                                       trust_remote_code=False)
    except Exception as exc:  # damaged or partial weights: many types
        raise ExportRefused(f"{source.model_dir}: transformers cannot load the model: {exc}") from exc
    if source.kind == "embedding":
        return SentenceEncoder(model, source.pooling or "mean", source.normalize).eval()
    return SequenceClassifier(model).eval()


def export_onnx(
    module: torch.nn.Module,
    path: Path,
    input_names: Sequence[str] = TOKEN_INPUTS,
    output_name: str = EMBEDDING_OUTPUT,
    vocab_size: int = 2000,
    verbose: bool = True,
) -> None:
    """Export with the dynamo exporter, batch and sequence both dynamic, one file.

    dynamo=True rather than the TorchScript tracer: the tracer bakes Python-side shape checks in
    transformers' masking code into constants (TracerWarnings), and leaves output dims symbolic.
    """
    for noisy in ("torchao", "torch.utils._pytree", "torch.onnx._internal.exporter._registration"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    batch = torch.export.Dim("batch")
    sequence = torch.export.Dim("sequence")
    # Example with real padding in row 1, so the masked path is what is traced.
    low, high = (1000, 2000) if vocab_size >= 2000 else (0, vocab_size)
    example = {
        "input_ids": torch.randint(low, high, (2, 16), dtype=torch.int64),
        "attention_mask": torch.ones(2, 16, dtype=torch.int64),
        "token_type_ids": torch.zeros(2, 16, dtype=torch.int64),
    }
    example["attention_mask"][1, 10:] = 0
    axes = {0: batch, 1: sequence}
    with warnings.catch_warnings():
        # Uninformative noise from the exporter (axis renaming, pytree deprecations).
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        torch.onnx.export(
            module,
            tuple(example[name] for name in input_names),
            str(path),
            input_names=list(input_names),
            output_names=[output_name],
            dynamic_shapes={name: axes for name in input_names},
            dynamo=True,
            external_data=False,
            verbose=verbose,
        )


def export_source(source: HfSource, path: Path, say: Say | None = None) -> torch.nn.Module:
    """Load and export `source` to `path`; returns the module (the fallback reference of the check)."""
    module = load_module(source)
    (say or _quiet)(f"exporting {source.describe()} to ONNX (dynamo exporter; tens of seconds for a small model) ...")
    try:
        export_onnx(module, path, source.token_inputs, source.output_name, source.vocab_size, verbose=False)
    except Exception as exc:  # the exporter fails in many ways on graphs it cannot express
        raise ExportRefused(f"{source.folder}: torch {torch.__version__} cannot export it to ONNX: "
                            f"{type(exc).__name__}: {exc}") from exc
    return module


def _quiet(_: str) -> None:
    pass


# ---------------------------------------------------------------------------------------------
# The check: the exported graph, fed by the server's tokenizer, against the original.


@dataclass
class CheckReport:
    """The figures of one check; `lines` say them for people, `passed` whether the export may publish."""

    reference: str
    passed: bool = True
    lines: list[str] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)

    def fail(self, line: str) -> None:
        self.passed = False
        self.lines.append(f"FAIL: {line}")


def _session(path: Path) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _run_graph(
    session: Any, tokenizer: TextTokenizer, output: str, sentences: list[str], report: CheckReport, max_length: int
) -> tuple[np.ndarray, np.ndarray]:
    """The graph's outputs for `sentences` in one padded batch and one at a time."""
    feed = tokenizer.encode(sentences)
    longest = feed[tokenizer.spec.input_ids].shape[1]
    report.lines.append(f"padded batch shape {feed[tokenizer.spec.input_ids].shape} (max_length {max_length})")
    report.figures["padded_length"] = float(longest)
    if longest > max_length:
        report.fail(f"the tokenizer gave {longest} tokens, more than max_length {max_length}")
    batched = session.run([output], feed)[0]
    single = np.concatenate([session.run([output], tokenizer.encode([s]))[0] for s in sentences])
    return batched, single


def check_embeddings(
    source: HfSource,
    onnx_path: Path,
    tokenizer_path: Path,
    reference_module: torch.nn.Module | None = None,
    sentences: list[str] | None = None,
) -> CheckReport:
    """Cosine per text of the graph's embeddings against sentence-transformers' (when installed),
    else against `reference_module` run by transformers' own tokenizer: >= MIN_COSINE, batched and
    one at a time, and the output fp32 of the declared dim. The graph is fed by the server's own
    tokenizer, reading `tokenizer_path`."""
    sentences = sentences or CHECK_SENTENCES
    if find_spec("sentence_transformers") is not None:
        reference = f"sentence-transformers {package_version('sentence-transformers')}"
        expected = _sentence_transformers_embeddings(source, sentences)
    elif reference_module is not None:
        reference = (f"transformers {package_version('transformers')} + {source.pooling} pooling in torch "
                     "(sentence-transformers is not installed)")
        expected = _torch_outputs(source, reference_module, sentences)
    else:
        raise ExportCheckFailed("sentence-transformers is not installed and no torch module was given to check against")
    report = CheckReport(reference=reference)
    batched, single = _run_graph(_session(onnx_path), _server_tokenizer(source, tokenizer_path), source.output_name,
                                 sentences, report, source.max_length)
    if batched.dtype != np.float32 or batched.shape != (len(sentences), source.dim):
        report.fail(f"output {batched.dtype} {batched.shape}, expected float32 {(len(sentences), source.dim)}")
        return report
    for label, got in (("batched", batched), ("one at a time", single)):
        cosines = _row_cosines(got, expected)
        worst = float(np.nan_to_num(cosines, nan=-1.0).min())
        report.figures[f"{label} min cosine"] = worst
        line = f"{label:14s} cosine vs {reference.split(' (')[0]}: mean {cosines.mean():.7f} min {worst:.7f}"
        if worst >= MIN_COSINE:
            report.lines.append(line)
        else:
            report.fail(f"{line} (needs >= {MIN_COSINE})")
    return report


def check_logits(
    source: HfSource,
    onnx_path: Path,
    tokenizer_path: Path,
    reference_module: torch.nn.Module,
    sentences: list[str] | None = None,
) -> CheckReport:
    """Largest absolute logit difference against the transformers module (<= MAX_LOGIT_DIFF),
    batched and one at a time, and the same argmax wherever the reference's top two logits are
    further apart than that."""
    sentences = sentences or CHECK_SENTENCES
    reference = f"transformers {package_version('transformers')} ({source.architecture})"
    expected = _torch_outputs(source, reference_module, sentences)
    report = CheckReport(reference=reference)
    batched, single = _run_graph(_session(onnx_path), _server_tokenizer(source, tokenizer_path),
                                 source.output_name, sentences, report, source.max_length)
    if batched.dtype != np.float32 or batched.shape != (len(sentences), source.dim):
        report.fail(f"output {batched.dtype} {batched.shape}, expected float32 {(len(sentences), source.dim)}")
        return report
    ordered = np.sort(expected, axis=1)
    decided = (ordered[:, -1] - ordered[:, -2] > MAX_LOGIT_DIFF) if source.dim > 1 else np.zeros(len(expected), bool)
    for label, got in (("batched", batched), ("one at a time", single)):
        diff = float(np.nan_to_num(np.abs(got - expected), nan=np.inf).max())
        same = int((got.argmax(axis=1) == expected.argmax(axis=1))[decided].sum())
        report.figures[f"{label} max abs diff"] = diff
        line = (f"{label:14s} logits vs {reference}: max abs diff {diff:.2e}, argmax equal on {same}/"
                f"{int(decided.sum())} texts (ties within {MAX_LOGIT_DIFF:g} left out)")
        if diff <= MAX_LOGIT_DIFF and same == int(decided.sum()):
            report.lines.append(line)
        else:
            report.fail(f"{line} (needs max abs diff <= {MAX_LOGIT_DIFF:g} and every argmax equal)")
    return report


def check_export(source: HfSource, onnx_path: Path, tokenizer_path: Path, module: torch.nn.Module) -> CheckReport:
    """The check of `source`'s kind; raises ExportCheckFailed with the figures when it fails."""
    try:
        if source.kind == "embedding":
            report = check_embeddings(source, onnx_path, tokenizer_path, module)
        else:
            report = check_logits(source, onnx_path, tokenizer_path, module)
    except BatchlineError:
        raise
    except Exception as exc:  # the original or the graph failed to run: no figures, but no publishing either
        raise ExportCheckFailed(f"the check of the ONNX export of {source.folder} could not run ({type(exc).__name__}: "
                                f"{exc}); nothing was written") from exc
    if not report.passed:
        raise ExportCheckFailed(f"the ONNX export of {source.folder} does not match {report.reference}; nothing "
                                "was written:\n  " + "\n  ".join(report.lines))
    return report


def _server_tokenizer(source: HfSource, path: Path) -> TextTokenizer:
    """The tokenizer the server will build from the drafted config, reading `path`."""
    return TextTokenizer(source.tokenize_spec().model_copy(update={"tokenizer": path.name}), path.parent)


def _sentence_transformers_embeddings(source: HfSource, sentences: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(source.folder), device="cpu", local_files_only=True, trust_remote_code=False)
    model.max_seq_length = source.max_length
    return np.asarray(model.encode(sentences, convert_to_numpy=True, batch_size=32), dtype=np.float32)


def _torch_outputs(source: HfSource, module: torch.nn.Module, sentences: list[str]) -> np.ndarray:
    """`module` in torch on transformers' own tokenization (not the server's): one padded batch."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source.model_dir), local_files_only=True, trust_remote_code=False)
    tokens = tokenizer(sentences, padding=True, truncation=True, max_length=source.max_length, return_tensors="pt")
    with torch.inference_mode():
        out = module(**{name: tokens[name] for name in source.token_inputs})
    return out.float().numpy()


def _row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine per row; not assuming either side is exactly unit norm."""
    return np.asarray((a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)))
