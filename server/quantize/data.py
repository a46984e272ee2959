"""Evaluation and calibration data that ship with a model (`models/<model>/eval/dataset.json`).

The gate is only as good as its data, so the data is declared next to the model rather than
hidden in code: classifiers evaluate on the held-out split saved by their build and calibrate on
a deterministic sample of the *training* split (never the held-out one); embedding models
evaluate on sentences and known-order triplets written for the project.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from server.quantize.errors import BuildError, EvalDataUnavailable

DATASET_FILE = Path("eval") / "dataset.json"
CALIBRATIONS = ("train", "zeros", "noise")  # the last two are deliberately broken (gate tests)


@dataclass(frozen=True)
class ClassificationData:
    """Held-out images with labels, and calibration images from the training split."""

    input: str
    output: str
    images: np.ndarray
    labels: np.ndarray
    calibration: np.ndarray
    fingerprint: str

    kind = "classification"


@dataclass(frozen=True)
class EmbeddingData:
    """Sentences (cosine, nearest neighbours) and (anchor, positive, negative) triplets."""

    sentences: list[str]
    triplets: list[tuple[str, str, str]]
    fingerprint: str

    kind = "embedding"

    @property
    def triplet_texts(self) -> list[str]:
        return [text for triplet in self.triplets for text in triplet]


EvalData = ClassificationData | EmbeddingData


def load_eval_data(model_dir: Path, version_dir: Path, calibration: str = "train") -> EvalData:
    """Read the model's dataset.json; `calibration` other than "train" breaks it on purpose."""
    spec_path = model_dir / DATASET_FILE
    if not spec_path.is_file():
        raise EvalDataUnavailable(
            f"{spec_path} is missing: a build is evaluated against FP32 on the model's own held-out data"
        )
    if calibration not in CALIBRATIONS:
        raise BuildError(f"calibration {calibration!r} is not one of {', '.join(CALIBRATIONS)}")
    spec = json.loads(spec_path.read_text(encoding="utf-8"))
    kind = spec.get("kind")
    if kind == "classification":
        return _classification(spec, spec_path, version_dir, calibration)
    if kind == "embedding":
        return _embedding(spec, spec_path.parent)
    raise BuildError(f"{spec_path}: kind {kind!r} is not 'classification' or 'embedding'")


def _classification(spec: dict, spec_path: Path, version_dir: Path, calibration: str) -> ClassificationData:
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
    chosen = broken_calibration(chosen, calibration)
    digest = hashlib.sha256()
    for array in (images, labels, chosen):
        digest.update(np.ascontiguousarray(array).tobytes())
    return ClassificationData(
        input=spec.get("input", "input"),
        output=spec.get("output", "output"),
        images=images,
        labels=labels,
        calibration=chosen,
        fingerprint=digest.hexdigest(),
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


def broken_calibration(images: np.ndarray, how: str) -> np.ndarray:
    """"zeros"/"noise" replace the calibration set with garbage, to prove the gate catches it."""
    if how == "zeros":
        return np.zeros_like(images)
    if how == "noise":
        return np.random.default_rng(0).uniform(0, 2000, size=images.shape).astype(images.dtype)
    return images


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
    return EmbeddingData(sentences=list(sentences), triplets=triplets, fingerprint=digest.hexdigest())
