# The two commands of the README: `make serve` and `make test`. Both set up first; setup is
# idempotent (stamp files), so the second run only checks timestamps.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

MODEL_ARTIFACTS := models/minilm/1/model.onnx models/digits/1/model.pt2

.PHONY: setup models serve test test-tools clean

setup: $(STAMP) $(MODEL_ARTIFACTS)

$(STAMP): pyproject.toml requirements/cpu.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements/cpu.txt
	touch $@

models: $(MODEL_ARTIFACTS)

# Built offline from packages; rebuilt only when the build script changes.
models/minilm/1/model.onnx: models/minilm/build.py | $(STAMP)
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

test: setup test-tools
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) models/*/[0-9]*/ .pytest_cache
