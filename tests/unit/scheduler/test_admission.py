"""Admission checks, output selection, error-to-status mapping and device placement."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from server import errors
from server.config import InstanceGroup, ModelConfig
from server.dataplane import output_tensors
from server.devices import Device, placements
from server.errors import EngineError, InvalidInput
from server.gpu import cuda_visible
from server.http.errors import STATUS_BY_ERROR, status_of
from server.model import ModelVersion
from server.scheduler.admission import Admission, Admitted, validate_inputs


def model(max_batch_size: int = 4, tokenize: bool = False, **changes: Any) -> ModelConfig:
    document: dict[str, Any] = {
        "name": "toy",
        "engine": "onnxruntime",
        "max_batch_size": max_batch_size,
        "inputs": [
            {"name": "image", "datatype": "FP32", "dims": [2, 3]},
            {"name": "mask", "datatype": "INT64", "dims": [-1]},
        ],
        "outputs": [
            {"name": "scores", "datatype": "FP32", "dims": [10]},
            {"name": "label", "datatype": "BYTES", "dims": [1]},
        ],
        **changes,
    }
    if tokenize:
        document["inputs"] = [*document["inputs"], {"name": "text", "datatype": "BYTES", "dims": [1]}]
        document["preprocess"] = {"tokenize": {"input": "text"}}
    return ModelConfig.model_validate(document)


def batch(n: int, mask_len: int = 5, **override: tuple[str, np.ndarray]) -> dict[str, tuple[str, np.ndarray]]:
    inputs = {
        "image": ("FP32", np.zeros((n, 2, 3), dtype=np.float32)),
        "mask": ("INT64", np.ones((n, mask_len), dtype=np.int64)),
    }
    inputs.update(override)
    return inputs


def texts(*items: bytes) -> tuple[str, np.ndarray]:
    array = np.empty((len(items), 1), dtype=object)
    array[:, 0] = list(items)
    return "BYTES", array


# --- validate_inputs: batched models -----------------------------------------------------


@pytest.mark.parametrize("n", [1, 3, 4])
def test_batched_ok(n: int) -> None:
    inputs = batch(n)
    validated, batch_size = validate_inputs(model(), inputs)
    assert batch_size == n
    assert list(validated) == ["image", "mask"]
    assert validated["image"] is inputs["image"][1]
    assert validated["mask"] is inputs["mask"][1]


def test_config_order_not_request_order() -> None:
    inputs = dict(reversed(list(batch(2).items())))
    validated, _ = validate_inputs(model(), inputs)
    assert list(validated) == ["image", "mask"]


@pytest.mark.parametrize("mask_len", [1, 7, 100])
def test_wildcard_dim_accepts_any_length(mask_len: int) -> None:
    _, batch_size = validate_inputs(model(), batch(2, mask_len=mask_len))
    assert batch_size == 2


def test_batch_over_max() -> None:
    with pytest.raises(InvalidInput, match=r"batch size 5 is outside 1\.\.4"):
        validate_inputs(model(), batch(5))


def test_batch_of_zero() -> None:
    with pytest.raises(InvalidInput, match=r"batch size 0 is outside 1\.\.4"):
        validate_inputs(model(), batch(0))


def test_batch_sizes_disagree() -> None:
    inputs = batch(2, mask=("INT64", np.ones((3, 5), dtype=np.int64)))
    with pytest.raises(InvalidInput, match=r"disagree on the batch size: \[2, 3\]"):
        validate_inputs(model(), inputs)


def test_missing_batch_dim() -> None:
    inputs = batch(1, image=("FP32", np.zeros((2, 3), dtype=np.float32)))
    with pytest.raises(InvalidInput, match=r"input 'image' has shape \[2, 3\].*expects \[-1, 2, 3\]"):
        validate_inputs(model(), inputs)


@pytest.mark.parametrize("shape", [(2, 3, 2), (2, 2, 3, 1), (2, 6)])
def test_wrong_shape(shape: tuple[int, ...]) -> None:
    inputs = batch(2, image=("FP32", np.zeros(shape, dtype=np.float32)))
    with pytest.raises(InvalidInput, match="input 'image' has shape"):
        validate_inputs(model(), inputs)


def test_wrong_datatype() -> None:
    inputs = batch(2, image=("FP64", np.zeros((2, 2, 3), dtype=np.float64)))
    with pytest.raises(InvalidInput, match="input 'image' has datatype FP64, model 'toy' expects FP32"):
        validate_inputs(model(), inputs)


def test_unknown_input() -> None:
    inputs = batch(2, extra=("FP32", np.zeros((2, 1), dtype=np.float32)))
    with pytest.raises(InvalidInput, match=r"unexpected input 'extra' for model 'toy' \(inputs: image, mask\)"):
        validate_inputs(model(), inputs)


def test_wrong_name_is_unknown() -> None:
    inputs = batch(2)
    inputs["Image"] = inputs.pop("image")
    with pytest.raises(InvalidInput, match="unexpected input 'Image'"):
        validate_inputs(model(), inputs)


def test_missing_input() -> None:
    inputs = batch(2)
    del inputs["mask"]
    with pytest.raises(InvalidInput, match="expects input 'mask', which is missing"):
        validate_inputs(model(), inputs)


# --- validate_inputs: unbatched models ---------------------------------------------------


def test_unbatched_model() -> None:
    config = model(max_batch_size=0)
    inputs = {
        "image": ("FP32", np.zeros((2, 3), dtype=np.float32)),
        "mask": ("INT64", np.ones(9, dtype=np.int64)),
    }
    validated, batch_size = validate_inputs(config, inputs)
    assert batch_size == 1
    assert validated["image"].shape == (2, 3)


def test_unbatched_model_rejects_batch_dim() -> None:
    config = model(max_batch_size=0)
    inputs = {
        "image": ("FP32", np.zeros((1, 2, 3), dtype=np.float32)),
        "mask": ("INT64", np.ones(9, dtype=np.int64)),
    }
    with pytest.raises(InvalidInput, match=r"expects \[2, 3\]"):
        validate_inputs(config, inputs)


def test_unbatched_first_dims_may_differ() -> None:
    config = ModelConfig.model_validate(
        {
            "name": "u",
            "engine": "torch",
            "inputs": [
                {"name": "a", "datatype": "FP32", "dims": [-1]},
                {"name": "b", "datatype": "FP32", "dims": [-1]},
            ],
            "outputs": [{"name": "y", "datatype": "FP32", "dims": [1]}],
        }
    )
    inputs = {"a": ("FP32", np.zeros(2, np.float32)), "b": ("FP32", np.zeros(7, np.float32))}
    assert validate_inputs(config, inputs)[1] == 1


# --- text inputs -------------------------------------------------------------------------


def test_text_input_decoded_to_str() -> None:
    inputs = batch(2, text=texts("h\u00e9llo".encode(), b"world"))
    validated, batch_size = validate_inputs(model(tokenize=True), inputs)
    assert batch_size == 2
    text = validated["text"]
    assert text.dtype == object and text.shape == (2, 1)
    assert text.tolist() == [["h\u00e9llo"], ["world"]]
    assert all(type(x) is str for x in text.reshape(-1))
    assert validated["image"] is inputs["image"][1]  # only the text input is converted


def test_text_input_invalid_utf8() -> None:
    inputs = batch(3, text=texts(b"ok", b"fine", b"\xff\xfe bad"))
    with pytest.raises(InvalidInput, match="input 'text' item 2 is not valid UTF-8"):
        validate_inputs(model(tokenize=True), inputs)


def test_bytes_input_without_tokenize_stays_bytes() -> None:
    config = model(
        inputs=[{"name": "raw", "datatype": "BYTES", "dims": [1]}],
    )
    _, array = texts("h\u00e9".encode(), b"a")
    validated, _ = validate_inputs(config, {"raw": ("BYTES", array)})
    assert validated["raw"].tolist() == [["h\u00e9".encode()], [b"a"]]


def test_bytes_input_that_is_not_utf8_is_refused_at_the_door() -> None:
    """Engines take BYTES as string tensors (UTF-8 text): a bad item would fail its whole batch."""
    config = model(inputs=[{"name": "raw", "datatype": "BYTES", "dims": [1]}])
    with pytest.raises(InvalidInput, match="input 'raw' item 0 is not valid UTF-8"):
        validate_inputs(config, {"raw": texts(b"\xff", b"a")})


# --- output_tensors ----------------------------------------------------------------------


def test_all_outputs_by_default_in_the_configs_order(tmp_path: Path) -> None:
    assert ModelVersion(model(), 1, tmp_path).every_output == (("scores", "FP32"), ("label", "BYTES"))


def test_requested_outputs_in_request_order() -> None:
    assert output_tensors(model(), ["label", "scores"]) == [("label", "BYTES"), ("scores", "FP32")]


def test_unknown_output() -> None:
    with pytest.raises(InvalidInput, match=r"model 'toy' has no output 'logits' \(outputs: scores, label\)"):
        output_tensors(model(), ["scores", "logits"])


# --- status_of ---------------------------------------------------------------------------

EXPECTED_STATUS = {
    errors.InvalidInput: 400,
    errors.Unsupported: 400,
    errors.ConfigError: 400,
    errors.ConfigMismatch: 400,
    errors.ModelNotFound: 404,
    errors.PayloadTooLarge: 413,
    errors.QueueFull: 429,
    errors.ServerBusy: 429,
    errors.Cancelled: 499,
    errors.RequestTimeout: 408,
    errors.EngineError: 500,
    errors.Unavailable: 503,
    errors.DeadlineExceeded: 504,
    errors.TooLongForDeadline: 504,
    errors.ExecutionTimeout: 504,
    errors.OutOfMemory: 500,
    errors.BatchlineError: 500,
}


@pytest.mark.parametrize("cls", list(EXPECTED_STATUS), ids=lambda c: c.__name__)
def test_status_of(cls: type[errors.BatchlineError]) -> None:
    assert status_of(cls("boom")) == EXPECTED_STATUS[cls]


def test_every_error_type_is_covered() -> None:
    defined = {
        obj
        for obj in vars(errors).values()
        if isinstance(obj, type) and issubclass(obj, errors.BatchlineError)
    }
    assert defined == set(EXPECTED_STATUS)
    assert set(STATUS_BY_ERROR) == defined - {errors.BatchlineError}


def test_status_of_subclass_follows_parent() -> None:
    class Narrow(errors.QueueFull):
        pass

    assert status_of(Narrow("x", retry_after_s=3)) == 429


# --- placements --------------------------------------------------------------------------


def groups(*documents: dict[str, Any]) -> list[InstanceGroup]:
    return [InstanceGroup.model_validate(d) for d in documents]


@pytest.mark.parametrize("gpu_count", [0, 2])
def test_cpu_groups(gpu_count: int) -> None:
    devices = placements(groups({"count": 3}, {"kind": "CPU"}), gpu_count=gpu_count)
    assert devices == [Device("CPU")] * 4
    assert [str(d) for d in devices] == ["cpu"] * 4


def test_gpu_without_gpus_is_engine_error() -> None:
    with pytest.raises(EngineError, match="no GPU is visible"):
        placements(groups({"kind": "KIND_GPU"}), gpu_count=0)
    with pytest.raises(EngineError, match="no GPU is visible"):
        placements(groups({"kind": "GPU", "gpus": [0]}), gpu_count=0)


def test_gpu_count_per_visible_gpu() -> None:
    devices = placements(groups({"kind": "GPU", "count": 2}), gpu_count=2)
    assert devices == [Device("GPU", 0), Device("GPU", 0), Device("GPU", 1), Device("GPU", 1)]
    assert [str(d) for d in devices] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]


def test_gpu_groups_that_take_every_gpu_count_toward_the_bound_on_instances() -> None:
    """The config's own check cannot know how many GPUs a group without `gpus` takes: two groups
    of 64 on eight GPUs are 1,024 instances."""
    with pytest.raises(errors.ConfigMismatch, match="places 1024 instances on this machine's 8 GPUs, over 128"):
        placements(groups({"kind": "GPU", "count": 64}, {"kind": "GPU", "count": 64}), gpu_count=8)
    assert len(placements(groups({"kind": "GPU", "count": 16}), gpu_count=8)) == 128


def test_gpu_list() -> None:
    assert placements(groups({"kind": "GPU", "gpus": [1]}), gpu_count=2) == [Device("GPU", 1)]
    assert placements(groups({"kind": "GPU", "count": 3, "gpus": [1, 0]}), gpu_count=2) == (
        [Device("GPU", 1)] * 3 + [Device("GPU", 0)] * 3
    )


def test_gpu_list_names_missing_gpu() -> None:
    with pytest.raises(EngineError, match=r"names GPUs \[2, 3\], but only 2 are visible"):
        placements(groups({"kind": "GPU", "gpus": [0, 2, 3]}), gpu_count=2)


def test_mixed_groups_in_order() -> None:
    devices = placements(groups({"kind": "GPU", "gpus": [1]}, {"count": 2}), gpu_count=2)
    assert devices == [Device("GPU", 1), Device("CPU"), Device("CPU")]


def test_empty_gpu_list_is_rejected_not_zero_instances() -> None:
    with pytest.raises(ValidationError, match="gpus"):
        groups({"kind": "GPU", "gpus": []})


def test_cuda_visible_devices_narrows_the_gpus_instances_may_use() -> None:
    assert cuda_visible(8, None) == 8
    assert cuda_visible(8, "3,5") == 2  # CUDA numbers them cuda:0 and cuda:1
    assert cuda_visible(8, "GPU-1f2e") == 1
    assert cuda_visible(8, "") == 0  # nothing visible
    assert cuda_visible(1, "0,1,2") == 1  # never more than are present
    assert cuda_visible(8, "-1") == 0  # the usual way to hide every GPU
    assert cuda_visible(8, "2,bogus,3") == 1  # CUDA stops at the first entry it cannot read


def test_a_padded_input_leaves_the_shape_key_and_gives_its_dims_to_the_padding_bound() -> None:
    config = model(inputs=[
        {"name": "image", "datatype": "FP32", "dims": [2, 3]},
        {"name": "mask", "datatype": "INT64", "dims": [-1], "pad_value": 0},
    ])
    admitted = Admission(config, None).admit_or_offload(batch(2, mask_len=7), {})
    assert isinstance(admitted, Admitted)
    assert admitted.shape_key == (("image", (2, 3)),)  # any mask length joins the batch
    assert admitted.padded == ((7,),)  # so the batcher bounds what it pads to
