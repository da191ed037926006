# mambatrt: every README step is a target here. Each target does its own set-up (the venv) on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MAMBATRT := $(VENV)/bin/mambatrt
BUNDLE ?= bundles/default
export PYTHONUNBUFFERED := 1

.PHONY: help install test test-fast lint format demo bundle run compare bench bench-130m eval clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch (lies on local disk here); install it first so nothing pulls a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[ort,export,compile,serve,test,dev]"
	# where nvcc is, CUTLASS's headers for the kernels library's fp32 GEMMs (the headers only: no dependencies)
	if command -v nvcc > /dev/null || [ -n "$${MAMBATRT_NVCC:-}" ]; then $(PY) -m pip install -q --no-deps nvidia-cutlass; fi
	touch $@

install: $(VENV)/.installed  ## create .venv with mambatrt and everything it needs (CPU torch, onnxruntime, TensorRT-RTX)

lint: install  ## ruff check + ruff format --check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install  ## apply ruff format and safe fixes
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: install lint  ## install, lint, run the whole test suite (CPU)
	$(PY) -m pytest

test-fast: install  ## the tests not marked slow
	$(PY) -m pytest -m "not slow"

# The default model: trained by training/train_default.py on the Python documentation (training/README.md).
DEFAULT_MODEL := models/default
PROMPT ?= The module provides

BUNDLE_PRECISION ?= fp32
BUNDLE_DEPS := $(DEFAULT_MODEL)/config.json $(DEFAULT_MODEL)/model.safetensors $(DEFAULT_MODEL)/tokenizer.json

# One rule for every target that needs the default bundle: (re)build it when it is missing or older than the model.
$(BUNDLE)/manifest.json: $(VENV)/.installed $(BUNDLE_DEPS)
	$(MAMBATRT) bundle $(DEFAULT_MODEL) --out $(BUNDLE) --force --precision $(BUNDLE_PRECISION)

bundle: install  ## (re)build bundles/default (split, fp32, plans when a TensorRT module imports)
	$(MAMBATRT) bundle $(DEFAULT_MODEL) --out $(BUNDLE) --force --precision $(BUNDLE_PRECISION)

run: $(BUNDLE)/manifest.json  ## generate from bundles/default (built first when missing or stale)
	$(MAMBATRT) run $(BUNDLE) --prompt "$(PROMPT)" --max-new-tokens 40

eval: $(BUNDLE)/manifest.json  ## cloze accuracy of bundles/default on the shipped held-out set, with the unigram baseline
	$(MAMBATRT) eval $(BUNDLE) --data $(DEFAULT_MODEL)/cloze.jsonl --unigram $(DEFAULT_MODEL)/unigram_counts.json

demo: bundle run  ## install, build the default bundle, run it

compare: $(BUNDLE)/manifest.json  ## accuracy comparisons of bundles/default
	$(MAMBATRT) compare $(BUNDLE)

bench: $(BUNDLE)/manifest.json  ## time bundles/default: chunked vs token-by-token prefill, decode, with the HF reference
	$(MAMBATRT) bench $(BUNDLE) --prompt-lengths 5,71,84,128,512 --repeat 5 --reference hf

bench-130m: install  ## docs/benchmarks.md's CPU table: random mamba-130m shapes, bundled and timed against HF (~3 min)
	test -d build/ck-130m || $(PY) -c "from mambatrt.testing import write_hf_checkpoint, MAMBA_130M; \
		write_hf_checkpoint('build/ck-130m', **MAMBA_130M)"
	$(MAMBATRT) bundle build/ck-130m --out build/b-130m --plans none --force --quiet
	$(MAMBATRT) bench build/b-130m --prompt-lengths 5,71,84,128,512 --repeat 3 --new-tokens 8 --reference hf

clean:  ## remove the venv and build outputs
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
