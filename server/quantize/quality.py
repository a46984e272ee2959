"""The quality gate: a build must keep its FP32 source's answers on held-out data.

Classifiers are judged by accuracy (relative to FP32's) and also report top-1 agreement and the
largest probability error; embedding models by cosine to FP32's vectors and by whether the
retrieval answers stay the same (each sentence's nearest neighbour, the order of known triplets),
since a small mean error can still reorder neighbours. Thresholds come from `build.gate`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from server.config import BuildGate
from server.quantize.data import ClassificationData, EmbeddingData, EvalData


@dataclass(frozen=True)
class Check:
    metric: str
    value: float
    op: str
    threshold: float
    passed: bool


def classification_metrics(reference: np.ndarray, candidate: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    top_ref, top_cand = reference.argmax(axis=1), candidate.argmax(axis=1)
    return {
        "accuracy": float((top_cand == labels).mean()),
        "top1_agreement": float((top_cand == top_ref).mean()),
        "max_abs_error": float(np.abs(candidate - reference).max()),
    }


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine, not assuming unit norm (an FP16 output may drift off it)."""
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return (a * b).sum(axis=1) / np.maximum(norms, 1e-12)


def nearest_neighbours(vectors: np.ndarray) -> np.ndarray:
    """For each row, the index of its most similar other row."""
    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    similarity = unit @ unit.T
    np.fill_diagonal(similarity, -np.inf)
    return similarity.argmax(axis=1)


def triplet_margins(vectors: np.ndarray) -> np.ndarray:
    """sim(anchor, positive) - sim(anchor, negative) for rows laid out as consecutive triplets."""
    anchor, positive, negative = vectors[0::3], vectors[1::3], vectors[2::3]
    return cosines(anchor, positive) - cosines(anchor, negative)


def embedding_metrics(
    reference: np.ndarray, candidate: np.ndarray, ref_triplets: np.ndarray, cand_triplets: np.ndarray
) -> dict[str, float]:
    cos = cosines(reference, candidate)
    ref_margin, cand_margin = triplet_margins(ref_triplets), triplet_margins(cand_triplets)
    return {
        "mean_cosine": float(cos.mean()),
        "min_cosine": float(cos.min()),
        "neighbour_agreement": float((nearest_neighbours(reference) == nearest_neighbours(candidate)).mean()),
        "triplet_order_agreement": float((np.sign(ref_margin) == np.sign(cand_margin)).mean()),
        "triplets_correct": float((cand_margin > 0).mean()),
        "max_abs_error": float(np.abs(candidate - reference).max()),
    }


def reference_figures(data: EvalData, reference: dict[str, np.ndarray]) -> dict[str, float]:
    """FP32 against itself and the ground truth, for the report's FP32 column."""
    if isinstance(data, ClassificationData):
        return classification_metrics(reference["probabilities"], reference["probabilities"], data.labels)
    return embedding_metrics(reference["sentences"], reference["sentences"], reference["triplets"], reference["triplets"])


def measure(data: EvalData, reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray]) -> dict[str, float]:
    if isinstance(data, ClassificationData):
        return classification_metrics(reference["probabilities"], candidate["probabilities"], data.labels)
    assert isinstance(data, EmbeddingData)
    return embedding_metrics(reference["sentences"], candidate["sentences"], reference["triplets"], candidate["triplets"])


def checks(kind: str, metrics: dict[str, float], reference: dict[str, float], gate: BuildGate) -> list[Check]:
    """The gate's verdict per thresholded metric; NaN (a broken build) always fails."""
    if kind == "classification":
        wanted = [("accuracy", gate.min_accuracy_ratio * reference["accuracy"])]
    else:
        wanted = [("mean_cosine", gate.min_mean_cosine), ("neighbour_agreement", gate.min_neighbour_agreement)]
    return [
        Check(metric, metrics[metric], ">=", float(threshold), bool(metrics[metric] >= threshold))
        for metric, threshold in wanted
    ]


def judge(data: EvalData, reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray], gate: BuildGate) -> dict:
    """The `quality` block of a build report."""
    figures = reference_figures(data, reference)
    metrics = measure(data, reference, candidate)
    verdicts = checks(data.kind, metrics, figures, gate)
    samples = len(data.labels) if isinstance(data, ClassificationData) else len(data.sentences)
    return {
        "kind": data.kind,
        "samples": samples,
        "metrics": metrics,
        "reference": figures,
        "checks": [asdict(c) for c in verdicts],
        "passed": all(c.passed for c in verdicts),
        "enforced": gate.enforce,
    }
