# The two commands of the README: `make serve` and `make test`. Both set up first; setup is
# idempotent (stamp files), so the second run only checks timestamps.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PYTEST_ARGS ?=

# GPU=1 (`make GPU=1 setup|serve|test`): requirements/gpu.txt (CUDA torch, onnxruntime-gpu)
# instead of requirements/cpu.txt, into the same $(VENV), with a stamp of its own. A venv holds
# one variant: onnxruntime and onnxruntime-gpu install the same module, so setup refuses a venv
# that holds the other variant's (`make clean` first, or another VENV=...).
GPU ?=
ifeq ($(GPU),1)
VARIANT    := gpu
STAMP      := $(VENV)/.installed-gpu
ORT        := onnxruntime-gpu
OTHER_ORT  := onnxruntime
else ifeq ($(filter-out 0,$(GPU)),)
VARIANT    := cpu
STAMP      := $(VENV)/.installed
ORT        := onnxruntime
OTHER_ORT  := onnxruntime-gpu
else
$(error GPU=$(GPU): use GPU=1 for the GPU stack, or leave GPU unset for the CPU one)
endif
REQUIREMENTS := requirements/$(VARIANT).txt

MODEL_ARTIFACTS := models/minilm/1/model.onnx models/digits/1/model.pt2

.PHONY: setup models serve test test-tools clean image image-test

setup: $(STAMP) $(MODEL_ARTIFACTS)

$(STAMP): pyproject.toml $(REQUIREMENTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@if $(BIN)/python -c "import importlib.metadata as m; m.distribution('$(OTHER_ORT)')" 2>/dev/null; then echo "make: $(VENV) holds $(OTHER_ORT) and $(REQUIREMENTS) would put $(ORT) beside it: run 'make clean' first, or use another VENV=DIR" >&2; exit 1; fi
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r $(REQUIREMENTS)
	touch $@

models: $(MODEL_ARTIFACTS)

# Built offline from packages; rebuilt only when the build script changes.
models/minilm/1/model.onnx: models/minilm/build.py server/hf_export.py | $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python models/minilm/build.py

models/digits/1/model.pt2: models/digits/build.py | $(STAMP)
	$(BIN)/python models/digits/build.py

# Settings come from BATCHLINE_* environment variables (BATCHLINE_HTTP_PORT, ...), passed through.
serve: setup
	$(BIN)/batchline serve

# wrk and prometheus (promtool) come from the system's packages: installed when missing, or a
# one-line reason why they cannot be, before any test runs.
test-tools:
	sh scripts/test-tools.sh

# Lint and type checks first (seconds; mypy's first run about a minute), then every test.
test: setup test-tools
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The container image, built with docker or podman (whichever works here; podman is installed
# when neither does and we are root), on a base made from Debian where no registry is reachable.
# The host's pip CA bundle and wheel folders reach the build's pip (IMAGE_CA_BUNDLE, IMAGE_WHEELS
# to give others). Layers are cached: a rebuild with unchanged sources takes under a minute.
IMAGE_VARIANT ?= cpu
IMAGE_VERSION := $(shell sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml)
IMAGE         ?= batchline:$(IMAGE_VERSION)-$(IMAGE_VARIANT)
IMAGE_CA_BUNDLE ?=
IMAGE_WHEELS    ?=

image:
	bash scripts/image.sh build --variant $(IMAGE_VARIANT) --tag $(IMAGE) \
		$(if $(IMAGE_CA_BUNDLE),--ca-bundle $(IMAGE_CA_BUNDLE)) $(foreach w,$(IMAGE_WHEELS),--wheels $(w))

# The CPU image run as the Kubernetes manifests run it: ready in time, both models answer
# tritonclient, /metrics, a build at load, SIGTERM drains. Prints the size and the time to ready.
image-test: image $(STAMP)
	BATCHLINE_IMAGE=$(IMAGE) $(BIN)/python -m pytest -m image tests/image tests/deploy/test_dockerfile.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) models/*/[0-9]*/ .pytest_cache
