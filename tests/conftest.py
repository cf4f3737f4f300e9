"""Test setup: run kernels on the Numba CUDA simulator unless asked for the GPU.

``NUMBA_ENABLE_CUDASIM`` must be set before ``numba.cuda`` is first imported, so it is set here,
at conftest import. ``NUMBA_VLLM_TEST_GPU=1`` leaves it unset, to run the same tests on a GPU.
Tests marked ``gpu`` (declared in setup.cfg) are skipped when no real GPU is usable.
Fixtures shared by several test modules are here; shared functions and data are in tests/helpers/.
"""

import os

import pytest

if os.environ.get("NUMBA_VLLM_TEST_GPU") != "1":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


def _gpu_usable():
    """True when numba.cuda runs on a real GPU (not the simulator) and finds one."""
    from numba import cuda

    from numba_vllm.sim.warp import simulator_enabled

    return not simulator_enabled() and cuda.is_available()


# The test files that take minutes on 2 cores (whole-model simulations, PTX compiles), longest first
# (`make test`'s --durations, summed per file). `make test` hands whole files to its workers in
# collection order, so these start first: a long file started last would run on alone at the end.
LONGEST_FILES = (
    "test_cuda_graph.py",
    "test_engine.py",
    "test_logprobs.py",
    "test_examples.py",
    "test_structured_output.py",
    "test_prefill_attention_tc.py",
    "test_gemm_wgmma.py",
    "test_logits_edits.py",
    "test_prefill_attention_wgmma.py",
    "test_ptx_attention.py",
    "test_engine_core.py",
    "test_ptx_matmul.py",
    "test_kernel_report.py",
    "test_attention.py",
    "test_ptx_lineinfo.py",
)


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and not _gpu_usable():
        skip = pytest.mark.skip(reason="no usable GPU (set NUMBA_VLLM_TEST_GPU=1 on a GPU host)")
        for item in gpu_items:
            item.add_marker(skip)
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))  # stable: each file's tests keep their order


@pytest.fixture(scope="session", autouse=True)
def _shared_ptx_results(tmp_path_factory):
    """Under pytest-xdist, the workers of a run share the PTX they compile (tests/helpers/ptx.py), in
    a folder beside their own temporary folders (pytest removes it with them, a few runs later)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        yield
        return
    from tests.helpers import ptx

    ptx.SHARED_DIR = tmp_path_factory.getbasetemp().parent / "ptx"
    ptx.SHARED_DIR.mkdir(exist_ok=True)
    yield
    ptx.SHARED_DIR = None


@pytest.fixture(scope="session")
def smollm2_tok():
    """SmolLM2's tokenizer, read from the default model's GGUF (its metadata only: quick); skips the
    test when the model is not installed."""
    from numba_vllm.loading.gguf.importer import load_gguf_tokenizer
    from tests.helpers.smollm2 import NOT_INSTALLED, smollm2_path

    path = smollm2_path()
    if path is None:
        pytest.skip(NOT_INSTALLED)
    return load_gguf_tokenizer(path)
