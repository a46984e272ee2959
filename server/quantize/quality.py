"""The quality gate: a build must keep its FP32 source's answers on held-out data.

What it judges follows the model's kind, or `build.gate.kind` when set:
- classification: accuracy relative to FP32's where the data has labels, else top-1 agreement
  with FP32; both reported, with the largest probability error;
- embedding: cosine to FP32's vectors and whether the retrieval answers stay the same (each
  item's nearest neighbour, and the order of known triplets where the data has them), since a
  small mean error can still reorder neighbours;
- tensor (anything else): the relative error of each item's output against FP32's (L2 norm of
  the difference over the norm of FP32's), its mean gated and its largest reported.
Thresholds come from `build.gate`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from server.config import BuildGate
from server.quantize.data import EmbeddingData, EvalData, TensorData


@dataclass(frozen=True)
class Check:
    metric: str
    value: float
    op: str
    threshold: float
    passed: bool


def classification_metrics(reference: np.ndarray, candidate: np.ndarray, labels: np.ndarray | None) -> dict[str, float]:
    top_ref, top_cand = reference.argmax(axis=1), candidate.argmax(axis=1)
    figures = {
        "top1_agreement": float((top_cand == top_ref).mean()),
        "max_abs_error": float(np.abs(candidate - reference).max()),
    }
    if labels is not None:
        figures["accuracy"] = float((top_cand == labels).mean())
    return figures


def tensor_metrics(reference: np.ndarray, candidate: np.ndarray) -> dict[str, float]:
    """Per item, |candidate - reference| / |reference| (L2 norms over the item's values)."""
    ref = reference.reshape(len(reference), -1).astype(np.float64)
    cand = candidate.reshape(len(candidate), -1).astype(np.float64)
    errors = np.linalg.norm(cand - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-12)
    return {
        "mean_relative_error": float(errors.mean()),
        "max_relative_error": float(errors.max()),
        "max_abs_error": float(np.abs(cand - ref).max()),
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
    reference: np.ndarray, candidate: np.ndarray,
    ref_triplets: np.ndarray | None = None, cand_triplets: np.ndarray | None = None,
) -> dict[str, float]:
    cos = cosines(reference, candidate)
    figures = {
        "mean_cosine": float(cos.mean()),
        "min_cosine": float(cos.min()),
        "neighbour_agreement": float((nearest_neighbours(reference) == nearest_neighbours(candidate)).mean()),
        "max_abs_error": float(np.abs(candidate - reference).max()),
    }
    if ref_triplets is not None and cand_triplets is not None and len(ref_triplets):
        ref_margin, cand_margin = triplet_margins(ref_triplets), triplet_margins(cand_triplets)
        figures["triplet_order_agreement"] = float((np.sign(ref_margin) == np.sign(cand_margin)).mean())
        figures["triplets_correct"] = float((cand_margin > 0).mean())
    return figures


def kind_of(data: EvalData, gate: BuildGate, embedding_model: bool = False) -> str:
    """The gate's `kind`, else the data's (a model serving OpenAI embeddings is an embedding model)."""
    if gate.kind != "auto":
        return gate.kind
    if isinstance(data, TensorData) and embedding_model and data.labels is None:
        return "embedding"
    return data.kind


def measure(kind: str, data: EvalData, reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray]) -> dict[str, float]:
    """The figures of `candidate` against `reference` (both from `runner.evaluate`)."""
    if isinstance(data, EmbeddingData):
        if kind != "embedding":
            raise ValueError(f"gate kind {kind!r} does not apply to sentence data (embedding only)")
        return embedding_metrics(reference["sentences"], candidate["sentences"], reference["triplets"],
                                 candidate["triplets"])
    ref, cand = reference["output"], candidate["output"]
    if kind == "classification":
        if ref.ndim != 2:
            raise ValueError(f"gate kind classification needs an output of [items, classes]; it has {ref.shape}")
        return classification_metrics(ref, cand, data.labels)
    if kind == "embedding":
        return embedding_metrics(ref.reshape(len(ref), -1), cand.reshape(len(cand), -1))
    return tensor_metrics(ref, cand)


def checks(kind: str, metrics: dict[str, float], reference: dict[str, float], gate: BuildGate) -> list[Check]:
    """The gate's verdict per thresholded metric; NaN (a broken build) always fails."""
    wanted: list[tuple[str, str, float]]
    if kind == "classification":
        wanted = ([("accuracy", ">=", gate.min_accuracy_ratio * reference["accuracy"])] if "accuracy" in metrics
                  else [("top1_agreement", ">=", gate.min_top1_agreement)])
    elif kind == "embedding":
        wanted = [("mean_cosine", ">=", gate.min_mean_cosine), ("neighbour_agreement", ">=", gate.min_neighbour_agreement)]
    else:
        wanted = [("mean_relative_error", "<=", gate.max_mean_relative_error)]
    return [
        Check(metric, metrics[metric], op, float(threshold),
              bool(metrics[metric] >= threshold if op == ">=" else metrics[metric] <= threshold))
        for metric, op, threshold in wanted
    ]


def judge(data: EvalData, reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray], gate: BuildGate,
          embedding_model: bool = False) -> dict:
    """The `quality` block of a build report."""
    kind = kind_of(data, gate, embedding_model)
    figures = measure(kind, data, reference, reference)  # FP32 against itself and the labels
    metrics = measure(kind, data, reference, candidate)
    verdicts = checks(kind, metrics, figures, gate)
    return {
        "kind": kind,
        "samples": data.count,
        "data": data.origin,
        "metrics": metrics,
        "reference": figures,
        "checks": [asdict(c) for c in verdicts],
        "passed": all(c.passed for c in verdicts),
        "enforced": gate.enforce,
    }
