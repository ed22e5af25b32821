# megatron-burst: `make demo` and `make test` set up .venv themselves (idempotent).
#
# torch is pinned to the exact CPU build that pip finds on disk here: a looser spec (plain `torch`,
# or a range a newer release satisfies) would pull several GB of CUDA wheels from the registry.
# A venv that already has a torch (e.g. a CUDA build you installed) keeps it.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
MCORE_SPEC ?= megatron-core==0.16.1
STAMP := $(VENV)/.megatron-burst-env
PYTEST_ARGS ?=
# make test's pytest-xdist workers (2 keep CI's 2 cores busy: ranks and subprocesses leave one idle
# about a third of the time in a single worker); TEST_WORKERS=0 runs it in this process
TEST_WORKERS ?= 2

.PHONY: all env demo test gpu-test functional-test clean-data help

all: help

help:
	@echo "make demo   - build data, train a small GPT at CP=4 (4 CPU ranks) and at CP=1, compare"
	@echo "make test   - run the test suite"
	@echo "make gpu-test - run the GPU suite (tests/gpu; needs CUDA, about 5 min on one H100)"
	@echo "make functional-test - run every Megatron-style functional-test case on CPU, print the pass/fail table"
	@echo "make env    - only create/refresh $(VENV)"

env: $(STAMP)

# Re-run when the install recipe or the package metadata changes; otherwise reuse the venv.
$(STAMP): setup.py Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install "$(MCORE_SPEC)" -e ".[test]"
	@$(PY) -c "import torch, megatron.core, megatron_burst; print('env ok: torch', torch.__version__, '| megatron-core', megatron.core.__version__)"
	@touch $(STAMP)

demo: env
	$(PY) examples/demo.py

# tests/gpu needs CUDA (make gpu-test); here its code runs as a CPU dry run (tests/test_gpu_suite_dry_run.py)
test: env
	$(PY) -m pytest -q -p no:cacheprovider --ignore=tests/gpu -n $(TEST_WORKERS) $(PYTEST_ARGS) tests

# The GPU suite (every test skipped without CUDA). On a GPU machine whose python already has a CUDA
# torch and no network for `make env`: make gpu-test GPU_PY=python3 (that python runs it, env is skipped).
GPU_PY ?=
# pytest-xdist, when installed, runs it in 8 workers sharing the GPU (Triton compiles and rank
# start-ups dominate, not GPU time), the multi-rank tests grouped per world size (one worker, one rank
# pool per W: tests/gpu/conftest.py); GPU_TEST_FAILLOG=<file> records each failure as it happens.
GPU_XDIST = $(shell $(or $(GPU_PY),$(PY)) -c "import xdist" 2>/dev/null && echo "-n 8 --dist loadgroup")
gpu-test: $(if $(GPU_PY),,env)
	$(or $(GPU_PY),$(PY)) -m pytest -q -p no:cacheprovider --durations=15 $(GPU_XDIST) $(PYTEST_ARGS) tests/gpu

# Every case under tests/functional_tests/test_cases/gpt (make test runs a CI subset of them).
functional-test: env
	$(PY) -m megatron_burst.functional_tests run $(CASES)

clean-data:
	rm -rf data_cache runs
