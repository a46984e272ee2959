# Batchline: one Dockerfile, two machine kinds (docs/operations.md).
#
#   docker build -t batchline:0.1.0-cpu .                                  # VARIANT=cpu (default)
#   docker build -t batchline:0.1.0-gpu --build-arg VARIANT=gpu .
#
# Build arguments:
#   VARIANT          cpu | gpu: the base image and requirements/<VARIANT>.txt
#   TORCH_INDEX_URL  extra pip index for torch. "auto" (default): PyTorch's CPU wheel index for
#                    cpu (PyPI's Linux torch is a CUDA build), its CUDA 13 index (cu130) for gpu;
#                    "" for none; or any index/mirror URL (e.g. a cuXXX index, with a CUDA_IMAGE of
#                    that CUDA major).
#   PYTHON_IMAGE     base of the cpu variant (Python 3.11 or 3.12)
#   CUDA_IMAGE       base of the gpu variant: an nvidia/cuda runtime image with cuDNN whose CUDA major
#                    is the wheels' (torch cu130 and PyPI's onnxruntime-gpu: CUDA 13, NVIDIA driver
#                    >= 580), on Ubuntu 24.04 (python3 3.12). check-build.py fails the build when the
#                    majors differ or ONNX Runtime's CUDA provider cannot load its libraries; the
#                    GPU itself is checked only where one is: docker run --gpus all IMAGE
#                    python /opt/batchline/check-build.py gpu
#
# Stages: base-cpu | base-gpu -> base -> deps (the runtime virtualenv) -> models (the default
# model repository, built offline from packages with the same torch that serves it) -> runtime
# (base + venv + models, non-root). Nothing is downloaded at run time. BuildKit (Docker's default
# builder) builds only the chosen variant's base; the legacy builder builds both.

ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04

# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base-cpu

FROM ${CUDA_IMAGE} AS base-gpu
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

# ---------------------------------------------------------------------------------------------
# hadolint ignore=DL3006
FROM base-${VARIANT} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# ---------------------------------------------------------------------------------------------
FROM base AS deps
ARG VARIANT
ARG TORCH_INDEX_URL=auto
WORKDIR /src
COPY pyproject.toml README.md ./
COPY requirements/ requirements/
COPY server/ server/
COPY loadtest/ loadtest/
COPY deploy/docker/install-deps.sh deploy/docker/check-build.py deploy/docker/
# requirements/<VARIANT>.txt's pins + `.[<VARIANT>,torchao]` (not editable) into /opt/venv, then a
# check that torch and ONNX Runtime are the builds for the variant (a CUDA torch never slips into
# cpu; for gpu, one CUDA major and ONNX Runtime's CUDA provider loads).
RUN sh deploy/docker/install-deps.sh "$VARIANT" "$TORCH_INDEX_URL" /opt/venv

# ---------------------------------------------------------------------------------------------
FROM deps AS models
ENV HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# The build extra (export, training) in this stage only; its versions come from pyproject.toml
# and torch is already satisfied above. Then each build script, offline, and the repository the
# image serves: config.yaml + version folders of each model, nothing else.
# hadolint ignore=DL3013
RUN pip install ".[build]"
COPY models/ models/
COPY deploy/docker/assemble-repository.sh deploy/docker/
RUN python models/minilm/build.py \
    && python models/digits/build.py \
    && sh deploy/docker/assemble-repository.sh models /opt/batchline/models

# ---------------------------------------------------------------------------------------------
FROM base AS runtime
ARG VARIANT
LABEL org.opencontainers.image.title="batchline" \
      org.opencontainers.image.description="KServe v2 inference server with dynamic batching (${VARIANT})" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 batchline \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin batchline
COPY --from=deps /opt/venv /opt/venv
COPY --from=models /opt/batchline/models /opt/batchline/models
COPY deploy/docker/healthcheck.py deploy/docker/check-build.py /opt/batchline/
ENV BATCHLINE_MODEL_REPOSITORY=/opt/batchline/models \
    BATCHLINE_HOST=0.0.0.0 \
    BATCHLINE_HTTP_PORT=8000 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HOME=/tmp
WORKDIR /opt/batchline
USER 10001:10001
EXPOSE 8000
# On SIGTERM readiness turns 503, uvicorn drains (30 s), the repository finishes the queued work, exit 0.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "/opt/batchline/healthcheck.py"]
CMD ["batchline", "serve", "--host", "0.0.0.0"]
