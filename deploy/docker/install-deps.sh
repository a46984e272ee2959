#!/bin/sh
# The image's runtime virtualenv (the Dockerfile's `deps` stage runs this from the source root).
#
#   install-deps.sh VARIANT TORCH_INDEX_URL VENV
#
# VARIANT is cpu or gpu. Installs the pins of requirements/<VARIANT>.txt (its `-e .[...]` line
# dropped: the image installs the package itself, not editable, with the runtime extras only) and
# `.[<VARIANT>,torchao]` (torchao: the torch INT8 builds serve too) into a new virtualenv VENV,
# then checks that the torch and ONNX Runtime builds match the variant (check-build.py), so a
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
trap 'rm -f "$pins"' EXIT
{ grep -v -e '^-e' -e '^#' -e '^[[:space:]]*$' "requirements/$variant.txt" || true; } > "$pins"

python3 -m venv "$venv"
if [ -n "$torch_index" ]; then
    "$venv/bin/pip" install --extra-index-url "$torch_index" -r "$pins" ".[$variant,torchao]"
else
    "$venv/bin/pip" install -r "$pins" ".[$variant,torchao]"
fi
"$venv/bin/python" "$here/check-build.py" "$variant"
