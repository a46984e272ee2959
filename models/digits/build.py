"""Build the `digits` model: a small CNN on scikit-learn's 8x8 digits, saved with torch.export.

Run offline:  python models/digits/build.py [--output DIR]

Writes into the output dir (default: models/digits/1):
  model.pt2     torch.export ExportedProgram; input float32 [batch, 1, 8, 8]
                with raw pixel values 0..16 (the model scales by 1/16
                itself), output softmax probabilities float32 [batch, 10];
                batch is dynamic (1..4096)
  heldout.npz   the stratified 20% held-out split: images float32
                [n, 1, 8, 8] (raw 0..16), labels int64 [n]; for tests and
                quantization calibration
  SHA256SUMS    both files' sha256 (`sha256sum -c SHA256SUMS`), checked by
                the server before it loads the model

Training is seeded and deterministic. The build fails (exit 1) if held-out
accuracy is below 95% or the reloaded program disagrees with the eager model.
Artifacts are written under temporary names and renamed only after the
checks pass, so a failed build never leaves a half model behind; the record
is written last (a crash before it leaves a record that no longer matches,
and the server refuses the model until it is rebuilt).
"""

from __future__ import annotations

import argparse
import io
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from server.engines.digests import record_digests

SEED = 0
MAX_BATCH = 4096
MIN_ACCURACY = 0.95
EPOCHS = 40
BATCH_SIZE = 64
LEARNING_RATE = 3e-3
CHECK_BATCHES = (1, 7, 64)


class DigitsNet(nn.Module):
    """Two 3x3 convs + linear head; takes raw 0..16 pixels so clients send data as-is."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 64),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(64, 10),
        )

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Unnormalised scores; training uses these for a stable cross-entropy."""
        return self.head(self.features(x * (1.0 / 16.0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.logits(x), dim=1)


def parse_args() -> Path:
    """Only --output: the build has no other knobs by design."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output",
        type=Path,
        default=Path(__file__).resolve().parent / "1",
        help="output directory (default: models/digits/1)",
    )
    return parser.parse_args().output


def seed_everything(seed: int) -> None:
    """Same weights on every build, so tests and calibration are reproducible."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    try:
        torch.use_deterministic_algorithms(True)
    except RuntimeError as err:  # pragma: no cover - not expected on CPU
        print(f"[digits] deterministic algorithms unavailable: {err}")


def load_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Stratified 80/20 split of sklearn digits as float32 [n,1,8,8] raw pixels / int64 labels."""
    data = load_digits()
    images = data.images.astype(np.float32)[:, None, :, :]
    labels = data.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.2, random_state=0, stratify=labels
    )
    return x_train, x_test, y_train, y_test


def train(model: DigitsNet, images: np.ndarray, labels: np.ndarray) -> None:
    """Plain Adam + cross-entropy on shuffled mini-batches with a seeded generator."""
    x, y = torch.from_numpy(images), torch.from_numpy(labels)
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=EPOCHS)
    generator = torch.Generator().manual_seed(SEED)
    model.train()
    for _ in range(EPOCHS):
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x), BATCH_SIZE):
            idx = order[start : start + BATCH_SIZE]
            loss = nn.functional.cross_entropy(model.logits(x[idx]), y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        scheduler.step()
    model.eval()


@torch.no_grad()
def accuracy(model: nn.Module, images: np.ndarray, labels: np.ndarray) -> float:
    """Top-1 accuracy of the probability output."""
    probs = model(torch.from_numpy(images))
    return float((probs.argmax(dim=1).numpy() == labels).mean())


def export(model: DigitsNet) -> torch.export.ExportedProgram:
    """torch.export with a dynamic batch dim.

    The example batch is > 1 on purpose: tracing at batch 1 would specialise
    the dim to a constant. The resulting range still admits batch 1 at run time.
    """
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    example = torch.zeros(8, 1, 8, 8, dtype=torch.float32)
    return torch.export.export(model.eval(), (example,), dynamic_shapes=({0: batch},))


def save_program(program: torch.export.ExportedProgram, path: Path) -> None:
    """Serialise to bytes first, then write, so the file appears only when complete."""
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    path.write_bytes(buffer.getvalue())


def save_heldout(images: np.ndarray, labels: np.ndarray, path: Path) -> None:
    """Plain arrays only (no object arrays), loadable with allow_pickle=False."""
    with path.open("wb") as f:
        np.savez(f, images=images.astype(np.float32), labels=labels.astype(np.int64))


@torch.no_grad()
def verify_program(path: Path, model: DigitsNet, images: np.ndarray) -> bool:
    """Reload model.pt2 and compare with the eager model at several batch sizes."""
    loaded = torch.export.load(str(path)).module()
    ok = True
    for n in CHECK_BATCHES:
        x = torch.from_numpy(images[:n])
        got, want = loaded(x), model(x)
        close = got.shape == (n, 10) and got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-6)
        print(f"  reloaded program batch {n:3d}: shape {tuple(got.shape)} allclose={close}")
        ok = ok and close
    return ok


def verify_heldout(path: Path, images: np.ndarray, labels: np.ndarray) -> bool:
    """Reload heldout.npz without pickle and check it round-trips exactly."""
    with np.load(path, allow_pickle=False) as data:
        return (
            data["images"].dtype == np.float32
            and data["labels"].dtype == np.int64
            and np.array_equal(data["images"], images)
            and np.array_equal(data["labels"], labels)
        )


def discard(staged: dict[Path, Path]) -> None:
    """Remove temp files of a failed build."""
    for tmp in staged:
        tmp.unlink(missing_ok=True)


def main() -> int:
    started = time.perf_counter()
    out = parse_args()
    out.mkdir(parents=True, exist_ok=True)
    seed_everything(SEED)

    x_train, x_test, y_train, y_test = load_split()
    print(f"[digits] train {len(y_train)}, held-out {len(y_test)} (stratified, random_state=0)")

    model = DigitsNet()
    train_start = time.perf_counter()
    train(model, x_train, y_train)
    train_s = time.perf_counter() - train_start
    train_acc, test_acc = accuracy(model, x_train, y_train), accuracy(model, x_test, y_test)
    print(f"[digits] trained {EPOCHS} epochs in {train_s:.1f}s: train acc {train_acc:.4f}, held-out acc {test_acc:.4f}")
    if test_acc < MIN_ACCURACY:
        print(f"[digits] FAILED: held-out accuracy {test_acc:.4f} < {MIN_ACCURACY}; nothing written")
        return 1

    model_tmp, heldout_tmp = out / ".model.tmp.pt2", out / ".heldout.tmp.npz"
    staged = {model_tmp: out / "model.pt2", heldout_tmp: out / "heldout.npz"}
    try:
        print("[digits] exporting with torch.export (dynamic batch) ...")
        save_program(export(model), model_tmp)
        save_heldout(x_test, y_test, heldout_tmp)
        ok = verify_program(model_tmp, model, x_test) and verify_heldout(heldout_tmp, x_test, y_test)
        if not ok:
            discard(staged)
            print("[digits] FAILED: reloaded artifacts disagree with the eager model; nothing written")
            return 1
        for tmp, final in staged.items():
            os.replace(tmp, final)
        record_digests(out, [final.name for final in staged.values()])
    except BaseException:
        discard(staged)
        raise

    size_kb = (out / "model.pt2").stat().st_size / 1e3
    elapsed = time.perf_counter() - started
    print(
        f"[digits] OK: {out / 'model.pt2'} ({size_kb:.0f} kB) + heldout.npz ({len(y_test)} samples), "
        f"held-out acc {test_acc:.4f}, built in {elapsed:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
