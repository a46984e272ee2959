"""Fail (exit 1) unless this environment's torch and ONNX Runtime are the builds for VARIANT.

    python check-build.py cpu|gpu

cpu: torch without CUDA and onnxruntime without the CUDA execution provider.

gpu: torch and onnxruntime are CUDA builds of one CUDA major, the base image's too (its
CUDA_VERSION, which the nvidia/cuda images set), and ONNX Runtime's CUDA provider loads for real:
`get_available_providers()` lists it even when its libraries are missing. So, after
`onnxruntime.preload_dlls()`:
  - always (a `docker build` sees no GPU): the provider's library is opened (dlopen, symbols
    bound now), so the CUDA and cuDNN libraries it was linked against must resolve;
  - where torch sees a GPU: a session on a tiny MatMul model with the CUDA provider must keep it
    (ONNX Runtime falls back to the CPU with only a log line) and answer right, and torch must
    run a matmul on the GPU.
What a build without a GPU cannot see: the driver and the GPU's kernels. Run this again where
the GPU is: `docker run --rm --gpus all IMAGE python /opt/batchline/check-build.py gpu`.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import os
import sys
from pathlib import Path
from types import ModuleType

# y = a @ b; a, b, y FP32 [2, 2]; ONNX IR 7, opset 13. Made with onnx.helper (the image has no
# onnx package); tests/deploy/test_dockerfile.py checks it with onnx and runs it on the CPU.
MATMUL_MODEL = base64.b64decode(
    "CAc6WgoRCgFhCgFiEgF5IgZNYXRNdWwSBm1hdG11bFoTCgFhEg4KDAgBEggKAggCCgIIAloTCgFiEg4KDAgBEggKAggCCgIIAmITCgF5"
    "Eg4KDAgBEggKAggCCgIIAkIECgAQDQ=="
)
CUDA_PROVIDER_LIBRARY = "libonnxruntime_providers_cuda.so"
SHARED_PROVIDER_LIBRARY = "libonnxruntime_providers_shared.so"  # ONNX Runtime opens it first, global


def problems(variant: str) -> list[str]:
    import onnxruntime
    import torch

    gpu = variant == "gpu"
    found = []
    if (torch.version.cuda is not None) != gpu:
        found.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}) is not the {variant} build")
    providers = onnxruntime.get_available_providers()
    if ("CUDAExecutionProvider" in providers) != gpu:
        found.append(
            f"onnxruntime {onnxruntime.__version__} (providers {providers}) is not the {variant} build")
    if gpu and not found:
        found.extend(cuda_problems(torch, onnxruntime))
    return found


def cuda_majors(torch_cuda: str | None, ort_cuda: str | None, base_cuda: str | None) -> dict[str, str]:
    """Who was built for which CUDA major ("?": it does not say); the base image only where it
    says (CUDA_VERSION)."""
    majors = {"torch": (torch_cuda or "?").split(".")[0], "onnxruntime": (ort_cuda or "?").split(".")[0]}
    if base_cuda:
        majors["the base image (CUDA_VERSION)"] = base_cuda.split(".")[0]
    return majors


def cuda_problems(torch: ModuleType, onnxruntime: ModuleType) -> list[str]:
    ort_cuda = getattr(onnxruntime, "cuda_version", None)  # what the wheel was built with ("" on CPU)
    majors = cuda_majors(torch.version.cuda, ort_cuda, os.environ.get("CUDA_VERSION"))
    if len(set(majors.values())) != 1 or "?" in majors.values():
        found = ", ".join(f"{who} CUDA {major}" for who, major in majors.items())
        return [f"torch, onnxruntime (and the base image) need one CUDA major, not: {found}"]
    # A CUDA torch, imported above, has loaded its CUDA libraries; preload_dlls (onnxruntime >= 1.21)
    # loads those of the nvidia-* wheels, and prints what it cannot load.
    if hasattr(onnxruntime, "preload_dlls"):
        with contextlib.redirect_stdout(sys.stderr):
            onnxruntime.preload_dlls()
    problem = provider_library_problem(Path(onnxruntime.__file__).parent / "capi")
    if problem:
        return [problem]
    if not torch.cuda.is_available():  # a `docker build`: no driver, no GPU to run on
        return []
    return [p for p in (session_problem(onnxruntime, "CUDAExecutionProvider"), torch_gpu_problem(torch)) if p]


def provider_library_problem(capi: Path) -> str | None:
    """Open ONNX Runtime's CUDA provider library as ONNX Runtime does: its CUDA and cuDNN
    libraries (by soname, of the major it was built for) must resolve, with or without a GPU."""
    library = capi / CUDA_PROVIDER_LIBRARY
    if not library.is_file():
        return f"onnxruntime has no {CUDA_PROVIDER_LIBRARY} in {capi}"
    try:
        if (capi / SHARED_PROVIDER_LIBRARY).is_file():
            ctypes.CDLL(str(capi / SHARED_PROVIDER_LIBRARY), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(library))
    except OSError as exc:
        return f"onnxruntime's CUDA provider does not load: {exc}"
    return None


def session_problem(onnxruntime: ModuleType, provider: str) -> str | None:
    """A session on MATMUL_MODEL that asks for `provider` must get it and answer a @ b."""
    import numpy as np

    try:
        providers = list(dict.fromkeys([provider, "CPUExecutionProvider"]))
        session = onnxruntime.InferenceSession(MATMUL_MODEL, providers=providers)
    except Exception as exc:  # noqa: BLE001 (onnxruntime raises its own types)
        return f"onnxruntime cannot make a session with {provider}: {exc}"
    if session.get_providers()[0] != provider:
        return f"onnxruntime fell back from {provider} to {session.get_providers()} (its log above says why)"
    a = np.array([[1, 2], [3, 4]], np.float32)
    b = np.array([[5, 6], [7, 8]], np.float32)
    try:
        (y,) = session.run(None, {"a": a, "b": b})
    except Exception as exc:  # noqa: BLE001
        return f"onnxruntime's {provider} failed to run a MatMul: {exc}"
    if not np.allclose(y, a @ b):
        return f"onnxruntime's {provider} answered {y.tolist()} for a MatMul, not {(a @ b).tolist()}"
    return None


def torch_gpu_problem(torch: ModuleType) -> str | None:
    try:
        x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device="cuda")
        y = (x @ x).cpu().tolist()
    except Exception as exc:  # noqa: BLE001 (RuntimeError and others, for driver or arch problems)
        return f"torch cannot run on the GPU: {exc}"
    return None if y == [[7.0, 10.0], [15.0, 22.0]] else f"torch answered {y} on the GPU for a matmul"


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

        line = f"check-build: {argv[0]} ok: torch {torch.__version__}, onnxruntime {onnxruntime.__version__}"
        if argv[0] == "gpu":
            line += f", CUDA {torch.version.cuda}: " + (
                "the CUDA provider and torch ran on the GPU" if torch.cuda.is_available()
                else "the CUDA provider's libraries load; no GPU visible, so its kernels are unchecked"
            )
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
