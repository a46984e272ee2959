"""Model-config schema and loading: shipped configs, every rejection names file, field and
reason, version policies, Triton rendering, and server settings from the environment."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from server.config import (
    InstanceGroup,
    ModelConfig,
    VersionPolicy,
    load_model_config,
)
from server.errors import ConfigError
from server.triton_config import triton_model_config

REPO_ROOT = Path(__file__).resolve().parents[2]
MODELS = REPO_ROOT / "models"

BASE: dict = {
    "engine": "onnxruntime",
    "max_batch_size": 8,
    "inputs": [{"name": "x", "datatype": "FP32", "dims": [3]}],
    "outputs": [{"name": "y", "datatype": "FP32", "dims": [2]}],
}


def write_config(tmp_path: Path, document: object, folder: str = "toy") -> Path:
    model_dir = tmp_path / folder
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / "config.yaml"
    path.write_text(document if isinstance(document, str) else yaml.safe_dump(document))
    return path


def config_with(**changes: object) -> dict:
    document = {**BASE, **changes}
    return {k: v for k, v in document.items() if v is not None}


def assert_rejected(path: Path, *fragments: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_model_config(path)
    message = info.value.message
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# --- the shipped configs ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["digits", "minilm"])
def test_shipped_configs_validate(name: str) -> None:
    config = load_model_config(MODELS / name / "config.yaml")
    assert config.name == name
    assert config.batched
    assert config.dynamic_batching is not None
    assert [g.kind for g in config.instance_group] == ["CPU"]


def test_shipped_digits_details() -> None:
    config = load_model_config(MODELS / "digits" / "config.yaml")
    assert config.engine == "torch"
    assert config.max_batch_size == 256
    image = config.input("image")
    assert image is not None and image.datatype == "FP32" and image.dims == [1, 8, 8]
    assert config.api_shape(image) == [-1, 1, 8, 8]
    assert config.warmup.batch_sizes == [1, 16]


def test_shipped_minilm_details() -> None:
    config = load_model_config(MODELS / "minilm" / "config.yaml")
    assert config.engine == "onnxruntime"
    assert config.preprocess is not None and config.preprocess.tokenize is not None
    assert config.preprocess.tokenize.input == "text"
    assert config.preprocess.tokenize.max_length == 256
    embedding = config.output("embedding")
    assert embedding is not None
    assert embedding.engine_name == "sentence_embedding"
    assert embedding.source_name == "sentence_embedding"
    assert config.input("text").source_name == "text"  # type: ignore[union-attr]
    assert config.output("missing") is None


def test_minimal_config_defaults(tmp_path: Path) -> None:
    config = load_model_config(write_config(tmp_path, BASE))
    assert config.name == "toy"  # taken from the folder
    assert config.precision == "fp32"
    assert config.instance_group == [InstanceGroup()]
    assert config.instance_group[0].kind == "CPU" and config.instance_group[0].count == 1
    assert config.version_policy.select([1, 2, 3]) == [3]
    assert config.warmup.enabled and config.warmup.batch_sizes == [1]
    assert config.dynamic_batching is None


def test_explicit_matching_name_accepted(tmp_path: Path) -> None:
    assert load_model_config(write_config(tmp_path, config_with(name="toy"))).name == "toy"


# --- rejections: file, field, reason ---------------------------------------------------


def test_unknown_top_level_field(tmp_path: Path) -> None:
    path = write_config(tmp_path, config_with(batch_size=4))
    assert_rejected(path, "field 'batch_size'", "Extra inputs are not permitted")


def test_unknown_nested_field(tmp_path: Path) -> None:
    inputs = [{"name": "x", "datatype": "FP32", "dims": [3], "format": "NCHW"}]
    path = write_config(tmp_path, config_with(inputs=inputs))
    assert_rejected(path, "field 'inputs.0.format'", "Extra inputs are not permitted")


def test_wrong_type(tmp_path: Path) -> None:
    path = write_config(tmp_path, config_with(max_batch_size="lots"))
    assert_rejected(path, "field 'max_batch_size'", "valid integer")


def test_wrong_type_dims(tmp_path: Path) -> None:
    inputs = [{"name": "x", "datatype": "FP32", "dims": "3x3"}]
    path = write_config(tmp_path, config_with(inputs=inputs))
    assert_rejected(path, "field 'inputs.0.dims'", "valid list")


def test_unknown_engine(tmp_path: Path) -> None:
    path = write_config(tmp_path, config_with(engine="openvino"))
    assert_rejected(path, "field 'engine'", "onnxruntime")


def test_negative_max_batch_size(tmp_path: Path) -> None:
    path = write_config(tmp_path, config_with(max_batch_size=-1))
    assert_rejected(path, "field 'max_batch_size'", "greater than or equal to 0")


def test_unknown_datatype(tmp_path: Path) -> None:
    outputs = [{"name": "y", "datatype": "FLOAT32", "dims": [2]}]
    path = write_config(tmp_path, config_with(outputs=outputs))
    assert_rejected(path, "field 'outputs.0.datatype'", "unknown datatype 'FLOAT32'")


@pytest.mark.parametrize("dims", [[0], [3, 0], [-2], [4, -2]])
def test_bad_dims(tmp_path: Path, dims: list[int]) -> None:
    inputs = [{"name": "x", "datatype": "FP32", "dims": dims}]
    path = write_config(tmp_path, config_with(inputs=inputs))
    assert_rejected(path, "field 'inputs.0.dims'", "dims must be positive or -1")


def test_variable_dims_accepted(tmp_path: Path) -> None:
    inputs = [{"name": "x", "datatype": "FP32", "dims": [-1, 4]}]
    config = load_model_config(write_config(tmp_path, config_with(inputs=inputs)))
    assert config.inputs[0].dims == [-1, 4]
    assert config.api_shape(config.inputs[0]) == [-1, -1, 4]


def test_empty_inputs_rejected(tmp_path: Path) -> None:
    path = write_config(tmp_path, config_with(inputs=[]))
    assert_rejected(path, "field 'inputs'", "at least 1")


def test_missing_required_field(tmp_path: Path) -> None:
    document = dict(BASE)
    del document["outputs"]
    assert_rejected(write_config(tmp_path, document), "field 'outputs'", "Field required")


@pytest.mark.parametrize("kind", ["inputs", "outputs"])
def test_duplicate_tensor_names(tmp_path: Path, kind: str) -> None:
    tensors = [
        {"name": "t", "datatype": "FP32", "dims": [1]},
        {"name": "t", "datatype": "INT64", "dims": [2]},
    ]
    path = write_config(tmp_path, config_with(**{kind: tensors}))
    assert_rejected(path, f"{kind}: duplicate tensor names ['t']")


def test_tokenize_input_must_be_bytes(tmp_path: Path) -> None:
    path = write_config(tmp_path, config_with(preprocess={"tokenize": {"input": "x"}}))
    assert_rejected(path, "preprocess.tokenize.input 'x' must be a BYTES input")


def test_tokenize_input_must_exist(tmp_path: Path) -> None:
    path = write_config(tmp_path, config_with(preprocess={"tokenize": {"input": "nope"}}))
    assert_rejected(path, "preprocess.tokenize.input 'nope' must be a BYTES input")


def test_tokenize_bytes_input_accepted(tmp_path: Path) -> None:
    inputs = [{"name": "text", "datatype": "BYTES", "dims": [1]}]
    document = config_with(inputs=inputs, preprocess={"tokenize": {"input": "text"}})
    config = load_model_config(write_config(tmp_path, document))
    assert config.preprocess.tokenize.tokenizer == "tokenizer.json"  # type: ignore[union-attr]


def test_dynamic_batching_needs_batching(tmp_path: Path) -> None:
    path = write_config(tmp_path, config_with(max_batch_size=0, dynamic_batching={}))
    assert_rejected(path, "dynamic_batching needs max_batch_size > 0")


def test_preferred_batch_size_over_max(tmp_path: Path) -> None:
    document = config_with(dynamic_batching={"preferred_batch_size": [4, 16]})
    path = write_config(tmp_path, document)
    assert_rejected(path, "preferred_batch_size 16 exceeds max_batch_size 8")


def test_preferred_batch_size_at_max_accepted(tmp_path: Path) -> None:
    document = config_with(dynamic_batching={"preferred_batch_size": [4, 8]})
    config = load_model_config(write_config(tmp_path, document))
    assert config.dynamic_batching.preferred_batch_size == [4, 8]  # type: ignore[union-attr]


def test_warmup_batch_over_max(tmp_path: Path) -> None:
    path = write_config(tmp_path, config_with(warmup={"batch_sizes": [1, 9]}))
    assert_rejected(path, "warmup.batch_sizes exceed max_batch_size 8")


def test_warmup_batch_size_zero(tmp_path: Path) -> None:
    path = write_config(tmp_path, config_with(warmup={"batch_sizes": [0]}))
    assert_rejected(path, "field 'warmup.batch_sizes.0'", "greater than 0")


def test_warmup_values_per_input(tmp_path: Path) -> None:
    document = config_with(
        inputs=[{"name": "text", "datatype": "BYTES", "dims": [1]}, {"name": "count", "datatype": "INT8", "dims": [1]},
                {"name": "scale", "datatype": "FP16", "dims": [1]}, {"name": "flag", "datatype": "BOOL", "dims": [1]}],
        warmup={"inputs": {"text": "1.5", "count": -3, "scale": 2, "flag": True}},
    )
    config = load_model_config(write_config(tmp_path, document))
    assert config.warmup.inputs == {"text": "1.5", "count": -3, "scale": 2, "flag": True}
    assert load_model_config(write_config(tmp_path, config_with(), "plain")).warmup.inputs == {}


def test_warmup_values_for_unknown_inputs_are_refused(tmp_path: Path) -> None:
    path = write_config(tmp_path, config_with(warmup={"inputs": {"z": 1.0}}))
    assert_rejected(path, "warmup.inputs: 'z' is not an input (inputs: x)")


@pytest.mark.parametrize(
    ("datatype", "value", "reason"),
    [
        ("FP32", "1.5", "FP32 inputs take a number, not '1.5'"),
        ("FP32", True, "FP32 inputs take a number, not True"),
        ("INT32", 1.5, "INT32 inputs take an integer, not 1.5"),
        ("UINT8", 256, "256 is out of range for UINT8"),
        ("BYTES", 3, "BYTES inputs take a string, not 3"),
        ("BOOL", 1, "BOOL inputs take true or false, not 1"),
    ],
)
def test_warmup_values_must_fit_their_input(tmp_path: Path, datatype: str, value: object, reason: str) -> None:
    document = config_with(inputs=[{"name": "x", "datatype": datatype, "dims": [1]}], warmup={"inputs": {"x": value}})
    assert_rejected(write_config(tmp_path, document), f"warmup.inputs.x: {reason}")


def test_name_differs_from_folder(tmp_path: Path) -> None:
    path = write_config(tmp_path, config_with(name="other"), folder="toy")
    assert_rejected(path, "field 'name'", "'other' differs from its folder 'toy'")


def test_invalid_yaml(tmp_path: Path) -> None:
    path = write_config(tmp_path, "engine: torch\ninputs: [unclosed\n")
    assert_rejected(path, "not valid YAML")


@pytest.mark.parametrize("text", ["- engine: torch\n", "just a string\n", "", "42\n"])
def test_non_mapping_top_level(tmp_path: Path, text: str) -> None:
    path = write_config(tmp_path, text)
    assert_rejected(path, "expected a mapping at the top level")


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "ghost" / "config.yaml"
    assert_rejected(path, "cannot read")


def test_non_utf8_file_is_config_error(tmp_path: Path) -> None:
    model_dir = tmp_path / "toy"
    model_dir.mkdir()
    path = model_dir / "config.yaml"
    path.write_bytes(yaml.safe_dump(BASE).encode() + b"# caf\xe9\n")
    assert_rejected(path, "config.yaml")


def test_version_policy_latest_and_all(tmp_path: Path) -> None:
    document = config_with(version_policy={"latest": {"num_versions": 2}, "all": {}})
    path = write_config(tmp_path, document)
    assert_rejected(path, "field 'version_policy'", "choose one of latest, all, specific; got latest, all")


def test_version_policy_bad_values(tmp_path: Path) -> None:
    path = write_config(tmp_path, config_with(version_policy={"latest": {"num_versions": 0}}))
    assert_rejected(path, "field 'version_policy.latest.num_versions'")
    path = write_config(tmp_path, config_with(version_policy={"specific": {"versions": []}}))
    assert_rejected(path, "field 'version_policy.specific.versions'")


def test_several_errors_all_reported(tmp_path: Path) -> None:
    path = write_config(tmp_path, config_with(engine="openvino", precision="fp64"))
    assert_rejected(path, "field 'engine'", "field 'precision'")


# --- instance groups -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["KIND_GPU", "GPU", "gpu", "kind_gpu"])
def test_triton_style_gpu_kind_accepted(tmp_path: Path, kind: str) -> None:
    document = config_with(instance_group=[{"kind": kind, "count": 2, "gpus": [0, 1]}])
    config = load_model_config(write_config(tmp_path, document))
    group = config.instance_group[0]
    assert (group.kind, group.count, group.gpus) == ("GPU", 2, [0, 1])


def test_triton_style_cpu_kind_accepted(tmp_path: Path) -> None:
    config = load_model_config(write_config(tmp_path, config_with(instance_group=[{"kind": "KIND_CPU"}])))
    assert config.instance_group[0].kind == "CPU"


def test_unknown_instance_kind(tmp_path: Path) -> None:
    path = write_config(tmp_path, config_with(instance_group=[{"kind": "KIND_TPU"}]))
    assert_rejected(path, "field 'instance_group.0.kind'")


def test_instance_count_bounds(tmp_path: Path) -> None:
    path = write_config(tmp_path, config_with(instance_group=[{"count": 0}]))
    assert_rejected(path, "field 'instance_group.0.count'")
    path = write_config(tmp_path, config_with(instance_group=[{"count": 65}]))
    assert_rejected(path, "field 'instance_group.0.count'")


# --- VersionPolicy.select --------------------------------------------------------------


def test_select_default_is_latest_one() -> None:
    assert VersionPolicy().select([3, 1, 2]) == [3]


@pytest.mark.parametrize(
    ("n", "expected"), [(1, [7]), (2, [3, 7]), (3, [2, 3, 7]), (10, [1, 2, 3, 7])]
)
def test_select_latest_n(n: int, expected: list[int]) -> None:
    policy = VersionPolicy.model_validate({"latest": {"num_versions": n}})
    assert policy.select([7, 1, 3, 2]) == expected


def test_select_all() -> None:
    policy = VersionPolicy.model_validate({"all": {}})
    assert policy.select([5, 2, 9]) == [2, 5, 9]


def test_select_specific_only_those_on_disk() -> None:
    policy = VersionPolicy.model_validate({"specific": {"versions": [4, 1, 9]}})
    assert policy.select([1, 2, 3, 4]) == [1, 4]


def test_select_nothing_available() -> None:
    for document in ({}, {"all": {}}, {"specific": {"versions": [1]}}, {"latest": {"num_versions": 2}}):
        assert VersionPolicy.model_validate(document).select([]) == []


@pytest.mark.parametrize(
    "document", [{"latest": {}, "specific": {"versions": [1]}}, {"all": {}, "specific": {"versions": [1]}}]
)
def test_version_policy_exactly_one(document: dict) -> None:
    with pytest.raises(ValueError, match="choose one of latest, all, specific"):
        VersionPolicy.model_validate(document)


# --- Triton rendering ------------------------------------------------------------------


def test_triton_model_config_rendering(tmp_path: Path) -> None:
    document = config_with(
        inputs=[{"name": "text", "datatype": "BYTES", "dims": [1]}],
        outputs=[{"name": "y", "datatype": "FP16", "dims": [-1, 2]}],
        instance_group=[{"kind": "KIND_GPU", "count": 2, "gpus": [1]}, {"kind": "CPU"}],
        dynamic_batching={"max_queue_delay_microseconds": 100, "preferred_batch_size": [4]},
        version_policy={"specific": {"versions": [1, 3]}},
        precision="fp16",
    )
    rendered = triton_model_config(load_model_config(write_config(tmp_path, document)))
    assert rendered["name"] == "toy"
    assert rendered["platform"] == "onnxruntime_onnx" and rendered["backend"] == "onnxruntime"
    assert rendered["max_batch_size"] == 8
    assert rendered["input"] == [{"name": "text", "data_type": "TYPE_STRING", "dims": [1]}]
    assert rendered["output"] == [{"name": "y", "data_type": "TYPE_FP16", "dims": [-1, 2]}]
    assert rendered["instance_group"] == [
        {"name": "toy_0", "kind": "KIND_GPU", "count": 2, "gpus": [1]},
        {"name": "toy_1", "kind": "KIND_CPU", "count": 1, "gpus": []},
    ]
    assert rendered["version_policy"] == {"specific": {"versions": [1, 3]}}
    assert rendered["dynamic_batching"] == {
        "max_queue_delay_microseconds": 100,
        "preferred_batch_size": [4],
        "preserve_ordering": False,
        "priority_levels": 0,
        "default_priority_level": 0,
        "default_queue_policy": {
            "max_queue_size": 0,
            "default_timeout_microseconds": 0,
            "allow_timeout_override": True,
            "timeout_action": "REJECT",
        },
    }
    assert rendered["parameters"] == {"precision": {"string_value": "fp16"}}


def test_triton_version_policy_rendering() -> None:
    base = {k: v for k, v in BASE.items()}
    default = ModelConfig.model_validate({**base, "name": "m"})
    assert triton_model_config(default)["version_policy"] == {"latest": {"num_versions": 1}}
    assert "dynamic_batching" not in triton_model_config(default)
    everything = ModelConfig.model_validate({**base, "name": "m", "version_policy": {"all": {}}})
    assert triton_model_config(everything)["version_policy"] == {"all": {}}
    torch = ModelConfig.model_validate({**base, "name": "m", "engine": "torch"})
    assert triton_model_config(torch)["parameters"] == {"precision": {"string_value": "fp32"}}


def test_triton_config_says_what_a_build_was_built_as() -> None:
    built = ModelConfig.model_validate({**BASE, "name": "m-int8", "engine": "torch",
                                        "build": {"source": "m", "engine": "torch", "precision": "int8"}})
    rendered = triton_model_config(built)
    parameters = {k: v["string_value"] for k, v in rendered["parameters"].items()}
    assert parameters == {"precision": "fp32", "build_source": "m", "build_engine": "torch",
                          "build_precision": "int8", "build_device": "cpu"}


def test_priority_levels_and_instances_in_all_are_bounded(tmp_path: Path) -> None:
    """3,000,000 levels loaded: a queue each, looked at by every dispatch (the event loop stalled
    3 s, and 2.3 GB), and five groups of 64 instances started 320 threads and engines."""
    levels = write_config(tmp_path, config_with(dynamic_batching={"priority_levels": 3_000_000}), "levels")
    assert_rejected(levels, "priority_levels", "100")
    groups = write_config(tmp_path, config_with(instance_group=[{"count": 64}] * 5), "groups")
    assert_rejected(groups, "320 instances in all, over 128")
    per_gpu = write_config(tmp_path, config_with(instance_group=[{"count": 40, "kind": "GPU", "gpus": [0, 1, 2, 3]}]),
                           "per_gpu")
    assert_rejected(per_gpu, "160 instances in all")
    assert load_model_config(write_config(tmp_path, config_with(
        dynamic_batching={"priority_levels": 100}, instance_group=[{"count": 64}] * 2), "fine")).levels == 100


def test_engine_threads_are_bounded(tmp_path: Path) -> None:
    """A load asking for 5,000 intra-op threads took 85 s and left the server 5,016 threads;
    100,000 crashed it."""
    for field, options in (("onnxruntime.intra_op_num_threads", {"onnxruntime": {"intra_op_num_threads": 5000}}),
                           ("onnxruntime.inter_op_num_threads", {"onnxruntime": {"inter_op_num_threads": 257}}),
                           ("torch.num_threads", {"torch": {"num_threads": 100_000}})):
        assert_rejected(write_config(tmp_path, config_with(**options), field), f"field '{field}'")
    fine = load_model_config(write_config(tmp_path, config_with(onnxruntime={"intra_op_num_threads": 256}), "fine"))
    assert fine.onnxruntime.intra_op_num_threads == 256


def test_a_number_field_refuses_true_and_false(tmp_path: Path) -> None:
    """`max_batch_size: true` (or YAML's `yes`) was read as 1."""
    assert_rejected(write_config(tmp_path, "name: toy\n" + yaml.safe_dump({**BASE, "max_batch_size": True})),
                    "max_batch_size", "not true or false")
    assert_rejected(write_config(tmp_path, config_with(dynamic_batching={"max_queue_delay_microseconds": False}),
                                 "delay"), "not true or false")
    assert load_model_config(write_config(tmp_path, config_with(dynamic_batching={"preserve_ordering": True}),
                                          "flag")).dynamic_batching.preserve_ordering
    listed = write_config(tmp_path, config_with(inputs=[{"name": "x", "datatype": "FP32", "dims": [True]}]), "listed")
    assert_rejected(listed, "inputs.0.dims", "not true or false")
    buckets = write_config(tmp_path, config_with(batch_buckets=[True, 8]), "buckets")
    assert_rejected(buckets, "batch_buckets", "not true or false")
    assert load_model_config(write_config(tmp_path, config_with(batch_buckets=[1, 8]), "fine_buckets")).batch_buckets == [1, 8]
