"""A config is checked against the model's own signature at load, for every engine alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from server.config import ModelConfig
from server.devices import Device
from server.engines import create_engine
from server.engines.signature import (
    EngineSignature,
    TensorSignature,
    check_results,
    check_signature,
    engine_inputs,
)
from server.engines.spec import EngineIO
from server.errors import EngineError
from tests.integration.conftest import MODELS, require_built_models
from tests.unit.engines.test_engines import digits_config
from tests.unit.onnx_models import DOUBLING_CONFIG, doubling

DIGITS = MODELS / "digits" / "1"


@pytest.fixture
def built_digits() -> None:
    """A missing model is a failure with the reason (make test builds it), never a skip."""
    require_built_models(("digits",))


def config(**overrides: Any) -> ModelConfig:
    return ModelConfig.model_validate({"name": "double", **DOUBLING_CONFIG, **overrides})


def io(**overrides: Any) -> EngineIO:
    """What the check reads of `config(**overrides)`."""
    return EngineIO.from_config(config(**overrides))


def engine(inputs: list[TensorSignature], outputs: list[TensorSignature], **flags: bool) -> EngineSignature:
    return EngineSignature(tuple(inputs), tuple(outputs), **flags)


X = TensorSignature("x", "FP32", (None, 2))
Y = TensorSignature("y", "FP32", (None, 2))


def test_a_matching_config_passes() -> None:
    check_signature(io(), engine([X], [Y]))


def test_wrong_output_dims_name_the_tensor_the_config_and_the_model() -> None:
    wrong = io(outputs=[{"name": "y", "datatype": "FP32", "dims": [3]}])
    with pytest.raises(
        EngineError, match=r"output 'y': the config says FP32 \[-1, 3\], the model has FP32 \[-1, 2\]"
    ):
        check_signature(wrong, engine([X], [Y]))


def test_wrong_datatypes_are_refused() -> None:
    ints = io(outputs=[{"name": "y", "datatype": "INT64", "dims": [2]}])
    with pytest.raises(EngineError, match=r"output 'y': the config says INT64 \[-1, 2\], the model has FP32"):
        check_signature(ints, engine([X], [Y]))
    halves = io(inputs=[{"name": "x", "datatype": "FP16", "dims": [2]}])
    with pytest.raises(EngineError, match=r"input 'x': the config says FP16"):  # ONNX Runtime casts nothing
        check_signature(halves, engine([X], [Y]))


def test_an_unbatched_model_under_a_batched_config_is_refused() -> None:
    whole = TensorSignature("x", "FP32", (2,))
    with pytest.raises(
        EngineError, match=r"input 'x': the config says FP32 \[-1, 2\], the model has FP32 \[2\]"
    ):
        check_signature(io(), engine([whole], [Y]))


def test_a_fixed_batch_needs_a_single_bucket_of_that_size() -> None:
    fixed = engine([TensorSignature("x", "FP32", (4, 2))], [TensorSignature("y", "FP32", (4, 2))])
    with pytest.raises(EngineError, match=r"the model has FP32 \[4, 2\]"):
        check_signature(io(), fixed)
    check_signature(io(batch_buckets=[4]), fixed)  # every batch is padded to 4 rows


def test_variable_engine_dims_may_be_fixed_by_the_config_not_the_reverse_for_inputs() -> None:
    open_dims = engine(
        [TensorSignature("x", "FP32", (None, None))], [TensorSignature("y", "FP32", (None, None))]
    )
    check_signature(io(), open_dims)
    variable = io(
        inputs=[{"name": "x", "datatype": "FP32", "dims": [-1]}],
        outputs=[{"name": "y", "datatype": "FP32", "dims": [-1]}],
    )
    with pytest.raises(
        EngineError, match=r"input 'x': the config says FP32 \[-1, -1\], the model has FP32 \[-1, 2\]"
    ):
        check_signature(variable, engine([X], [Y]))
    wide_open_output = io(outputs=[{"name": "y", "datatype": "FP32", "dims": [-1]}])
    check_signature(wide_open_output, engine([X], [Y]))  # -1 promises clients nothing the model breaks


def test_precision_builds_may_give_another_float_type() -> None:
    half = TensorSignature("y", "FP16", (None, 2))
    check_signature(io(precision="fp16"), engine([X], [half]))  # the pipeline casts outputs to FP32
    with pytest.raises(EngineError, match="input 'x'"):
        check_signature(io(), engine([TensorSignature("x", "FP16", (None, 2))], [Y]))
    check_signature(io(), engine([TensorSignature("x", "FP16", (None, 2))], [Y], casts_float_inputs=True))
    with pytest.raises(EngineError, match="INT64"):  # a cast covers floats only
        check_signature(
            io(), engine([TensorSignature("x", "INT64", (None, 2))], [Y], casts_float_inputs=True)
        )


def test_engine_names_and_extra_engine_tensors() -> None:
    renamed = io(outputs=[{"name": "doubled", "datatype": "FP32", "dims": [2], "engine_name": "y"}])
    extra_output = TensorSignature("debug", "FP32", (None, 8))
    check_signature(renamed, engine([X], [Y, extra_output]))  # outputs nobody asked for are fine
    with pytest.raises(EngineError, match=r"the model takes input 'mask', which the config does not feed"):
        check_signature(io(), engine([X, TensorSignature("mask", "INT64", (None, 2))], [Y]))
    with pytest.raises(
        EngineError,
        match=r"output 'doubled' \(engine name 'y'\): the config says FP32 \[-1, 2\], the model has FP32 \[-1, 3\]",
    ):
        check_signature(renamed, engine([X], [TensorSignature("y", "FP32", (None, 3))]))


def test_every_problem_is_reported_at_once() -> None:
    wrong = io(
        inputs=[{"name": "x", "datatype": "FP32", "dims": [3]}],
        outputs=[{"name": "y", "datatype": "INT32", "dims": [2]}],
    )
    with pytest.raises(EngineError, match="input 'x'.*; output 'y'"):
        check_signature(wrong, engine([X], [Y]))


def test_a_tokenized_text_input_is_checked_as_its_token_tensors() -> None:
    text = EngineIO.from_config(ModelConfig.model_validate(
        {
            "name": "embed",
            "engine": "onnxruntime",
            "max_batch_size": 8,
            "inputs": [{"name": "text", "datatype": "BYTES", "dims": [1]}],
            "outputs": [{"name": "embedding", "datatype": "FP32", "dims": [4], "engine_name": "pooled"}],
            "preprocess": {"tokenize": {"input": "text", "token_type_ids": None}},
        }
    ))
    assert [(t.engine_name, t.datatype, t.shape) for t in engine_inputs(text)] == [
        ("input_ids", "INT64", (-1, -1)),
        ("attention_mask", "INT64", (-1, -1)),
    ]
    tokens = [TensorSignature(n, "INT64", (None, None)) for n in ("input_ids", "attention_mask")]
    check_signature(text, engine(tokens, [TensorSignature("pooled", "FP32", (None, 4))]))
    with pytest.raises(
        EngineError, match=r"input 'attention_mask' \(a token tensor of 'text'\): the config says INT64"
    ):
        check_signature(
            text,
            engine(
                [tokens[0], TensorSignature("attention_mask", "INT32", (None, None))],
                [TensorSignature("pooled", "FP32", (None, 4))],
            ),
        )


def test_positional_engines_match_by_order_and_count() -> None:
    program = engine(
        [TensorSignature("arg0", "FP32", (None, 2))],
        [TensorSignature("out", "FP32", (None, 2))],
        positional=True,
    )
    check_signature(io(), program)
    with pytest.raises(EngineError, match=r"output 'y': .* the model has FP32 \[-1, 2\] \(output 'out'\)"):
        check_signature(io(outputs=[{"name": "y", "datatype": "FP32", "dims": [5]}]), program)
    two_inputs = io(
        inputs=[
            {"name": "a", "datatype": "FP32", "dims": [2]},
            {"name": "b", "datatype": "FP32", "dims": [2]},
        ]
    )
    with pytest.raises(EngineError, match=r"the config declares 2 inputs, the model has 1 \(arg0\)"):
        check_signature(two_inputs, program)


def test_types_without_a_v2_name_are_named_as_the_engine_names_them() -> None:
    fp8 = TensorSignature("y", None, (None, 2), "tensor(float8e4m3fn)")
    with pytest.raises(EngineError, match=r"the model has tensor\(float8e4m3fn\) \[-1, 2\]"):
        check_signature(io(), engine([X], [fp8]))


def test_results_are_checked_per_item() -> None:
    check_results(io(), {"y": np.zeros((3, 2), np.float32)}, 3)
    check_results(io(), {"y": np.zeros((3, 2), np.float16)}, 3)  # cast to FP32 by the pipeline
    with pytest.raises(
        EngineError,
        match=r"output 'y': the config says FP32 \[-1, 2\], the model returned FP32 \[3, 5\] for a batch of 3",
    ):
        check_results(io(), {"y": np.zeros((3, 5), np.float32)}, 3)
    with pytest.raises(EngineError, match=r"returned FP32 \[1, 2\] for a batch of 3"):  # rows must come back
        check_results(io(), {"y": np.zeros((1, 2), np.float32)}, 3)
    with pytest.raises(EngineError, match="returned INT64"):
        check_results(io(), {"y": np.zeros((3, 2), np.int64)}, 3)
    with pytest.raises(EngineError, match="returned no such output"):
        check_results(io(), {}, 3)


# --- ONNX Runtime: the session's own types and shapes ------------------------------------------


def test_onnxruntime_refuses_a_config_that_misdescribes_the_graph(tmp_path: Path) -> None:
    version = doubling(tmp_path / "1")
    wrong_dims = config(outputs=[{"name": "y", "datatype": "FP32", "dims": [3]}])
    with pytest.raises(
        EngineError, match=r"output 'y': the config says FP32 \[-1, 3\], the model has FP32 \[-1, 2\]"
    ):
        create_engine(wrong_dims, version, Device("CPU"))
    wrong_type = config(outputs=[{"name": "y", "datatype": "INT32", "dims": [2]}])
    with pytest.raises(EngineError, match=r"output 'y': the config says INT32 \[-1, 2\], the model has FP32"):
        create_engine(wrong_type, version, Device("CPU"))
    unbatched = config(
        max_batch_size=0,
        inputs=[{"name": "x", "datatype": "FP32", "dims": [3, 2]}],
        outputs=[{"name": "y", "datatype": "FP32", "dims": [3, 2]}],
    )
    create_engine(unbatched, version, Device("CPU"))  # the graph's variable batch dim, fixed by the config


def test_onnxruntime_reads_symbolic_dims_as_variable(tmp_path: Path) -> None:
    signature = create_engine(config(), doubling(tmp_path / "1"), Device("CPU")).signature()
    assert signature.inputs == (TensorSignature("x", "FP32", (None, 2), "tensor(float)"),)
    assert not signature.positional and not signature.casts_float_inputs


def test_the_shipped_text_model_loads_against_its_signature() -> None:
    from server.config import load_model_config

    require_built_models(("minilm",))
    minilm = MODELS / "minilm"
    engine = create_engine(load_model_config(minilm / "config.yaml"), minilm / "1", Device("CPU"))
    assert {t.name for t in engine.signature().inputs} == {"input_ids", "attention_mask", "token_type_ids"}


# --- torch.export: the program's placeholders ---------------------------------------------------


@pytest.mark.usefixtures("built_digits")
def test_torch_reads_the_programs_fake_tensors() -> None:
    signature = create_engine(digits_config(), DIGITS, Device("CPU")).signature()
    assert [(t.datatype, t.shape) for t in signature.inputs] == [("FP32", (None, 1, 8, 8))]
    assert [(t.datatype, t.shape) for t in signature.outputs] == [("FP32", (None, 10))]
    assert signature.positional and signature.casts_float_inputs


@pytest.mark.usefixtures("built_digits")
def test_torch_refuses_a_config_that_misdescribes_the_program() -> None:
    with pytest.raises(
        EngineError,
        match=r"output 'probabilities': the config says FP32 \[-1, 3\], the model has FP32 \[-1, 10\]",
    ):
        create_engine(
            digits_config(outputs=[{"name": "probabilities", "datatype": "FP32", "dims": [3]}]),
            DIGITS,
            Device("CPU"),
        )
    with pytest.raises(EngineError, match=r"input 'image': the config says FP32 \[-1, 8, 8\]"):
        create_engine(
            digits_config(inputs=[{"name": "image", "datatype": "FP32", "dims": [8, 8]}]),
            DIGITS,
            Device("CPU"),
        )
    with pytest.raises(EngineError, match=r"input 'image': the config says INT64"):
        create_engine(
            digits_config(inputs=[{"name": "image", "datatype": "INT64", "dims": [1, 8, 8]}]),
            DIGITS,
            Device("CPU"),
        )


@pytest.mark.usefixtures("built_digits")
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_torch_precision_casts_still_load_under_fp32_configs(precision: str) -> None:
    create_engine(digits_config(precision=precision), DIGITS, Device("CPU"))
