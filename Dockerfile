# Batchline: one Dockerfile, two machine kinds (docs/operations.md).
#
#   make image                                                             # the CPU image, built here
#   docker build -t batchline:0.1.0-cpu .                                  # VARIANT=cpu (default)
#   docker build -t batchline:0.1.0-gpu --build-arg VARIANT=gpu .
#
# Needs BuildKit (Docker's default builder) or Podman/Buildah: the pip installs mount the
# optional build context `build-inputs` (RUN --mount), which the legacy builder cannot.
#
# Build arguments:
#   VARIANT          cpu | gpu: the base image and requirements/<VARIANT>.txt
#   TORCH_INDEX_URL  extra pip index for torch. "auto" (default): PyTorch's CPU wheel index for
#                    cpu (PyPI's Linux torch is a CUDA build), its CUDA 13 index (cu130) for gpu;
#                    "" for none (the torch wheel comes from build-inputs or a mirror); or any
#                    index/mirror URL (e.g. a cuXXX index, with a CUDA_IMAGE of that CUDA major).
#   PYTHON_IMAGE     base of the cpu variant (Python 3.11 or 3.12); where no registry is
#                    reachable, `make image` makes one from Debian (deploy/docker/base.Dockerfile)
#   CUDA_IMAGE       base of the gpu variant: an nvidia/cuda runtime image with cuDNN whose CUDA major
#                    is the wheels' (torch cu130 and PyPI's onnxruntime-gpu: CUDA 13, NVIDIA driver
#                    >= 580), on Ubuntu 24.04 (python3 3.12). check-build.py fails the build when the
#                    majors differ or ONNX Runtime's CUDA provider cannot load its libraries; the
#                    GPU itself is checked only where one is: docker run --gpus all IMAGE
#                    python /opt/batchline/check-build.py gpu
#
# Build context `build-inputs` (optional, `--build-context build-inputs=DIR`): DIR/ca.crt, a CA
# bundle for a proxy that intercepts TLS, and DIR/wheels/, a folder of wheels pip looks in (a
# local CPU torch wheel). Mounted only while pip runs, never copied into a layer; see
# deploy/docker/with-build-inputs.sh. `make image` fills it from the host's pip configuration.
#
# Stages: base-cpu | base-gpu -> base -> deps (the runtime virtualenv's third-party packages) ->
# wheel (the package) and models (the default model repository, built offline from packages with
# the same torch that serves it) -> runtime (base + venv + package + models, non-root). Nothing is downloaded at run time. BuildKit and Podman build
# only the chosen variant's base (with Podman, pass --build-arg VARIANT=... explicitly).

ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04

# ---------------------------------------------------------------------------------------------
# Empty unless the build is given the context `build-inputs` (see above).
FROM scratch AS build-inputs

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
COPY pyproject.toml ./
COPY requirements/ requirements/
COPY deploy/docker/install-deps.sh deploy/docker/check-build.py deploy/docker/with-build-inputs.sh \
     deploy/docker/requirements-of.py deploy/docker/
# The third-party packages only: requirements/<VARIANT>.txt's pins + what
# batchline[<VARIANT>,torchao,quantize] needs, into /opt/venv, then a check that torch and ONNX
# Runtime are the builds for the variant (a CUDA torch never slips into cpu; for gpu, one CUDA
# major and ONNX Runtime's CUDA provider loads). Nothing of the code: editing it reuses this layer.
RUN --mount=type=bind,from=build-inputs,target=/run/build-inputs \
    sh deploy/docker/with-build-inputs.sh /run/build-inputs \
    sh deploy/docker/install-deps.sh "$VARIANT" "$TORCH_INDEX_URL" /opt/venv

# ---------------------------------------------------------------------------------------------
FROM deps AS wheel
# The package itself, as a wheel the runtime stage installs without its dependencies.
COPY README.md ./
COPY server/ server/
COPY loadtest/ loadtest/
RUN --mount=type=bind,from=build-inputs,target=/run/build-inputs \
    sh deploy/docker/with-build-inputs.sh /run/build-inputs pip wheel --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------------------------------------
FROM deps AS models
ENV HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH=/src
# The build extra's packages (export, training) in this stage only; torch is already there. Then
# each build script, offline, with the server's code (digests) from /src, and the repository the
# image serves: config.yaml + version folders of each model, nothing else.
RUN --mount=type=bind,from=build-inputs,target=/run/build-inputs \
    python deploy/docker/requirements-of.py pyproject.toml --extras-only build > /tmp/build.txt \
    && sh deploy/docker/with-build-inputs.sh /run/build-inputs pip install -r /tmp/build.txt
COPY server/ server/
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
# The package on top of the dependencies' layer: a change to the code rebuilds this small layer only.
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-deps --no-index /wheels/batchline-*.whl
COPY --from=models /opt/batchline/models /opt/batchline/models
COPY deploy/docker/healthcheck.py deploy/docker/check-build.py /opt/batchline/
ENV BATCHLINE_MODEL_REPOSITORY=/opt/batchline/models \
    BATCHLINE_HOST=0.0.0.0 \
    BATCHLINE_HTTP_PORT=8000 \
    BATCHLINE_GRPC_PORT=8001 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HOME=/tmp
WORKDIR /opt/batchline
USER 10001:10001
EXPOSE 8000 8001
# On SIGTERM readiness turns 503, uvicorn drains (30 s), the repository finishes the queued work, exit 0.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "/opt/batchline/healthcheck.py"]
CMD ["batchline", "serve", "--host", "0.0.0.0"]
