"""warp_sum / warp_max / block_sum / block_max (numba_vllm.kernels.reductions) against NumPy.

Row reductions of a (num_rows, num_cols) float32 matrix, over the block sizes kernels use.
Both kernels walk rows with a grid-stride loop and launch fewer warps/blocks than rows, and
num_cols is not a multiple of any block size, so some threads have no elements in a row.
Values are negative so a reduction that pads with 0 instead of -inf gives a wrong maximum.
Runs on the simulator, or on a GPU with NUMBA_VLLM_TEST_GPU=1.
"""

import math

import numpy as np
import pytest
from numba import cuda, float32

from numba_vllm.kernels.jit import kernel
from numba_vllm.kernels.reductions import block_max, block_sum, warp_max, warp_sum

BLOCK_SIZES = [32, 64, 96, 128, 256, 1024]
NUM_ROWS = 5
NUM_COLS = 700


@kernel
def warp_rows_kernel(x, sums, maxes):
    """One warp per row, grid-stride over rows; lanes stride over the row's columns.

    x: (num_rows, num_cols) float32; sums, maxes: (num_rows,) float32
    """
    lane = cuda.threadIdx.x % 32
    warp_id = cuda.grid(1) // 32
    num_warps = cuda.gridsize(1) // 32
    for row in range(warp_id, x.shape[0], num_warps):
        total = float32(0.0)
        peak = float32(-math.inf)
        for col in range(lane, x.shape[1], 32):
            total += x[row, col]
            peak = max(peak, x[row, col])
        total = warp_sum(total)
        peak = warp_max(peak)
        if lane == 0:
            sums[row] = total
            maxes[row] = peak


@kernel
def block_rows_kernel(x, sums, maxes):
    """One block per row, grid-stride over rows; threads stride over the row's columns.

    x: (num_rows, num_cols) float32; sums, maxes: (num_rows,) float32
    """
    scratch = cuda.shared.array(32, float32)  # shared by both reductions
    for row in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
        total = float32(0.0)
        peak = float32(-math.inf)
        for col in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
            total += x[row, col]
            peak = max(peak, x[row, col])
        total = block_sum(total, scratch)
        peak = block_max(peak, scratch)
        if cuda.threadIdx.x == 0:
            sums[row] = total
            maxes[row] = peak


def run_rows(k, grid_dim, block_dim, x):
    d_sums = cuda.device_array(x.shape[0], np.float32)
    d_maxes = cuda.device_array(x.shape[0], np.float32)
    k[grid_dim, block_dim](cuda.to_device(x), d_sums, d_maxes)
    return d_sums.copy_to_host(), d_maxes.copy_to_host()


def make_rows(block_size):
    rng = np.random.default_rng(block_size)
    return (rng.standard_normal((NUM_ROWS, NUM_COLS)) - 10).astype(np.float32)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_warp_reductions(block_size):
    x = make_rows(block_size)
    num_blocks = 1 if block_size > 32 else 2  # fewer warps than rows for small blocks
    sums, maxes = run_rows(warp_rows_kernel, num_blocks, block_size, x)
    np.testing.assert_allclose(sums, x.astype(np.float64).sum(axis=1), rtol=1e-5)
    np.testing.assert_array_equal(maxes, x.max(axis=1))


@pytest.mark.parametrize("block_size", [b if b < 256 else pytest.param(b, marks=pytest.mark.slow) for b in BLOCK_SIZES])
def test_block_reductions(block_size):
    x = make_rows(block_size)
    sums, maxes = run_rows(block_rows_kernel, 2, block_size, x)  # 2 blocks for 5 rows
    np.testing.assert_allclose(sums, x.astype(np.float64).sum(axis=1), rtol=1e-5)
    np.testing.assert_array_equal(maxes, x.max(axis=1))
