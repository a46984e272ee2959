#!/bin/sh
# The image's runtime virtualenv (the Dockerfile's `deps` stage runs this from the source root).
#
#   install-deps.sh VARIANT TORCH_INDEX_URL VENV
#
# VARIANT is cpu or gpu. Installs the pins of requirements/<VARIANT>.txt (its `-e .[...]` line
# dropped) and the third-party requirements of `batchline[<VARIANT>,torchao,quantize]` read from
# pyproject.toml (requirements-of.py; torchao: the torch INT8 builds serve too; quantize: a config
# with `build:` is built when the server loads it) into a new virtualenv VENV, without the package
# itself: the image adds it in a later layer, so a change to the code reuses this one. Run from a
# folder that holds pyproject.toml and requirements/. Then it
# checks that the torch and ONNX Runtime builds match the variant (check-build.py), so a
# CUDA torch never slips into the CPU image, and the GPU image's torch, onnxruntime-gpu and base
# image share one CUDA major whose libraries load.
# TORCH_INDEX_URL: "auto" is PyTorch's CPU wheel index for cpu (PyPI's Linux torch is a CUDA
# build) and its CUDA 13 index (cu130) for gpu, the major of the Dockerfile's CUDA_IMAGE and of
# PyPI's onnxruntime-gpu; "" is none; anything else is used as an extra index (a mirror, or a
# cuXXX index together with a CUDA_IMAGE of that major).
set -eu
if [ "$#" -ne 3 ]; then
    echo "usage: $0 VARIANT TORCH_INDEX_URL VENV" >&2
    exit 2
fi
variant=$1
torch_index=$2
venv=$3
case "$variant" in
    cpu|gpu) ;;
    *) echo "VARIANT must be cpu or gpu, not '$variant'" >&2; exit 2 ;;
esac
if [ "$torch_index" = auto ]; then
    if [ "$variant" = cpu ]; then torch_index=https://download.pytorch.org/whl/cpu; else torch_index=https://download.pytorch.org/whl/cu130; fi
fi
here=$(cd "$(dirname "$0")" && pwd)
pins=$(mktemp)
needs=$(mktemp)
trap 'rm -f "$pins" "$needs"' EXIT
{ grep -v -e '^-e' -e '^#' -e '^[[:space:]]*$' "requirements/$variant.txt" || true; } > "$pins"
python3 "$here/requirements-of.py" pyproject.toml "$variant" torchao quantize > "$needs"

python3 -m venv "$venv"
if [ -n "$torch_index" ]; then
    "$venv/bin/pip" install --extra-index-url "$torch_index" -r "$pins" -r "$needs"
else
    "$venv/bin/pip" install -r "$pins" -r "$needs"
fi
"$venv/bin/python" "$here/check-build.py" "$variant"
