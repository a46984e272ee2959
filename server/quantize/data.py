"""Evaluation and calibration data of a model, in its own folder (`models/<model>/eval/`).

The gate is only as good as its data, so the data is declared next to the model rather than
hidden in code. Two forms:
- `eval/inputs.npz` (any model, a user's own included): one array per input of the model, named
  as its config names them, items along the first axis (text as a numpy string array), and
  optionally `eval/labels.npy` (an integer class per item). The items are split once,
  deterministically (seed 0): up to `MAX_CALIBRATION` of them, never more than half, calibrate;
  the rest evaluate; the two never overlap. Without it, `eval/recorded.npz`, the same format,
  written by the server from live traffic where the model's config asks for it
  (`record_traffic`, server/recording.py).
- `eval/dataset.json`, for the two shipped models: digits evaluates on the held-out split its
  build saved and calibrates on a deterministic sample of the *training* split; minilm on
  sentences and known-order triplets written for the project.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from server.config import ModelConfig
from server.layout import DATASET_FILE, EVAL_DIR, INPUTS_FILE, LABELS_FILE, RECORDED_FILE
from server.protocol.datatypes import numpy_dtype
from server.quantize.errors import BuildError, EvalDataUnavailable

MAX_CALIBRATION = 256
SPLIT_SEED = 0


@dataclass(frozen=True)
class TensorData:
    """Named input arrays (API names, items first) to evaluate on, a disjoint set to calibrate
    on, and the labels of the evaluation items when there are any."""

    inputs: dict[str, np.ndarray]
    calibration: dict[str, np.ndarray]
    labels: np.ndarray | None
    output: str  # the output the gate judges (API name)
    fingerprint: str
    origin: str  # where the items came from, for the report

    @property
    def kind(self) -> str:
        """What the gate judges by default: classes when there are labels, else the tensors."""
        return "classification" if self.labels is not None else "tensor"

    @property
    def count(self) -> int:
        return len(next(iter(self.inputs.values())))

    @property
    def calibration_count(self) -> int:
        return len(next(iter(self.calibration.values())))


@dataclass(frozen=True)
class EmbeddingData:
    """Sentences (cosine, nearest neighbours) and (anchor, positive, negative) triplets."""

    sentences: list[str]
    triplets: list[tuple[str, str, str]]
    fingerprint: str
    origin: str = ""  # the files the text came from, for the report

    kind = "embedding"

    @property
    def count(self) -> int:
        return len(self.sentences)

    @property
    def triplet_texts(self) -> list[str]:
        return [text for triplet in self.triplets for text in triplet]


EvalData = TensorData | EmbeddingData


def load_eval_data(model_dir: Path, version_dir: Path, config: ModelConfig, recorded: bool = True) -> EvalData:
    """The model's evaluation data: eval/dataset.json when there is one, else eval/inputs.npz,
    else (`recorded`) eval/recorded.npz."""
    spec_path = model_dir / DATASET_FILE
    if spec_path.is_file():
        spec = json.loads(spec_path.read_text(encoding="utf-8"))
        kind = spec.get("kind")
        if kind == "classification":
            return _classification(spec, spec_path, version_dir)
        if kind == "embedding":
            return _embedding(spec, spec_path.parent)
        raise BuildError(f"{spec_path}: kind {kind!r} is not 'classification' or 'embedding'")
    for stored in (INPUTS_FILE, RECORDED_FILE) if recorded else (INPUTS_FILE,):
        if (model_dir / stored).is_file():
            return _tensors(model_dir, stored, config)
    raise EvalDataUnavailable(
        f"{model_dir / INPUTS_FILE} is missing: a build is judged against FP32 on the model's own data "
        f"(one array per input, named as in its config; optionally {LABELS_FILE} with a class per item), "
        f"or on {RECORDED_FILE} recorded from traffic (record_traffic in its config)"
    )


def _judged_output(config: ModelConfig, path: Path) -> str:
    """The output the gate compares: the first with numbers in it (strings have no error to
    measure: a model whose first output is text was judged on it and failed to convert)."""
    judged = next((t.name for t in config.outputs if t.datatype not in ("BYTES", "BOOL")), None)
    if judged is None:
        raise BuildError(f"{path}: the model has no numeric output for the gate to compare")
    return judged


def _as_datatype(array: np.ndarray, datatype: str, name: str, path: Path) -> np.ndarray:
    """`array` as the input's datatype takes it: numpy's float64 (what most data is) as FP32,
    integers as floats. Calibration feeds the engine directly, and ONNX Runtime refuses a double
    for a float; a cast that would lose what the values are (floats to integers) is refused."""
    target = numpy_dtype(datatype)
    if array.dtype == target:
        return array
    if np.can_cast(array.dtype, target, casting="same_kind") or (array.dtype.kind in "biu" and target.kind == "f"):
        return array.astype(target)
    raise BuildError(f"{path}: {name!r} is {datatype} in the config but holds {array.dtype}, which does not cast to "
                     "it without losing what the values are")


def _tensors(model_dir: Path, stored: Path, config: ModelConfig) -> TensorData:
    """eval/inputs.npz (+ labels.npy) or eval/recorded.npz, checked against the config, split
    into calibration and evaluation items once, deterministically."""
    path = model_dir / stored
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
        labels_path = model_dir / LABELS_FILE
        labels = np.load(labels_path, allow_pickle=False) if stored == INPUTS_FILE and labels_path.is_file() else None
    except (OSError, ValueError) as exc:
        raise BuildError(f"cannot read {path}: {exc}") from exc
    names = [t.name for t in config.inputs]
    if sorted(arrays) != sorted(names):
        raise BuildError(f"{path} holds {sorted(arrays)}; the model's inputs are {names} (one array each, "
                         "named as the config names them)")
    counts = {len(array) if array.ndim else 0 for array in arrays.values()}
    if len(counts) != 1 or (count := counts.pop()) < 2:
        raise BuildError(f"{path}: every array needs the same number of items (its first axis), at least 2")
    for tensor in config.inputs:
        array = arrays[tensor.name]
        textual = array.dtype.kind in "US"
        if (tensor.datatype == "BYTES") != textual:
            raise BuildError(f"{path}: {tensor.name!r} is {tensor.datatype} in the config but holds {array.dtype} "
                             "(text as a numpy string array, numbers as numbers)")
        if textual:
            continue
        dims = tensor.dims
        if array.ndim != len(dims) + 1 or any(d not in (-1, n) for d, n in zip(dims, array.shape[1:], strict=False)):
            raise BuildError(f"{path}: {tensor.name!r} holds items of shape {list(array.shape[1:])}; the config's "
                             f"dims are {list(dims)} (-1: any), items along the first axis")
        arrays[tensor.name] = _as_datatype(array, tensor.datatype, tensor.name, path)
    if labels is not None and (labels.shape != (count,) or labels.dtype.kind not in "iu"):
        raise BuildError(f"{model_dir / LABELS_FILE}: one integer class per item ({count}), got "
                         f"{labels.dtype} {labels.shape}")
    order = np.random.default_rng(SPLIT_SEED).permutation(count)
    cut = min(MAX_CALIBRATION, count // 2)
    calibrate, evaluate = np.sort(order[:cut]), np.sort(order[cut:])
    chosen = {name: np.ascontiguousarray(array[calibrate]) for name, array in arrays.items()}
    digest = hashlib.sha256()
    for name in sorted(arrays):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(arrays[name]).tobytes())
    if labels is not None:
        digest.update(np.ascontiguousarray(labels).tobytes())
    return TensorData(
        inputs={name: np.ascontiguousarray(array[evaluate]) for name, array in arrays.items()},
        calibration=chosen,
        labels=None if labels is None else labels[evaluate].astype(np.int64),
        output=_judged_output(config, path),
        fingerprint=digest.hexdigest(),
        origin=f"{stored}: {len(evaluate)} items evaluate, {cut} others are kept for calibration",
    )


def _classification(spec: dict, spec_path: Path, version_dir: Path) -> TensorData:
    heldout_path = version_dir / spec.get("heldout", "heldout.npz")
    if not heldout_path.is_file():
        raise EvalDataUnavailable(f"{heldout_path} is missing (was the model built?)")
    with np.load(heldout_path, allow_pickle=False) as held:
        images, labels = held["images"].astype(np.float32), held["labels"].astype(np.int64)
    cal_spec = spec.get("calibration") or {}
    generator = cal_spec.get("generator")
    if generator != "sklearn_digits_train":
        raise BuildError(f"{spec_path}: calibration generator {generator!r} is unknown")
    train = sklearn_digits_train(cal_spec, images)
    rng = np.random.default_rng(int(cal_spec.get("seed", 0)))
    count = min(int(cal_spec.get("count", 256)), len(train))
    chosen = train[np.sort(rng.choice(len(train), size=count, replace=False))]
    digest = hashlib.sha256()
    for array in (images, labels, chosen):
        digest.update(np.ascontiguousarray(array).tobytes())
    name = spec.get("input", "input")
    return TensorData(
        inputs={name: images},
        calibration={name: chosen},
        labels=labels,
        output=spec.get("output", "output"),
        fingerprint=digest.hexdigest(),
        origin=f"{spec_path.name}: the held-out split, calibration from the training split",
    )


def sklearn_digits_train(cal_spec: dict, heldout: np.ndarray) -> np.ndarray:
    """The training part of the split the digits build made, checked against its held-out part.

    Re-deriving the split (rather than storing it) keeps the repository small; the equality check
    guarantees that no held-out image leaks into calibration even if the split code drifts.
    """
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise EvalDataUnavailable(
            f"the digits calibration split needs scikit-learn, which is not installed ({exc})"
        ) from exc

    data = load_digits()
    images = data.images.astype(np.float32)[:, None, :, :]
    labels = data.target.astype(np.int64)
    x_train, x_test, _, _ = train_test_split(
        images,
        labels,
        test_size=float(cal_spec.get("test_size", 0.2)),
        random_state=int(cal_spec.get("random_state", 0)),
        stratify=labels,
    )
    if x_test.shape != heldout.shape or not np.array_equal(x_test, heldout):
        raise BuildError("the re-derived digits split does not reproduce heldout.npz; refusing to calibrate")
    return x_train


def _embedding(spec: dict, folder: Path) -> EmbeddingData:
    sentences_path = folder / spec.get("sentences", "sentences.json")
    triplets_path = folder / spec.get("triplets", "triplets.json")
    try:
        text = json.loads(sentences_path.read_text(encoding="utf-8"))
        # "pairs": paraphrase pairs, flattened (each sentence's intended neighbour is its partner)
        sentences = [s for pair in text["pairs"] for s in pair] if "pairs" in text else text["sentences"]
        triplets = [tuple(t) for t in json.loads(triplets_path.read_text(encoding="utf-8"))["triplets"]]
    except OSError as exc:
        raise EvalDataUnavailable(f"cannot read the evaluation text of {folder}: {exc}") from exc
    except (KeyError, ValueError) as exc:
        raise BuildError(f"cannot read the evaluation text of {folder}: {exc}") from exc
    if len(sentences) < 2 or any(len(t) != 3 for t in triplets):
        raise BuildError(f"{folder}: need >= 2 sentences and (anchor, positive, negative) triplets")
    digest = hashlib.sha256(json.dumps([sentences, triplets], ensure_ascii=False).encode())
    origin = ", ".join(f"{EVAL_DIR}/{path.name}" for path in (sentences_path, triplets_path))
    return EmbeddingData(sentences=list(sentences), triplets=triplets, fingerprint=digest.hexdigest(), origin=origin)
