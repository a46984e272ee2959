"""The quality metrics and the gate, on hand-made arrays."""

from __future__ import annotations

import numpy as np
import pytest

from server.config import BuildGate
from server.quantize.quality import (
    checks,
    classification_metrics,
    cosines,
    embedding_metrics,
    nearest_neighbours,
    triplet_margins,
)


def test_cosines_do_not_assume_unit_norm() -> None:
    a = np.array([[1.0, 0.0], [0.0, 2.0]])
    b = np.array([[3.0, 0.0], [1.0, 1.0]])
    assert cosines(a, b) == pytest.approx([1.0, np.sqrt(0.5)])


def test_nearest_neighbours_skip_self() -> None:
    v = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]])
    assert nearest_neighbours(v).tolist() == [1, 0, 1]


def test_triplet_margins_sign() -> None:
    anchor, positive, negative = [1.0, 0.0], [0.9, 0.1], [0.0, 1.0]
    assert triplet_margins(np.array([anchor, positive, negative]))[0] > 0
    assert triplet_margins(np.array([anchor, negative, positive]))[0] < 0


def test_classification_metrics() -> None:
    ref = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]])
    cand = np.array([[0.8, 0.2], [0.3, 0.7], [0.4, 0.6]])
    m = classification_metrics(ref, cand, np.array([0, 1, 1]))
    assert m["accuracy"] == pytest.approx(1.0)
    assert m["top1_agreement"] == pytest.approx(2 / 3)
    assert m["max_abs_error"] == pytest.approx(0.2)


def test_embedding_metrics_identical_is_perfect() -> None:
    rng = np.random.default_rng(0)
    v, t = rng.normal(size=(10, 8)), rng.normal(size=(6, 8))
    m = embedding_metrics(v, v, t, t)
    assert m["mean_cosine"] == pytest.approx(1.0)
    assert m["neighbour_agreement"] == 1.0
    assert m["triplet_order_agreement"] == 1.0
    assert m["max_abs_error"] == 0.0


def test_gate_thresholds_come_from_the_spec() -> None:
    gate = BuildGate(min_accuracy_ratio=0.99)
    ok = checks("classification", {"accuracy": 0.975}, {"accuracy": 0.98}, gate)
    assert ok[0].passed and ok[0].threshold == pytest.approx(0.9702)
    bad = checks("classification", {"accuracy": 0.96}, {"accuracy": 0.98}, gate)
    assert not bad[0].passed
    emb = checks("embedding", {"mean_cosine": 0.995, "neighbour_agreement": 0.93}, {}, BuildGate())
    assert [c.passed for c in emb] == [True, False]


def test_nan_fails_the_gate() -> None:
    assert not checks("embedding", {"mean_cosine": float("nan"), "neighbour_agreement": 1.0}, {}, BuildGate())[0].passed
