"""Variant folders: derived config, version numbering, atomic publish, rejection, cache key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from server.config import BuildSpec, load_model_config
from server.engines.digests import file_digest
from server.layout import version_numbers
from server.quantize import variant
from server.quantize.cache import cache_key
from server.quantize.cli import parse_option
from server.quantize.errors import BuildError

SOURCE = {
    "name": "digits", "engine": "torch", "max_batch_size": 16,
    "inputs": [{"name": "image", "datatype": "FP32", "dims": [1, 8, 8]}],
    "outputs": [{"name": "probabilities", "datatype": "FP32", "dims": [10]}],
    "dynamic_batching": {"max_queue_delay_microseconds": 100},
    "torch": {"num_threads": 2},
}
SPEC = BuildSpec(source="digits", engine="onnxruntime", precision="int8")


def test_derived_config_keeps_the_interface_and_records_the_build() -> None:
    derived = variant.derive_config(SOURCE, name="digits-onnxruntime-int8", engine="onnxruntime",
                                    precision="int8", model_filename=None, spec=SPEC)
    assert derived["name"] == "digits-onnxruntime-int8" and derived["engine"] == "onnxruntime"
    assert derived["inputs"] == SOURCE["inputs"] and derived["dynamic_batching"] == SOURCE["dynamic_batching"]
    assert "torch" not in derived  # another engine's block is dropped
    assert derived["build"]["source"] == "digits" and derived["build"]["gate"]["min_mean_cosine"] == 0.99


def test_a_variant_does_not_record_traffic_as_its_source_does() -> None:
    """A variant is never a build's source: recording its users' inputs would serve nothing."""
    recording = {**SOURCE, "record_traffic": {"max_items": 10}}
    derived = variant.derive_config(recording, name="digits-onnxruntime-int8", engine="onnxruntime",
                                    precision="int8", model_filename=None, spec=SPEC)
    assert "record_traffic" not in derived


def test_publish_numbers_versions_and_writes_a_loadable_config(tmp_path: Path) -> None:
    folder = tmp_path / "digits-onnxruntime-int8"
    derived = variant.derive_config(SOURCE, name=folder.name, engine="onnxruntime", precision="int8",
                                    model_filename=None, spec=SPEC)
    with variant.locked(folder):
        for expected in (1, 2):
            with variant.staging(folder) as stage:
                (stage / "model.onnx").write_bytes(b"x")
                assert variant.publish(folder, stage, derived, "digits") == expected
    assert version_numbers(folder) == [1, 2]
    assert not [p for p in folder.iterdir() if p.name.startswith(".build-")]
    config = load_model_config(folder / "config.yaml")
    assert config.build == SPEC and config.precision == "int8"


def test_a_failed_stage_leaves_nothing_servable(tmp_path: Path) -> None:
    folder = tmp_path / "v"
    with variant.locked(folder):
        with pytest.raises(RuntimeError), variant.staging(folder) as stage:
            (stage / "model.onnx").write_bytes(b"half")
            raise RuntimeError("converter crashed")
        variant.cleanup_if_empty(folder)
    assert not folder.exists()


def test_rejected_builds_are_not_versions(tmp_path: Path) -> None:
    folder = tmp_path / "v"
    with variant.locked(folder), variant.staging(folder) as stage:
        (stage / "build.json").write_text("{}")
        kept = variant.reject(folder, stage, "f" * 64)
    assert kept.is_dir() and version_numbers(folder) == []
    assert not (folder / "config.yaml").exists()


def test_derived_config_must_validate() -> None:
    broken = dict(SOURCE, max_batch_size=0)  # dynamic_batching without batching
    with pytest.raises(BuildError, match="invalid"):
        variant.derive_config(broken, name="x", engine="onnxruntime", precision="int8", model_filename=None, spec=SPEC)


def test_cache_key_covers_every_input(tmp_path: Path) -> None:
    artifact = tmp_path / "m.onnx"
    artifact.write_bytes(b"weights")
    base = {"source_digest": file_digest(artifact), "source_config": SOURCE, "engine": "onnxruntime", "precision": "int8",
                "device": "cpu", "options": {"per_channel": True}, "data_fingerprint": "d", "versions": {"onnxruntime": "1.0"}}
    key = cache_key(**base)
    assert key == cache_key(**base)
    artifact.write_bytes(b"weightz")
    assert cache_key(**{**base, "source_digest": file_digest(artifact)}) != key
    for change in ({"engine": "torch"}, {"precision": "fp16"}, {"device": "gpu"}, {"options": {"per_channel": False}},
                   {"data_fingerprint": "e"}, {"versions": {"onnxruntime": "1.1"}}):
        assert cache_key(**{**base, **change}) != key


def test_parse_option() -> None:
    assert parse_option("per_channel=false") == ("per_channel", False)
    assert parse_option("mode=static") == ("mode", "static")
    assert parse_option("workspace_mb=512") == ("workspace_mb", 512)
    with pytest.raises(ValueError):
        parse_option("novalue")


def test_yaml_round_trip_of_generated_config(tmp_path: Path) -> None:
    derived = variant.derive_config(SOURCE, name="v", engine="onnxruntime", precision="int8",
                                    model_filename=None, spec=SPEC)
    assert yaml.safe_load(yaml.safe_dump(derived)) == derived


def test_a_gpu_build_serves_on_gpu_instances() -> None:
    derived = variant.derive_config(SOURCE, name="digits-gpu", engine="torch", precision="fp16",
                                    model_filename=None, spec=SPEC.model_copy(update={"device": "gpu"}))
    assert [g["kind"] for g in derived["instance_group"]] == ["GPU"] and derived["build"]["device"] == "gpu"
    cpu = variant.derive_config(SOURCE, name="digits-cpu", engine="torch", precision="fp16",
                                model_filename=None, spec=SPEC)
    assert "instance_group" not in cpu  # the source's placement (the default, CPU) is kept


def test_a_rebuild_takes_the_new_device_and_the_new_types() -> None:
    gpu_spec = SPEC.model_copy(update={"device": "gpu"})
    fp16_io = variant.derive_config(SOURCE, name="v", engine="onnxruntime", precision="fp16", model_filename=None,
                                    spec=gpu_spec, datatypes={"image": "FP16", "probabilities": "FP16"})
    assert fp16_io["instance_group"][0]["kind"] == "GPU" and fp16_io["inputs"][0]["datatype"] == "FP16"
    rebuilt = variant.derive_config(fp16_io, name="v", engine="onnxruntime", precision="fp16", model_filename=None,
                                    spec=SPEC, datatypes={"image": "FP32", "probabilities": "FP32"})
    assert rebuilt["instance_group"][0]["kind"] == "CPU"  # a CPU rebuild of a GPU build
    assert [t["datatype"] for t in rebuilt["inputs"] + rebuilt["outputs"]] == ["FP32", "FP32"]
