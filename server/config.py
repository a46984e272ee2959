"""The model-configuration schema.

A model is described by `models/<name>/config.yaml`; the schema keeps Triton's names and meanings
(max_batch_size, dynamic_batching, instance_group, version_policy) so a Triton user feels at home.
Every config is validated here, and a bad one is reported with its file, field and reason.
"""

from __future__ import annotations

from pathlib import Path
from types import UnionType
from typing import Annotated, Literal, Union, get_args, get_origin

import numpy as np
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from server.errors import ConfigError
from server.ladder import batch_ladder
from server.protocol.datatypes import DATATYPES, numpy_dtype

EngineName = Literal["onnxruntime", "torch", "tensorrt"]  # the keys of server.engines.registry.ENGINES
Precision = Literal["fp32", "fp16", "bf16", "int8"]
DeviceKind = Literal["CPU", "GPU"]
MAX_PRIORITY_LEVELS = 100
MAX_INSTANCES = 128  # of a model version, over all its instance groups
# An engine's threads, per instance: more than any machine's cores one instance could use. A load
# that asked for 5,000 took 85 s and left the server with 5,016 threads; 100,000 crashed it.
MAX_ENGINE_THREADS = 256


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_truth_for_a_number(cls, value: object, info: ValidationInfo) -> object:
        """`max_batch_size: true` (or YAML's `yes`) was read as 1, and `dims: [true]` as [1]: a
        number, or a list of numbers, takes numbers."""
        if info.field_name is None:
            return value
        number, listed = _number_field(cls.model_fields[info.field_name].annotation)
        if number and (isinstance(value, bool) if not listed
                       else isinstance(value, list) and any(isinstance(v, bool) for v in value)):
            raise ValueError("expected a number, not true or false")
        return value


def _number_field(annotation: object) -> tuple[bool, bool]:
    """Whether a field holds a number (None aside), and whether as a list of them."""
    options = [annotation]
    if get_origin(annotation) in (Union, UnionType):
        options = [a for a in get_args(annotation) if a is not type(None)]
    if len(options) != 1:
        return False, False
    (kind,) = options
    if get_origin(kind) is list:
        (item,) = get_args(kind) or (None,)
        item = get_args(item)[0] if get_origin(item) is Annotated else item
        return item in (int, float), True
    return kind in (int, float), False


def _in_version_folder(value: str) -> str:
    """A file name a config gives for its version folder: relative, and inside it. A config can
    also arrive over the control plane (a load's override), which must not point the server at
    any other file on the machine (an artifact is code: a torch program unpickles)."""
    path = Path(value)
    if not value or path.is_absolute() or ".." in path.parts or "\\" in value or "\x00" in value:
        raise ValueError(f"{value!r} must name a file inside the version folder (a relative path, no '..')")
    return value


class TensorConfig(_Strict):
    """One input or output. `dims` excludes the batch dimension; -1 marks a variable dim."""

    name: str = Field(min_length=1)
    datatype: str
    dims: list[int]
    engine_name: str | None = Field(
        default=None, description="The tensor's name inside the engine, when it differs."
    )
    pad_value: float | None = Field(
        default=None,
        description="Inputs only: requests whose variable dims differ batch together, padded with this.",
    )

    @field_validator("datatype")
    @classmethod
    def _known_datatype(cls, value: str) -> str:
        if value not in DATATYPES:
            raise ValueError(f"unknown datatype {value!r}; expected one of {', '.join(DATATYPES)}")
        return value

    @field_validator("dims")
    @classmethod
    def _valid_dims(cls, value: list[int]) -> list[int]:
        if any(d == 0 or d < -1 for d in value):
            raise ValueError(f"dims must be positive or -1 (variable), got {value}")
        return value

    @property
    def source_name(self) -> str:
        """The name the engine knows this tensor by."""
        return self.engine_name or self.name


class QueuePolicy(_Strict):
    """Triton's default_queue_policy: how long a request may wait and how many may wait."""

    max_queue_size: int = Field(default=0, ge=0, description="Queued requests allowed; 0 is unbounded.")
    default_timeout_microseconds: int = Field(default=0, ge=0, description="0: no deadline.")
    allow_timeout_override: bool = True
    timeout_action: Literal["REJECT"] = "REJECT"


class DynamicBatching(_Strict):
    """Triton's dynamic_batching block, plus a token budget for text models."""

    max_queue_delay_microseconds: int = Field(default=0, ge=0)
    preferred_batch_size: list[Annotated[int, Field(gt=0)]] = Field(default_factory=list)
    preserve_ordering: bool = False
    # Each level is a queue every dispatch looks at: a bound keeps a config from stalling the loop.
    priority_levels: int = Field(default=0, ge=0, le=MAX_PRIORITY_LEVELS,
                                 description="0 or 1: one level. Level 1 is the highest.")
    default_priority_level: int = Field(default=0, ge=0)
    default_queue_policy: QueuePolicy = Field(default_factory=QueuePolicy)
    max_batch_tokens: int | None = Field(
        default=None, gt=0, description="Cap on padded tokens per batch (items x longest sequence)."
    )

    @model_validator(mode="after")
    def _priority_in_range(self) -> DynamicBatching:
        levels = max(self.priority_levels, 1)
        if self.default_priority_level > levels:
            raise ValueError(f"default_priority_level {self.default_priority_level} is not within 1..{levels}")
        return self

    @property
    def levels(self) -> int:
        return max(self.priority_levels, 1)

    @property
    def default_level(self) -> int:
        """Triton's default is the lowest priority when levels exist but no default is set."""
        return self.default_priority_level or self.levels


class InstanceGroup(_Strict):
    """N copies of the model on a device kind; each copy runs its own batches."""

    count: int = Field(default=1, ge=1, le=64)
    kind: DeviceKind = "CPU"
    gpus: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, min_length=1)

    @field_validator("kind", mode="before")
    @classmethod
    def _accept_triton_kind(cls, value: object) -> object:
        if isinstance(value, str) and value.upper().startswith("KIND_"):
            return value.upper().removeprefix("KIND_")
        return value.upper() if isinstance(value, str) else value


class LatestVersions(_Strict):
    num_versions: int = Field(default=1, ge=1)


class SpecificVersions(_Strict):
    versions: list[Annotated[int, Field(ge=1)]] = Field(min_length=1)


class VersionPolicy(_Strict):
    """Which version folders are served: the latest N (default 1), all, or a specific list."""

    latest: LatestVersions | None = None
    all: dict[str, object] | None = None
    specific: SpecificVersions | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> VersionPolicy:
        chosen = [k for k in ("latest", "all", "specific") if getattr(self, k) is not None]
        if len(chosen) > 1:
            raise ValueError(f"choose one of latest, all, specific; got {', '.join(chosen)}")
        return self

    def select(self, available: list[int]) -> list[int]:
        """The versions to serve out of those present on disk, ascending."""
        ordered = sorted(available)
        if self.all is not None:
            return ordered
        if self.specific is not None:
            return [v for v in ordered if v in self.specific.versions]
        count = self.latest.num_versions if self.latest is not None else 1
        return ordered[-count:]


class Tokenize(_Strict):
    """Pre-processing for text models: UTF-8 strings in, token tensors out.

    Each request is tokenized at admission (so the batcher knows its cost in tokens). With
    `sequence_buckets`, requests batch only with others of the same length bucket, so padding
    waste stays small; an engine compiled per shape gets them padded to the bucket (a few fixed
    shapes), any other engine to the batch's longest (but a single bucket is one fixed length,
    padded to by every engine). Without, any texts share a batch, padded to its longest.
    """

    input: str = Field(description="The BYTES input holding the text, one string per item.")
    tokenizer: str = Field(default="tokenizer.json", description="File in the version folder.")

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_inside(cls, value: str) -> str:
        return _in_version_folder(value)
    max_length: int = Field(default=512, gt=0)
    input_ids: str = "input_ids"
    attention_mask: str | None = "attention_mask"
    token_type_ids: str | None = "token_type_ids"
    pad_id: int = 0
    sequence_buckets: list[Annotated[int, Field(gt=0)]] | None = None

    @model_validator(mode="after")
    def _buckets_cover_max_length(self) -> Tokenize:
        buckets = self.sequence_buckets
        if buckets is not None:
            if sorted(set(buckets)) != buckets:
                raise ValueError(f"sequence_buckets must be strictly increasing, got {buckets}")
            if buckets[-1] != self.max_length:
                raise ValueError(f"the last sequence bucket must equal max_length {self.max_length}")
        return self

    def bucket(self, length: int) -> int:
        """The padded length of a sequence of `length` tokens."""
        if self.sequence_buckets is None:
            return length
        return next(b for b in self.sequence_buckets if b >= length)


class Preprocess(_Strict):
    tokenize: Tokenize | None = None


class OpenAIServing(_Strict):
    """Serve this model on the OpenAI-compatible routes (/v1) as well as KServe v2.

    `embeddings`: a text model (preprocess.tokenize) whose output is one vector per text.
    `matryoshka_dimensions` lists the shorter lengths a Matryoshka-trained model keeps its
    meaning at; a request's `dimensions` must be one of them (or the full length), and the
    truncated vector is re-normalized. Leave it out for other models: their prefixes are not
    embeddings, so `dimensions` is refused.
    """

    task: Literal["embeddings"]
    output: str | None = Field(default=None, description="The output holding the embedding (default: the only one).")
    matryoshka_dimensions: list[Annotated[int, Field(gt=0)]] | None = Field(default=None, min_length=1)

    @field_validator("matryoshka_dimensions")
    @classmethod
    def _increasing(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and sorted(set(value)) != value:
            raise ValueError(f"matryoshka_dimensions must be strictly increasing, got {value}")
        return value


WarmupValue = bool | int | float | str
# A batch profile must end: a load holds its model (reload, unload) and other models' profiles
# until it does, and a server told to stop waits for it. A billion repeats once held a load (and
# a core) for good, and SIGTERM with it. The passes also stop after 30 s (server/model.py).
MAX_PROFILE_REPEATS = 100


class Warmup(_Strict):
    """Synthetic batches run on every instance before the model reports ready.

    Every element of an input is the same value: its entry in `inputs` (as Triton's model_warmup
    gives input data), else `text` for BYTES inputs and zero for the others. A model that reads
    its strings (numbers as text, say) needs values it can parse.

    With `profile`, every batch size of the ladder (the engine's `batch_buckets`, else powers of
    two up to max_batch_size) is timed; unless `batch_cap` fixes it, the batcher's cap becomes
    the smallest size within `tolerance` of the best throughput, where more batch stops paying.
    """

    enabled: bool = True
    batch_sizes: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [1])
    text: str = "Batchline warms up this model before it serves."
    inputs: dict[str, WarmupValue] = Field(
        default_factory=dict, description="Input name -> the value every element of that input holds."
    )
    profile: bool = False
    profile_repeats: int = Field(
        default=5, ge=1, le=MAX_PROFILE_REPEATS,
        description="Timed passes over the batch ladder; passes stop early once 30 s have gone.",
    )
    tolerance: float = Field(default=0.05, ge=0, lt=1)
    batch_cap: int | None = Field(default=None, gt=0, description="Fix the cap instead of measuring it.")


class OrtTensorrtOptions(_Strict):
    """ONNX Runtime's TensorRT execution provider: TensorRT without a separate plan build.

    Used when `execution_providers` lists TensorrtExecutionProvider on a GPU instance. TensorRT
    builds its engines when the session starts (warm-up), with one optimization profile spanning
    the batch buckets, and caches them under $BATCHLINE_TENSORRT_CACHE/ort/<key of the artifact,
    options, GPU and versions>.
    """

    fp16: bool = Field(default=False, description="trt_fp16_enable: TensorRT may pick FP16 kernels.")
    int8: bool = Field(
        default=False,
        description="trt_int8_enable, for a graph with Q/DQ nodes (an onnxruntime int8 static build):"
        " explicit quantization, no calibration table.",
    )
    workspace_mb: int = Field(default=4096, gt=0)
    engine_cache: bool = Field(default=True, description="Reuse engines across restarts.")
    timing_cache: bool = Field(default=True, description="Reuse kernel timings across engine builds.")
    explicit_profiles: bool = Field(
        default=True,
        description="One profile from the smallest batch bucket to the largest, tuned at the largest"
        " (trt_profile_*_shapes); false lets ORT derive profiles from the shapes it meets, rebuilding"
        " engines as new ones arrive.",
    )


class OnnxRuntimeOptions(_Strict):
    execution_providers: list[str] = Field(default_factory=lambda: ["CPUExecutionProvider"])
    tensorrt: OrtTensorrtOptions = Field(default_factory=OrtTensorrtOptions)
    intra_op_num_threads: int = Field(default=0, ge=0, le=MAX_ENGINE_THREADS)
    inter_op_num_threads: int = Field(default=0, ge=0, le=MAX_ENGINE_THREADS)
    graph_optimization_level: Literal["disable", "basic", "extended", "all"] = "all"
    cudnn_conv_algo_search: Literal["HEURISTIC", "EXHAUSTIVE", "DEFAULT"] = Field(
        default="HEURISTIC",
        description="How the CUDA provider picks cuDNN convolution algorithms: HEURISTIC (cuDNN's own pick),"
        " EXHAUSTIVE (times every algorithm at each new input shape: the first batch of a new size stalls,"
        " unless warm-up ran that size), DEFAULT (cuDNN's default algorithm, no search).",
    )


class TorchOptions(_Strict):
    num_threads: int = Field(default=0, ge=0, le=MAX_ENGINE_THREADS)
    compile: bool = Field(
        default=False,
        description="torch.compile the program once per bucket (each batch bucket, times each sequence bucket"
        " of a text model) at warm-up, one compile at a time in the process (needs batch_buckets).",
    )
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        default="default",
        description="torch.compile's mode. reduce-overhead records a CUDA graph per bucket on a GPU (launch"
        " overhead gone, device memory held per bucket); max-autotune also times kernel variants (long"
        " compiles). On the CPU there are no CUDA graphs: reduce-overhead compiles as default does.",
    )

    @model_validator(mode="after")
    def _mode_needs_compile(self) -> TorchOptions:
        if self.compile_mode != "default" and not self.compile:
            raise ValueError(f"compile_mode {self.compile_mode!r} needs compile: true")
        return self


class RecordTraffic(_Strict):
    """Opt-in: keep a bounded, uniform sample of the inputs clients send, for builds to calibrate
    and be judged on (written to the model's eval/recorded.npz). It holds user data."""

    max_items: int = Field(default=512, gt=0, le=100_000, description="Items kept (a uniform sample of those seen).")
    max_bytes: int = Field(default=64 << 20, gt=0, description="Bytes of inputs kept in memory, at most.")
    max_per_second: float = Field(default=10.0, gt=0, description="Requests considered per second, at most.")
    write_every_seconds: float = Field(default=60.0, gt=0, description="How often the sample is written.")


class BuildGate(_Strict):
    """Quality a build must keep against its FP32 source before its version may serve."""

    enforce: bool = Field(default=True, description="false: publish a build even when the gate fails.")
    min_accuracy_ratio: float = Field(default=0.99, gt=0, le=1, description="Classifiers: accuracy >= this x FP32's.")
    min_mean_cosine: float = Field(default=0.99, ge=-1, le=1, description="Embeddings: mean cosine vs FP32.")
    min_neighbour_agreement: float = Field(default=0.94, ge=0, le=1, description="Embeddings: same nearest neighbour.")
    kind: Literal["auto", "classification", "embedding", "tensor"] = Field(
        default="auto",
        description="What is judged: auto follows the data (labels: classification; a model serving OpenAI "
        "embeddings: embedding; else tensor).",
    )
    min_top1_agreement: float = Field(
        default=0.98, ge=0, le=1, description="Classifiers without labels: same top class as FP32 on this share."
    )
    max_mean_relative_error: float = Field(
        default=0.02, gt=0, description="Tensor outputs: mean over items of |build - FP32| / |FP32|."
    )


class BuildSpec(_Strict):
    """How a variant was (or is to be) built from another model (`batchline build`, server/quantize)."""

    source: str = Field(min_length=1, description="The model this variant is built from, in the same repository.")
    engine: EngineName
    precision: Precision
    device: Literal["cpu", "gpu"] = Field(
        default="cpu",
        description="Where the build is evaluated and timed, and so where it serves (gpu: GPU 0, GPU instances).",
    )
    options: dict[str, bool | int | float | str] = Field(default_factory=dict)
    gate: BuildGate = Field(default_factory=BuildGate)


class ModelConfig(_Strict):
    """The schema of `models/<name>/config.yaml`."""

    name: str = Field(min_length=1)
    engine: EngineName
    precision: Precision = "fp32"
    model_filename: str | None = Field(
        default=None, description="Artifact in each version folder (default per engine)."
    )

    @field_validator("model_filename")
    @classmethod
    def _artifact_inside(cls, value: str | None) -> str | None:
        return None if value is None else _in_version_folder(value)
    max_batch_size: int = Field(default=0, ge=0)
    batch_buckets: list[Annotated[int, Field(gt=0)]] | None = Field(
        default=None,
        description="Batch sizes a compiled engine was built for; batches are padded up to one.",
    )
    inputs: list[TensorConfig] = Field(min_length=1)
    outputs: list[TensorConfig] = Field(min_length=1)
    dynamic_batching: DynamicBatching | None = None
    instance_group: list[InstanceGroup] = Field(default_factory=lambda: [InstanceGroup()])
    version_policy: VersionPolicy = Field(default_factory=VersionPolicy)
    warmup: Warmup = Field(default_factory=Warmup)
    execution_timeout_seconds: float = Field(
        default=30,
        ge=0,
        description="The watchdog of one engine run on an instance: past it, the batch's requests fail and the"
        " stuck instance is replaced by a fresh one. 0 disables it (an unload then waits for a stuck batch)."
        " 30 s keeps a shutdown within the deploy manifests' 60 s grace period.",
    )
    max_item_bytes: int = Field(
        default=64 << 10,
        gt=0,
        description="Largest item of a BYTES input (one string), in bytes; a larger one is refused (400) before"
        " any decoding or tokenizing. 64 KiB holds thousands of tokens, far past a text model's max_length.",
    )
    preprocess: Preprocess | None = None
    record_traffic: RecordTraffic | None = Field(
        default=None,
        description="Off unless set: record a sample of client inputs to eval/recorded.npz for builds (user data).",
    )
    onnxruntime: OnnxRuntimeOptions = Field(default_factory=OnnxRuntimeOptions)
    torch: TorchOptions = Field(default_factory=TorchOptions)
    build: BuildSpec | None = None
    openai: OpenAIServing | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        instances = sum(g.count * len(g.gpus or [None]) for g in self.instance_group)
        if instances > MAX_INSTANCES:
            raise ValueError(f"instance_group: {instances} instances in all, over {MAX_INSTANCES} (a thread and an "
                             "engine each)")
        for kind, tensors in (("inputs", self.inputs), ("outputs", self.outputs)):
            names = [t.name for t in tensors]
            duplicates = sorted({n for n in names if names.count(n) > 1})
            if duplicates:
                raise ValueError(f"{kind}: duplicate tensor names {duplicates}")
        if self.preprocess and self.preprocess.tokenize:
            tokenize = self.preprocess.tokenize
            source = next((t for t in self.inputs if t.name == tokenize.input), None)
            if source is None or source.datatype != "BYTES":
                raise ValueError(f"preprocess.tokenize.input {tokenize.input!r} must be a BYTES input")
        if self.max_batch_size == 0 and self.dynamic_batching is not None:
            raise ValueError("dynamic_batching needs max_batch_size > 0")
        for size in self.dynamic_batching.preferred_batch_size if self.dynamic_batching else []:
            if size > self.max_batch_size:
                raise ValueError(f"preferred_batch_size {size} exceeds max_batch_size {self.max_batch_size}")
        if self.max_batch_size and any(b > self.max_batch_size for b in self.warmup.batch_sizes):
            raise ValueError(f"warmup.batch_sizes exceed max_batch_size {self.max_batch_size}")
        if self.batch_buckets is not None:
            if not self.batched:
                raise ValueError("batch_buckets needs max_batch_size > 0")
            if sorted(set(self.batch_buckets)) != self.batch_buckets:
                raise ValueError(f"batch_buckets must be strictly increasing, got {self.batch_buckets}")
            if self.batch_buckets[-1] < self.max_batch_size:
                raise ValueError(
                    f"the largest batch bucket {self.batch_buckets[-1]} is below max_batch_size {self.max_batch_size}"
                )
        if self.engine == "torch" and self.torch.compile:
            if self.batched and not self.batch_buckets:
                raise ValueError("torch.compile needs batch_buckets: a fixed ladder, so shapes never recompile")
            if self.tokenize and not self.tokenize.sequence_buckets:
                raise ValueError("torch.compile of a text model needs preprocess.tokenize.sequence_buckets")
            if not self.tokenize and any(-1 in t.dims for t in self.inputs):
                raise ValueError("torch.compile needs fixed input dims (a variable dim would recompile per shape)")
        if self.dynamic_batching and self.dynamic_batching.max_batch_tokens and not self.tokenize:
            raise ValueError("dynamic_batching.max_batch_tokens needs preprocess.tokenize")
        if self.openai is not None:
            self._check_openai(self.openai)
        for tensor in self.outputs:
            if tensor.pad_value is not None:
                raise ValueError(f"output {tensor.name!r}: pad_value applies to inputs only")
        padded = [t for t in self.inputs if t.pad_value is not None]
        for tensor in padded:
            if -1 not in tensor.dims:
                raise ValueError(f"input {tensor.name!r}: pad_value needs a variable (-1) dim to pad")
        if (padded or self.tokenize) and any(-1 in t.dims for t in self.outputs):
            raise ValueError("padded batching needs outputs of fixed dims (padding would leak into them)")
        text = self.input(self.tokenize.input) if self.tokenize else None
        if text is not None and text.dims != [1]:  # the text input exists and is BYTES: checked above
            raise ValueError(f"the text input {text.name!r} must have dims [1] (one string per item)")
        for name, value in self.warmup.inputs.items():
            warmed = self.input(name)
            if warmed is None:
                known = ", ".join(t.name for t in self.inputs)
                raise ValueError(f"warmup.inputs: {name!r} is not an input (inputs: {known})")
            problem = _warmup_value_problem(value, warmed.datatype)
            if problem:
                raise ValueError(f"warmup.inputs.{name}: {problem}")
        return self

    def _check_openai(self, serving: OpenAIServing) -> None:
        """An embeddings model reads text and answers one fixed-length FP32 vector per text."""
        if self.tokenize is None:
            raise ValueError("openai.task embeddings needs a text model (preprocess.tokenize)")
        output = self.embedding_output()
        if output is None:
            known = ", ".join(t.name for t in self.outputs)
            wanted = serving.output or "(the only output)"
            raise ValueError(f"openai.output {wanted!r} is not one output of this model (outputs: {known})")
        if output.datatype != "FP32" or len(output.dims) != 1 or output.dims[0] == -1:
            raise ValueError(f"openai: output {output.name!r} must be FP32 with fixed dims [N], "
                             f"not {output.datatype} {output.dims}")
        for size in serving.matryoshka_dimensions or []:
            if size >= output.dims[0]:
                raise ValueError(f"openai.matryoshka_dimensions: {size} is not below the output's {output.dims[0]}")

    def embedding_output(self) -> TensorConfig | None:
        """The output the OpenAI embeddings route returns: the one `openai.output` names, else
        the only output (None when neither applies)."""
        if self.openai is None:
            return None
        if self.openai.output is not None:
            return self.output(self.openai.output)
        return self.outputs[0] if len(self.outputs) == 1 else None

    @property
    def tokenize(self) -> Tokenize | None:
        return self.preprocess.tokenize if self.preprocess else None

    @property
    def levels(self) -> int:
        return self.dynamic_batching.levels if self.dynamic_batching else 1

    def batch_ladder(self) -> list[int]:
        """The batch sizes worth building, warming and timing (server/ladder.py)."""
        return batch_ladder(self.max_batch_size, self.batch_buckets)

    @property
    def batched(self) -> bool:
        return self.max_batch_size > 0

    def input(self, name: str) -> TensorConfig | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> TensorConfig | None:
        return next((t for t in self.outputs if t.name == name), None)

    def api_shape(self, tensor: TensorConfig) -> list[int]:
        """The shape clients see: the batch dim (-1) first when the model batches."""
        return ([-1] if self.batched else []) + list(tensor.dims)


def _warmup_value_problem(value: WarmupValue, datatype: str) -> str | None:
    """Why `value` cannot fill a tensor of `datatype`, or None when it can."""
    if datatype == "BYTES":
        return None if isinstance(value, str) else f"BYTES inputs take a string, not {value!r}"
    if datatype == "BOOL":
        return None if isinstance(value, bool) else f"BOOL inputs take true or false, not {value!r}"
    if isinstance(value, (bool, str)):
        return f"{datatype} inputs take a number, not {value!r}"
    dtype = numpy_dtype(datatype)
    if dtype.kind in "iu":
        if not isinstance(value, int):
            return f"{datatype} inputs take an integer, not {value!r}"
        limits = np.iinfo(dtype)
        if not limits.min <= value <= limits.max:
            return f"{value} is out of range for {datatype}"
    return None


def validated_config(raw: dict[str, object], where: str) -> ModelConfig:
    """`raw` as a ModelConfig; ConfigError naming `where` (a file, or what drafted it), each
    field and the reason, when it is not one."""
    try:
        return ModelConfig.model_validate(raw)
    except ValidationError as exc:
        reasons = "; ".join(
            f"field '{'.'.join(str(p) for p in err['loc']) or '(top level)'}': {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"{where}: {reasons}") from exc


def load_model_config(path: Path) -> ModelConfig:
    """Read and validate one config file; errors name the file, the field and the reason."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    raw.setdefault("name", path.parent.name)
    config = validated_config(raw, str(path))
    if config.name != path.parent.name:
        raise ConfigError(
            f"{path}: field 'name': {config.name!r} differs from its folder {path.parent.name!r}"
        )
    return config
