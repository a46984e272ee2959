"""A model's own evaluation data (eval/inputs.npz, eval/labels.npy): checked against its config,
split once and deterministically into calibration and evaluation items that never overlap, and
judged by the gate its kind calls for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from server.config import BuildGate, ModelConfig
from server.layout import INPUTS_FILE, LABELS_FILE
from server.quantize.data import MAX_CALIBRATION, TensorData, load_eval_data
from server.quantize.errors import BuildError, EvalDataUnavailable
from server.quantize.quality import checks, judge, kind_of, tensor_metrics


def config(**changes: Any) -> ModelConfig:
    document = {
        "name": "mine",
        "engine": "onnxruntime",
        "max_batch_size": 32,
        "inputs": [{"name": "a", "datatype": "FP32", "dims": [3]}, {"name": "b", "datatype": "INT64", "dims": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [2]}],
    }
    return ModelConfig.model_validate(document | changes)


def write(model_dir: Path, labels: np.ndarray | None = None, **arrays: np.ndarray) -> Path:
    (model_dir / "eval").mkdir(parents=True, exist_ok=True)
    np.savez(model_dir / INPUTS_FILE, **arrays)
    if labels is not None:
        np.save(model_dir / LABELS_FILE, labels)
    return model_dir


def items(count: int) -> dict[str, np.ndarray]:
    return {"a": np.arange(count * 3, dtype=np.float32).reshape(count, 3), "b": np.arange(count).reshape(count, 1)}


def test_the_split_is_deterministic_disjoint_and_covers_every_item(tmp_path: Path) -> None:
    write(tmp_path, labels=np.arange(10) % 3, **items(10))
    data = load_eval_data(tmp_path, tmp_path / "1", config())
    assert isinstance(data, TensorData) and data.kind == "classification" and data.output == "y"
    assert (data.count, data.calibration_count) == (5, 5)
    evaluated, calibrated = set(data.inputs["b"].ravel()), set(data.calibration["b"].ravel())
    assert not evaluated & calibrated and evaluated | calibrated == set(range(10))
    assert data.labels is not None and data.labels.tolist() == [int(i) % 3 for i in data.inputs["b"].ravel()]
    again = load_eval_data(tmp_path, tmp_path / "1", config())
    assert np.array_equal(again.inputs["a"], data.inputs["a"]) and again.fingerprint == data.fingerprint


def test_calibration_takes_at_most_its_cap_and_leaves_the_rest_to_evaluate(tmp_path: Path) -> None:
    write(tmp_path, **items(1000))
    data = load_eval_data(tmp_path, tmp_path / "1", config())
    assert isinstance(data, TensorData) and data.kind == "tensor" and data.labels is None
    assert (data.calibration_count, data.count) == (MAX_CALIBRATION, 1000 - MAX_CALIBRATION)


@pytest.mark.parametrize(("arrays", "labels", "message"), [
    ({"a": np.zeros((4, 3), np.float32)}, None, r"holds \['a'\]; the model's inputs are \['a', 'b'\]"),
    ({**items(4), "c": np.zeros(4)}, None, "the model's inputs are"),
    ({"a": np.zeros((4, 3), np.float32), "b": np.zeros((3, 1), np.int64)}, None, "same number of items"),
    ({"a": np.zeros((1, 3), np.float32), "b": np.zeros((1, 1), np.int64)}, None, "at least 2"),
    ({"a": np.array([["x"] * 3] * 4), "b": np.zeros((4, 1), np.int64)}, None, "'a' is FP32 in the config"),
    (items(4), np.zeros(3, np.int64), "one integer class per item"),
    ({"a": np.zeros((4, 3), np.float32), "b": np.full((4, 1), 1.5)}, None,
     "'b' is INT64 in the config but holds float64, which does not cast"),
    ({"a": np.zeros((4, 4), np.float32), "b": np.zeros((4, 1), np.int64)}, None,
     r"'a' holds items of shape \[4\]; the config's dims are \[3\]"),
    ({"a": np.zeros(4, np.float32), "b": np.zeros((4, 1), np.int64)}, None, r"'a' holds items of shape \[\]"),
    (items(4), np.zeros(4, np.float32), "one integer class per item"),
])
def test_data_that_does_not_fit_the_model_is_refused_saying_why(
    tmp_path: Path, arrays: dict[str, np.ndarray], labels: np.ndarray | None, message: str
) -> None:
    write(tmp_path, labels=labels, **arrays)
    with pytest.raises(BuildError, match=message):
        load_eval_data(tmp_path, tmp_path / "1", config())


def test_numbers_come_as_the_inputs_datatype_whatever_numpy_made_them(tmp_path: Path) -> None:
    """np.load of ordinary data gives float64: the INT8 build calibrated on it as it was, and
    ONNX Runtime refused a double for a float (the README's own commands failed there)."""
    write(tmp_path, a=np.arange(30, dtype=np.float64).reshape(10, 3), b=np.arange(10, dtype=np.int32).reshape(10, 1))
    data = load_eval_data(tmp_path, tmp_path / "1", config())
    assert isinstance(data, TensorData)
    for part in (data.inputs, data.calibration):
        assert (part["a"].dtype, part["b"].dtype) == (np.float32, np.int64)


def test_the_gate_judges_the_first_numeric_output(tmp_path: Path) -> None:
    write(tmp_path, **items(8))
    labelled = config(outputs=[{"name": "label", "datatype": "BYTES", "dims": [1]},
                               {"name": "score", "datatype": "FP32", "dims": [2]}])
    assert load_eval_data(tmp_path, tmp_path / "1", labelled).output == "score"
    with pytest.raises(BuildError, match="no numeric output for the gate"):
        load_eval_data(tmp_path, tmp_path / "1", config(outputs=[{"name": "label", "datatype": "BYTES", "dims": [1]}]))


def test_text_comes_as_a_numpy_string_array(tmp_path: Path) -> None:
    text = config(inputs=[{"name": "text", "datatype": "BYTES", "dims": [1]}])
    write(tmp_path, text=np.array([["one"], ["two"], ["three"], ["four"]]))
    data = load_eval_data(tmp_path, tmp_path / "1", text)
    assert isinstance(data, TensorData) and data.inputs["text"].dtype.kind == "U"
    write(tmp_path, text=np.zeros((4, 1), np.float32))
    with pytest.raises(BuildError, match="'text' is BYTES in the config"):
        load_eval_data(tmp_path, tmp_path / "1", text)


def test_no_data_says_what_to_put_where(tmp_path: Path) -> None:
    with pytest.raises(EvalDataUnavailable, match=r"eval/inputs.npz is missing.*named as in its config"):
        load_eval_data(tmp_path, tmp_path / "1", config())


def test_the_gate_follows_the_kind_and_the_gate_may_choose_it(tmp_path: Path) -> None:
    write(tmp_path, **items(8))
    data = load_eval_data(tmp_path, tmp_path / "1", config())
    assert kind_of(data, BuildGate()) == "tensor"
    assert kind_of(data, BuildGate(), embedding_model=True) == "embedding"
    assert kind_of(data, BuildGate(kind="classification")) == "classification"
    reference = {"output": np.array([[1.0, 0.0]] * data.count, np.float32)}
    close = {"output": reference["output"] * 1.01}
    quality = judge(data, reference, close, BuildGate())
    assert quality["kind"] == "tensor" and quality["passed"] and quality["samples"] == data.count
    assert quality["metrics"]["mean_relative_error"] == pytest.approx(0.01, rel=1e-3)
    far = judge(data, reference, {"output": reference["output"] * 1.5}, BuildGate())
    assert not far["passed"] and far["checks"][0]["op"] == "<="
    agreeing = judge(data, reference, close, BuildGate(kind="classification"))
    assert [c["metric"] for c in agreeing["checks"]] == ["top1_agreement"] and agreeing["passed"]


def test_relative_error_is_per_item_and_a_nan_fails() -> None:
    reference = np.array([[3.0, 4.0], [0.0, 1.0]])
    figures = tensor_metrics(reference, reference + np.array([[0.0, 0.5], [0.0, 0.0]]))
    assert figures["max_relative_error"] == pytest.approx(0.1) and figures["mean_relative_error"] == pytest.approx(0.05)
    broken = tensor_metrics(reference, np.full_like(reference, np.nan))
    assert not checks("tensor", broken, {}, BuildGate())[0].passed
