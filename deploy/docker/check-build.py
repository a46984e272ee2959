"""Fail (exit 1) unless this environment's torch and ONNX Runtime are the builds for VARIANT.

    python check-build.py cpu|gpu

cpu: torch without CUDA and onnxruntime without the CUDA execution provider; gpu: both with
CUDA. Availability only: it needs no GPU, so the image build checks it on any machine.
"""

from __future__ import annotations

import sys


def problems(variant: str) -> list[str]:
    import onnxruntime
    import torch

    gpu = variant == "gpu"
    found = []
    if (torch.version.cuda is not None) != gpu:
        found.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}) is not the {variant} build")
    providers = onnxruntime.get_available_providers()
    if ("CUDAExecutionProvider" in providers) != gpu:
        found.append(f"onnxruntime {onnxruntime.__version__} (providers {providers}) is not the {variant} build")
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in ("cpu", "gpu"):
        print("usage: check-build.py cpu|gpu", file=sys.stderr)
        return 2
    found = problems(argv[0])
    for problem in found:
        print(f"check-build: {problem}", file=sys.stderr)
    if not found:
        import onnxruntime
        import torch

        print(f"check-build: {argv[0]} ok: torch {torch.__version__}, onnxruntime {onnxruntime.__version__}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
