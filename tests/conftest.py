"""Test setup: run kernels on the Numba CUDA simulator unless asked for the GPU.

``NUMBA_ENABLE_CUDASIM`` must be set before ``numba.cuda`` is first imported, so it is set here,
at conftest import. ``NUMBA_VLLM_TEST_GPU=1`` leaves it unset, to run the same tests on a GPU.
Tests marked ``gpu`` (declared in setup.cfg) are skipped when no real GPU is usable.
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
