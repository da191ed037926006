# mambatrt: every README step is a target here. Each target does its own set-up (the venv) on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MAMBATRT := $(VENV)/bin/mambatrt
BUNDLE ?= bundles/default
PROMPT ?= The
export PYTHONUNBUFFERED := 1

.PHONY: help install test test-fast lint format demo bundle run compare bench clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch (lies on local disk here); install it first so nothing pulls a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[ort,export,compile,test,dev]"
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

# Until the project ships a trained default model, the default bundle is built from a small random checkpoint.
DEFAULT_CKPT := bundles/.random-checkpoint
DEFAULT_CONFIG := dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, state_size=16, conv_kernel=4)

$(DEFAULT_CKPT)/config.json: | install
	$(PY) -c "from mambatrt.testing import write_hf_checkpoint; write_hf_checkpoint('$(DEFAULT_CKPT)', **$(DEFAULT_CONFIG))"

bundle: install $(DEFAULT_CKPT)/config.json  ## build the default model into bundles/default (split, fp32, plans when a builder exists)
	$(MAMBATRT) bundle $(DEFAULT_CKPT) --out $(BUNDLE) --force --label "random weights (no trained default model yet)"

run: install  ## generate from bundles/default
	$(MAMBATRT) run $(BUNDLE) --prompt-ids 1,2,3,4,5,6,7,8 --max-new-tokens 24

demo: bundle run  ## install, build the default bundle, run it

compare: bundle  ## accuracy comparisons of bundles/default
	$(MAMBATRT) compare $(BUNDLE)

clean:  ## remove the venv and build outputs
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
