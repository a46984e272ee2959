"""The models of the GPU check: random weights in real shapes, built on the machine that runs it.

Nothing is downloaded. ResNet-50 is torchvision's with `weights=None` (a built-in ResNet of the
same bottleneck layout where torchvision is absent); the BERT-base encoder is transformers'
`BertModel` constructed from a `BertConfig` (random init), serving its [CLS] hidden state from
token ids (no tokenizer: clients send INT64 ids and the attention mask); `digits` is the shipped
CNN of models/digits/build.py, trained here on scikit-learn's bundled digits (or left at random
weights, accuracy not measured, where scikit-learn is absent).

Each is exported once with torch.export (dynamic batch) on the device it serves from, and
written into a model repository as one folder per precision: FP16 and BF16 are the FP32 program
under a config whose precision makes the torch engine cast it at load (as `batchline build`
does); INT8 is a torchao program of its own where torchao and the model allow, else recorded as
unsupported with the reason.
"""

from __future__ import annotations

import copy
import importlib.util
import io
import os
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
DIGITS_BUILD = ROOT / "models" / "digits" / "build.py"
PRECISIONS = ("fp32", "fp16", "bf16", "int8")
MAX_EXPORT_BATCH = 4096
EXAMPLE_BATCH = 4  # > 1: an example batch of 1 would specialise the batch dim
POOL_ITEMS = 64  # distinct inputs per model that requests and engine batches are drawn from


@dataclass(frozen=True)
class Shapes:
    """The sizes of one run: the real ones on a GPU, tiny ones for the CPU dry run."""

    resnet_layers: tuple[int, ...]
    resnet_width: int
    image: int
    classes: int
    bert: dict[str, Any]  # BertConfig's keyword arguments
    sequence: int
    digits_epochs: int


FULL = Shapes(
    resnet_layers=(3, 4, 6, 3), resnet_width=64, image=224, classes=1000,
    bert={"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
          "vocab_size": 30522},
    sequence=128, digits_epochs=40,
)
TINY = Shapes(
    resnet_layers=(1, 1, 1, 1), resnet_width=8, image=32, classes=10,
    bert={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
          "vocab_size": 1000},
    sequence=16, digits_epochs=1,
)


@dataclass
class Model:
    """One model of the check: its eager FP32 module on the device, the tensors its configs
    declare, a pool of inputs, and what INT8 can be made of it."""

    role: str  # resnet | bert | digits
    name: str
    module: nn.Module
    inputs: list[dict[str, Any]]  # config tensors: name, datatype, dims
    output: dict[str, Any]
    pool: dict[str, np.ndarray]  # input name -> POOL_ITEMS items
    about: dict[str, Any]
    int8_scheme: str | None  # torchao config to apply, or None with int8_unsupported saying why
    int8_unsupported: str | None = None
    heldout: tuple[np.ndarray, np.ndarray] | None = None  # digits: images, labels
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)  # precision -> build record

    @property
    def width(self) -> int:
        return int(self.output["dims"][0])

    def samples(self, items: int, offset: int = 0) -> dict[str, np.ndarray]:
        """`items` inputs from the pool, starting at `offset` (wrapping around)."""
        first = next(iter(self.pool.values()))
        index = (np.arange(items) + offset) % len(first)
        return {name: np.ascontiguousarray(array[index]) for name, array in self.pool.items()}

    def example(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        return tuple(torch.from_numpy(a).to(device) for a in self.samples(EXAMPLE_BATCH).values())


# ---- the three models ----------------------------------------------------------------------------
def build_resnet(shapes: Shapes, device: torch.device, seed: int = 0) -> Model:
    torch.manual_seed(seed)
    module, source = _resnet(shapes)
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((POOL_ITEMS, 3, shapes.image, shapes.image), dtype=np.float32)
    name = "resnet50" if shapes.resnet_layers == FULL.resnet_layers else "resnet-tiny"
    return Model(
        role="resnet", name=name, module=module.eval().to(device),
        inputs=[{"name": "image", "datatype": "FP32", "dims": [3, shapes.image, shapes.image]}],
        output={"name": "logits", "datatype": "FP32", "dims": [shapes.classes]},
        pool={"image": images},
        about={"source": source, "layers": list(shapes.resnet_layers), "image": shapes.image,
               "classes": shapes.classes, "parameters": _parameters(module), "weights": "random (no download)"},
        int8_scheme=None,
        int8_unsupported="torchao's INT8 configs quantize linear layers, and a ResNet's compute is convolutions"
        " (the PT2E static INT8 of `batchline build` lowers to x86 Inductor kernels: CPU only)",
    )


def _resnet(shapes: Shapes) -> tuple[nn.Module, str]:
    full = shapes.resnet_layers == FULL.resnet_layers and shapes.resnet_width == FULL.resnet_width
    try:
        import torchvision
    except ImportError:
        return BottleneckResNet(shapes.resnet_layers, shapes.resnet_width, shapes.classes), (
            "built-in bottleneck ResNet (torchvision is not installed)")
    if full:
        return torchvision.models.resnet50(weights=None, num_classes=shapes.classes), (
            f"torchvision {torchvision.__version__} resnet50(weights=None)")
    return BottleneckResNet(shapes.resnet_layers, shapes.resnet_width, shapes.classes), (
        "built-in bottleneck ResNet (a width torchvision does not offer)")


class _Bottleneck(nn.Module):
    def __init__(self, inputs: int, planes: int, stride: int) -> None:
        super().__init__()
        out = planes * 4
        self.body = nn.Sequential(
            nn.Conv2d(inputs, planes, 1, bias=False), nn.BatchNorm2d(planes), nn.ReLU(),
            nn.Conv2d(planes, planes, 3, stride, 1, bias=False), nn.BatchNorm2d(planes), nn.ReLU(),
            nn.Conv2d(planes, out, 1, bias=False), nn.BatchNorm2d(out),
        )
        self.shortcut: nn.Module = nn.Identity() if stride == 1 and inputs == out else nn.Sequential(
            nn.Conv2d(inputs, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class BottleneckResNet(nn.Sequential):
    """torchvision's ResNet layout (stem, four stages of bottlenecks, pooled linear head) at any
    depth and width: the tiny model of the dry run, and ResNet-50 where torchvision is absent."""

    def __init__(self, layers: tuple[int, ...], width: int, classes: int) -> None:
        blocks: list[nn.Module] = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                   nn.MaxPool2d(3, 2, 1)]
        inputs = width
        for stage, count in enumerate(layers):
            for index in range(count):
                blocks.append(_Bottleneck(inputs, width * 2**stage, 2 if index == 0 and stage > 0 else 1))
                inputs = width * 2**stage * 4
        super().__init__(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inputs, classes))


class BertEncoder(nn.Module):
    """BERT from token ids and attention mask to the [CLS] token's last hidden state."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers import BertModel

        self.bert = BertModel(config, add_pooling_layer=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]


def build_bert(shapes: Shapes, device: torch.device, seed: int = 0) -> Model:
    import transformers
    from transformers import BertConfig

    torch.manual_seed(seed)
    config = BertConfig(**shapes.bert, max_position_embeddings=max(512, shapes.sequence))
    module = BertEncoder(config)
    rng = np.random.default_rng(seed)
    sequence = shapes.sequence
    ids = rng.integers(1000 if config.vocab_size > 2000 else 1, config.vocab_size, (POOL_ITEMS, sequence))
    lengths = rng.integers(max(2, sequence // 4), sequence + 1, POOL_ITEMS)  # varied texts, padded
    mask = (np.arange(sequence)[None, :] < lengths[:, None]).astype(np.int64)
    ids = np.where(mask == 1, ids, 0).astype(np.int64)
    name = "bert-base" if shapes.bert == FULL.bert else "bert-tiny"
    return Model(
        role="bert", name=name, module=module.eval().to(device),
        inputs=[{"name": "input_ids", "datatype": "INT64", "dims": [sequence]},
                {"name": "attention_mask", "datatype": "INT64", "dims": [sequence]}],
        output={"name": "embedding", "datatype": "FP32", "dims": [config.hidden_size]},
        pool={"input_ids": ids, "attention_mask": mask},
        about={"source": f"transformers {transformers.__version__} BertModel(BertConfig(...)), random init",
               **shapes.bert, "sequence": sequence, "parameters": _parameters(module),
               "output": "last hidden state of [CLS]", "weights": "random (no download)"},
        int8_scheme="dynamic",
    )


def build_digits(shapes: Shapes, device: torch.device) -> Model:
    """The shipped digits CNN, trained on scikit-learn's digits where it is installed."""
    try:
        build = _digits_build_module()
    except ImportError as exc:  # models/digits/build.py needs scikit-learn
        return _random_digits(device, f"scikit-learn is not importable ({exc}): random weights, accuracy not measured")
    torch.manual_seed(build.SEED)
    x_train, x_test, y_train, y_test = build.load_split()
    net = build.DigitsNet()
    train_digits(net, x_train, y_train, shapes.digits_epochs, device, build)
    train_accuracy = _accuracy(net, x_train, y_train, device)
    pool = np.ascontiguousarray(x_test[:POOL_ITEMS])
    return Model(
        role="digits", name="digits", module=net.eval().to(device),
        inputs=[{"name": "image", "datatype": "FP32", "dims": [1, 8, 8]}],
        output={"name": "probabilities", "datatype": "FP32", "dims": [10]},
        pool={"image": pool},
        about={"source": "models/digits/build.py DigitsNet, trained here on scikit-learn's digits",
               "epochs": shapes.digits_epochs, "train_accuracy": round(train_accuracy, 4),
               "heldout_items": len(y_test), "parameters": _parameters(net)},
        int8_scheme="weight_only",
        heldout=(x_test, y_test),
    )


def _digits_build_module() -> Any:
    spec = importlib.util.spec_from_file_location("batchline_digits_build", DIGITS_BUILD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_digits(net: Any, images: np.ndarray, labels: np.ndarray, epochs: int, device: torch.device,
                 build: Any) -> None:
    """models/digits/build.py's recipe (Adam, cosine schedule, its seed and batch size) for its
    network (`net`, its DigitsNet, whose `logits` the loss reads; `build`, that module) on
    `device`, for `epochs`; without its global deterministic mode, which would constrain every
    CUDA kernel the check runs afterwards."""
    net.to(device)
    x, y = torch.from_numpy(images).to(device), torch.from_numpy(labels).to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=build.LEARNING_RATE)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(epochs, 1))
    generator = torch.Generator().manual_seed(build.SEED)
    net.train()
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator).to(device)
        for start in range(0, len(x), build.BATCH_SIZE):
            index = order[start:start + build.BATCH_SIZE]
            loss = nn.functional.cross_entropy(net.logits(x[index]), y[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        scheduler.step()
    net.eval()


@torch.no_grad()
def _accuracy(net: nn.Module, images: np.ndarray, labels: np.ndarray, device: torch.device) -> float:
    probabilities = net(torch.from_numpy(images).to(device)).cpu().numpy()
    return float((probabilities.argmax(axis=1) == labels).mean())


class _RandomDigits(nn.Module):
    """DigitsNet's layer shapes, for a host without scikit-learn (build.py imports it)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                                 nn.MaxPool2d(2), nn.Flatten(), nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.net(x * (1.0 / 16.0)), dim=1)


def _random_digits(device: torch.device, why: str) -> Model:
    torch.manual_seed(0)
    net = _RandomDigits()
    pool = np.random.default_rng(0).integers(0, 17, (POOL_ITEMS, 1, 8, 8)).astype(np.float32)
    return Model(
        role="digits", name="digits", module=net.eval().to(device),
        inputs=[{"name": "image", "datatype": "FP32", "dims": [1, 8, 8]}],
        output={"name": "probabilities", "datatype": "FP32", "dims": [10]},
        pool={"image": pool},
        about={"source": "DigitsNet's layer shapes, random weights", "note": why, "parameters": _parameters(net)},
        int8_scheme="weight_only",
    )


def _parameters(module: nn.Module) -> int:
    return int(sum(p.numel() for p in module.parameters()))


BUILDERS: dict[str, Callable[[Shapes, torch.device], Model]] = {
    "resnet": build_resnet, "bert": build_bert, "digits": build_digits,
}


# ---- export and the repository -------------------------------------------------------------------
def export(module: nn.Module, model: Model, device: torch.device) -> torch.export.ExportedProgram:
    """torch.export on `device` with a dynamic batch dim on every input."""
    batch = torch.export.Dim("batch", min=1, max=MAX_EXPORT_BATCH)
    example = model.example(device)
    with torch.no_grad():
        return torch.export.export(module, example, dynamic_shapes=tuple({0: batch} for _ in example))


def save(program: torch.export.ExportedProgram, path: Path) -> None:
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buffer.getvalue())


def int8_module(model: Model) -> nn.Module:
    """A copy of the model with torchao's INT8 on its linear layers: `dynamic` (INT8 weights and
    per-row INT8 activations, INT8 matmuls) or `weight_only` (INT8 weights, float compute).
    Raises Unsupported where the model or the installed stack cannot."""
    if model.int8_scheme is None:
        raise Unsupported(model.int8_unsupported or "no INT8 scheme for this model")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from torchao.quantization import (
                Int8DynamicActivationInt8WeightConfig,
                Int8WeightOnlyConfig,
                quantize_,
            )
        except Exception as exc:  # ImportError, or torchao refusing this torch
            raise Unsupported(f"torchao is not importable here ({type(exc).__name__}: {exc})") from exc
        config = (Int8DynamicActivationInt8WeightConfig(set_inductor_config=False) if model.int8_scheme == "dynamic"
                  else Int8WeightOnlyConfig(set_inductor_config=False))
        module = copy.deepcopy(model.module)
        quantize_(module, config)
    return module


class Unsupported(RuntimeError):
    """What this machine's stack or this model cannot do; recorded, not a failure of the check."""


def write_variant(repository: Path, model: Model, precision: str, artifact: Path, *, kind: str, instances: int,
                  max_batch: int, threads: int | None, suffix: str = "", batch_buckets: list[int] | None = None,
                  compile_mode: str | None = None) -> str:
    """The folder `<model>-<precision>[-<suffix>]` of `repository` (config.yaml, 1/model.pt2, its
    digest record), checked by the server's own config schema; returns its name. `compile_mode`
    serves it torch.compiled once per batch bucket (`batch_buckets`, which the server pads every
    batch up to and warms up one by one)."""
    from server.config import load_model_config
    from server.engines.digests import record_digests
    from server.engines.registry import ENGINES
    from server.layout import FIRST_VERSION, config_path, version_dir

    name = f"{model.name}-{precision}" + (f"-{suffix}" if suffix else "")
    folder = repository / name
    version = version_dir(folder, FIRST_VERSION)
    version.mkdir(parents=True, exist_ok=True)
    filename = ENGINES["torch"].artifact
    _link_or_copy(artifact, version / filename)
    record_digests(version, [filename])
    config: dict[str, Any] = {
        "name": name,
        "engine": "torch",
        # INT8 programs take FP32 inputs and carry their own INT8 weights: the engine must not cast
        "precision": "fp32" if precision == "int8" else precision,
        "max_batch_size": max_batch,
        "inputs": model.inputs,
        "outputs": [model.output],
        "dynamic_batching": {
            "max_queue_delay_microseconds": 0,
            "default_queue_policy": {"max_queue_size": 4096, "default_timeout_microseconds": 30_000_000},
        },
        "instance_group": [{"count": instances, "kind": kind}],
        "warmup": {"batch_sizes": sorted({1, max_batch})},
    }
    if batch_buckets:
        config["batch_buckets"] = list(batch_buckets)
    torch_options: dict[str, Any] = {"num_threads": threads} if threads else {}
    if compile_mode:
        torch_options.update(compile=True, compile_mode=compile_mode)
    if torch_options:
        config["torch"] = torch_options
    header = f"# Written by loadtest/gpu_check: {model.about.get('source')}, {name}.\n"
    config_path(folder).write_text(header + yaml.safe_dump(config, sort_keys=False))
    load_model_config(config_path(folder))
    return name


def _link_or_copy(source: Path, destination: Path) -> None:
    destination.unlink(missing_ok=True)
    try:
        os.link(source, destination)
    except OSError:
        shutil.copyfile(source, destination)
