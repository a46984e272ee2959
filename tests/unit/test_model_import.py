"""`batchline import`: a user's ONNX file or torch.export program becomes a model folder whose
config is read from the model, serves, and asks instead of guessing where the model is silent."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from onnx import TensorProto, helper

from server import model_import
from server.config import load_model_config
from server.engines.digests import RECORD, file_digest
from server.errors import ConfigError, InvalidInput
from server.model_import import ImportRefused, import_model, parse_dims
from server.repository import ModelRepository
from tests.unit.onnx_models import doubling, parse_and_double, save, unstated_rank
from tests.unit.torch_models import Linear

ROOT = Path(__file__).resolve().parents[2]


def onnx_file(tmp_path: Path, writer=doubling) -> Path:  # type: ignore[no-untyped-def]
    return writer(tmp_path / "source") / "model.onnx"


async def test_an_onnx_file_with_a_batch_axis_imports_batched_and_serves(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    folder = import_model(onnx_file(tmp_path), repository, "mine")
    config = load_model_config(folder / "config.yaml")
    assert config.engine == "onnxruntime" and config.max_batch_size == 32
    assert [(t.name, t.datatype, t.dims) for t in config.inputs] == [("x", "FP32", [2])]
    assert [(t.name, t.datatype, t.dims) for t in config.outputs] == [("y", "FP32", [2])]
    queue = config.dynamic_batching.default_queue_policy if config.dynamic_batching else None
    assert queue is not None and queue.max_queue_size > 0, "bounded by default, as the shipped models are"
    digest, name = (folder / "1" / RECORD).read_text().split()
    assert name == "model.onnx" and digest == file_digest(folder / "1" / "model.onnx")
    served = ModelRepository(repository)
    await served.load("mine")
    try:
        result = await served.get("mine").start_request({"x": ("FP32", np.array([[1.0, 2.0]], np.float32))})
        assert result["y"].tolist() == [[2.0, 4.0]]
    finally:
        await served.unload_all()


def test_string_tensors_become_bytes(tmp_path: Path) -> None:
    folder = import_model(onnx_file(tmp_path, parse_and_double), tmp_path / "models", "parse")
    config = load_model_config(folder / "config.yaml")
    assert [(t.name, t.datatype) for t in config.inputs] == [("text", "BYTES")]
    assert [(t.name, t.datatype) for t in config.outputs] == [("doubled", "FP32"), ("doubled_text", "BYTES")]


def test_a_fixed_first_dim_serves_unbatched_with_the_full_shape(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])
    save(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]), tmp_path / "fixed")
    folder = import_model(tmp_path / "fixed" / "model.onnx", tmp_path / "models", "fixed")
    config = load_model_config(folder / "config.yaml")
    assert config.max_batch_size == 0 and config.dynamic_batching is None
    assert config.inputs[0].dims == [1, 3]
    with pytest.raises(ImportRefused, match="first dim of x, y is not variable"):
        import_model(tmp_path / "fixed" / "model.onnx", tmp_path / "models", "fixed2", max_batch_size=8)


def test_an_output_whose_first_dim_is_fixed_is_a_question(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])
    total = helper.make_tensor_value_info("total", TensorProto.FLOAT, [3])
    graph = helper.make_graph([helper.make_node("ReduceMax", ["x"], ["total"], axes=[0], keepdims=0)], "g", [x], [total])
    save(graph, tmp_path / "sum")
    with pytest.raises(ImportRefused, match=r"not that of total: is the first dim a batch dim\?"):
        import_model(tmp_path / "sum" / "model.onnx", tmp_path / "models", "sum")
    folder = import_model(tmp_path / "sum" / "model.onnx", tmp_path / "models", "sum", max_batch_size=0)
    assert load_model_config(folder / "config.yaml").inputs[0].dims == [-1, 3]


def test_an_unknown_rank_is_asked_for_and_answered_with_dims(tmp_path: Path) -> None:
    artifact = onnx_file(tmp_path, unstated_rank)
    with pytest.raises(ImportRefused, match="does not say the rank of 'y'.*--dims y=-1,3"):
        import_model(artifact, tmp_path / "models", "squeeze")
    assert not (tmp_path / "models" / "squeeze").exists(), "nothing is written for a refused import"
    folder = import_model(artifact, tmp_path / "models", "squeeze", dims=parse_dims(["y=-1"]))
    config = load_model_config(folder / "config.yaml")
    assert config.max_batch_size == 0, "`axes` has a fixed first dim: not a batch dim"
    assert config.outputs[0].dims == [-1]


def test_names_and_places_are_checked_before_anything_is_written(tmp_path: Path) -> None:
    artifact = onnx_file(tmp_path)
    import_model(artifact, tmp_path / "models", "mine")
    with pytest.raises(ImportRefused, match="exists already"):
        import_model(artifact, tmp_path / "models", "mine")
    with pytest.raises(ImportRefused, match="use letters, digits"):
        import_model(artifact, tmp_path / "models", "../elsewhere")
    with pytest.raises(ImportRefused, match="not a model file this server imports"):
        import_model(tmp_path / "model.bin", tmp_path / "models", "other")
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a graph")
    with pytest.raises(ImportRefused, match="ONNX Runtime cannot load it"):
        import_model(broken, tmp_path / "models", "broken")
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["mine"], "no staging folder is left behind"


@pytest.mark.parametrize("value", ["x", "x=", "x=0", "x=a,b", "=3", "x=-2"])
def test_bad_dims_are_refused(value: str) -> None:
    with pytest.raises(ImportRefused, match="expected NAME=D1,D2"):
        parse_dims([value])


class Scale(torch.nn.Module):
    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return image.flatten(1).sum(1, keepdim=True) * 2


async def test_a_torch_export_program_imports_batched_and_serves(tmp_path: Path) -> None:
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(Scale(), (torch.ones(2, 1, 4),), dynamic_shapes={"image": {0: batch}})
    torch.export.save(program, tmp_path / "scale.pt2")
    folder = import_model(tmp_path / "scale.pt2", tmp_path / "models", "scale")
    config = load_model_config(folder / "config.yaml")
    assert config.engine == "torch" and config.max_batch_size == 32
    assert [(t.name, t.datatype, t.dims) for t in config.inputs] == [("image", "FP32", [1, 4])]
    assert [(t.datatype, t.dims) for t in config.outputs] == [("FP32", [1])]
    served = ModelRepository(tmp_path / "models")
    await served.load("scale")
    try:
        output = config.outputs[0].name
        result = await served.get("scale").start_request({"image": ("FP32", np.ones((3, 1, 4), np.float32))})
        assert result[output].tolist() == [[8.0], [8.0], [8.0]]
    finally:
        await served.unload_all()


class Named(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": x * 2, "probs": x.softmax(-1)}


class Nested(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        return x, (x * 2, x * 3)


class Listed(torch.nn.Module):
    def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
        return xs[0] + xs[1]


class Keyword(torch.nn.Module):
    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return x * scale


@pytest.mark.parametrize(("module", "args", "kwargs", "reason"), [
    (Named(), (torch.ones(2, 3),), {}, "returns a dict or a nested structure"),
    (Nested(), (torch.ones(2, 3),), {}, "returns a dict or a nested structure"),
    (Listed(), ([torch.ones(2, 3), torch.ones(2, 3)],), {}, "takes keyword, list or dict arguments"),
    (Keyword(), (torch.ones(2, 3),), {"scale": torch.ones(2, 3)}, "takes keyword, list or dict arguments"),
])
def test_a_program_the_server_cannot_call_by_position_is_refused_at_import(
    tmp_path: Path, module: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object], reason: str
) -> None:
    """Each imported, and its model then failed at warm-up: the server passes and reads tensors
    by position."""
    torch.export.save(torch.export.export(module, args, kwargs), tmp_path / "m.pt2")
    with pytest.raises(ImportRefused, match=reason):
        import_model(tmp_path / "m.pt2", tmp_path / "models", "m")
    assert not (tmp_path / "models" / "m").exists()


async def test_a_programs_batch_range_bounds_its_max_batch_size(tmp_path: Path) -> None:
    """Exported for batches up to 16, it was given 32: a request of 20 rows was a 500."""
    def exported(name: str, dim: torch.export.Dim) -> Path:
        program = torch.export.export(Scale(), (torch.ones(4, 1, 4),), dynamic_shapes={"image": {0: dim}})
        torch.export.save(program, tmp_path / f"{name}.pt2")
        return tmp_path / f"{name}.pt2"

    upto16 = exported("upto16", torch.export.Dim("batch", min=1, max=16))
    folder = import_model(upto16, tmp_path / "models", "upto16")
    assert load_model_config(folder / "config.yaml").max_batch_size == 16
    with pytest.raises(ImportRefused, match="exported for batches of at most 16"):
        import_model(upto16, tmp_path / "models", "upto16b", max_batch_size=20)
    with pytest.raises(ImportRefused, match="takes batches of 3 or more"):
        import_model(exported("from3", torch.export.Dim("batch", min=3)), tmp_path / "models", "from3")
    # a config written by hand past the program's max is a bad config at load
    config = folder / "config.yaml"
    config.write_text(config.read_text().replace("max_batch_size: 16", "max_batch_size: 32"))
    served = ModelRepository(tmp_path / "models")
    with pytest.raises(InvalidInput, match="max_batch_size 32 is over the 16 the program was exported for"):
        await served.load("upto16")
    await served.unload_all()


async def test_a_programs_precision_is_what_its_weights_are(tmp_path: Path) -> None:
    """An all-FP16 program was written as fp32: the engine cast its inputs to FP32 and warm-up
    failed (Float and Half). FP64 weights are refused, and BF16 tensors, which no engine here
    takes from numpy."""
    batch = torch.export.Dim("batch", min=1, max=64)

    def exported(name: str, module: torch.nn.Module, dtype: torch.dtype) -> Path:
        program = torch.export.export(module.to(dtype), (torch.ones(2, 3, dtype=dtype),), dynamic_shapes={"x": {0: batch}})
        torch.export.save(program, tmp_path / f"{name}.pt2")
        return tmp_path / f"{name}.pt2"

    folder = import_model(exported("half", Linear(), torch.float16), tmp_path / "models", "half")
    config = load_model_config(folder / "config.yaml")
    assert config.precision == "fp16" and config.inputs[0].datatype == "FP16"
    served = ModelRepository(tmp_path / "models")
    await served.load("half")
    try:
        result = await served.get("half").start_request({"x": ("FP16", np.ones((2, 3), np.float16))})
        assert result[config.outputs[0].name].shape == (2, 2)
    finally:
        await served.unload_all()
    with pytest.raises(ImportRefused, match="weights are torch.float64"):
        import_model(exported("double", Linear(), torch.float64), tmp_path / "models", "double")
    with pytest.raises(ImportRefused, match="'x' is BF16"):
        import_model(exported("brain", Linear(), torch.bfloat16), tmp_path / "models", "brain")


def test_an_onnx_graph_of_half_tensors_is_written_as_fp16(tmp_path: Path) -> None:
    """Its precision is what the artifact holds: written as fp32, a build took it for the FP32
    reference and judged an INT8 build against it."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["n", 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["n", 2])
    save(helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "half", [x], [y]), tmp_path / "half")
    folder = import_model(tmp_path / "half" / "model.onnx", tmp_path / "models", "half")
    assert load_model_config(folder / "config.yaml").precision == "fp16"
    assert load_model_config(import_model(onnx_file(tmp_path), tmp_path / "models", "full") / "config.yaml").precision == "fp32"


class Twice(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 2
        return y, y


def test_a_draft_the_schema_refuses_is_a_message_not_a_traceback(tmp_path: Path) -> None:
    """The same tensor returned twice drafts two outputs of one name: a pydantic traceback before."""
    batch = torch.export.Dim("batch", min=1, max=64)
    torch.export.save(torch.export.export(Twice(), (torch.ones(2, 3),), dynamic_shapes={"x": {0: batch}}),
                      tmp_path / "twice.pt2")
    with pytest.raises(ConfigError, match=r"the config drafted from .*twice.pt2: .*duplicate tensor names"):
        import_model(tmp_path / "twice.pt2", tmp_path / "models", "twice")


def test_a_file_system_refusal_is_a_message_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A folder it cannot read, a repository it cannot write: a traceback before."""
    def refused(*_: object, **__: object) -> Path:
        raise PermissionError(13, "Permission denied", str(tmp_path / "models"))

    monkeypatch.setattr(model_import, "import_model", refused)
    args = model_import.add_import_parser(argparse.ArgumentParser().add_subparsers()).parse_args(
        [str(onnx_file(tmp_path)), "--name", "m", "--model-repository", str(tmp_path / "models")])
    assert model_import.run_import(args) == 2
    assert "batchline import: [Errno 13] Permission denied" in capsys.readouterr().err


def test_the_command_writes_the_folder_and_says_how_to_serve_it(tmp_path: Path) -> None:
    artifact = onnx_file(tmp_path)
    run = subprocess.run(
        [sys.executable, "-m", "server.cli", "import", str(artifact), "--name", "mine",
         "--model-repository", str(tmp_path / "models")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "batchline serve --model-repository" in run.stdout and "--model mine" in run.stdout
    text = (tmp_path / "models" / "mine" / "config.yaml").read_text()
    assert text.startswith("# Written by `batchline import` from model.onnx")
    assert yaml.safe_load(text)["name"] == "mine"
    again = subprocess.run(
        [sys.executable, "-m", "server.cli", "import", str(artifact), "--name", "mine",
         "--model-repository", str(tmp_path / "models")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert again.returncode == 2 and "exists already" in again.stderr and "Traceback" not in again.stderr


def test_an_onnx_file_with_external_data_brings_its_data(tmp_path: Path) -> None:
    """Models over 2 GB (and many exports) keep their weights in files beside the graph: those
    are copied and recorded too, or the published folder would not load."""
    import onnx
    from onnx import numpy_helper

    weight = numpy_helper.from_array(np.full((2, 2), 3.0, np.float32), "w")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    source = tmp_path / "exported"
    source.mkdir()
    onnx.save(model, source / "model.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="weights.bin", size_threshold=0)
    folder = import_model(source / "model.onnx", tmp_path / "models", "external")
    assert (folder / "1" / "weights.bin").read_bytes() == (source / "weights.bin").read_bytes()
    recorded = sorted(line.split()[1] for line in (folder / "1" / RECORD).read_text().splitlines())
    assert recorded == ["model.onnx", "weights.bin"]
    (source / "weights.bin").unlink()
    with pytest.raises(ImportRefused, match="weights.bin"):  # ONNX Runtime says it first
        import_model(source / "model.onnx", tmp_path / "models", "orphan")
