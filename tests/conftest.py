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


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and not _gpu_usable():
        skip = pytest.mark.skip(reason="no usable GPU (set NUMBA_VLLM_TEST_GPU=1 on a GPU host)")
        for item in gpu_items:
            item.add_marker(skip)


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
