"""warp_sum / warp_max / warp_sums / block_sum / block_max (numba_vllm.kernels.reductions) against NumPy.

Row reductions of a (num_rows, num_cols) float32 matrix, over the block sizes kernels use.
Both kernels walk rows with a grid-stride loop and launch fewer warps/blocks than rows, and
num_cols is not a multiple of any block size, so some threads have no elements in a row.
Values are negative so a reduction that pads with 0 instead of -inf gives a wrong maximum.
Runs on the simulator, or on a GPU with NUMBA_VLLM_TEST_GPU=1.
"""

import functools
import math

import numpy as np
import pytest
from numba import cuda, float32

from numba_vllm.kernels.jit import kernel
from numba_vllm.kernels.reductions import block_max, block_sum, warp_max, warp_sum, warp_sums

pytestmark = pytest.mark.gpu_too  # `make test-gpu` runs these on the GPU as well

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


@functools.cache
def warp_sums_kernel(count):
    sums = warp_sums(count)

    @kernel
    def many_sums_kernel(x, totals, indices, out, writes):
        """Two warps; x (64, count) f32: each thread's values. Every thread records the sum it ends with
        (totals (64,) f32) and which value it is (indices (64,) int32); the writer lanes store it in
        out (2, count) f32 and count themselves in writes (2, count) int32."""
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        values = cuda.local.array(count, float32)
        for i in range(count):
            values[i] = x[tid, i]
        total, j, writer = sums(values, lane)
        totals[tid] = total
        indices[tid] = j
        if writer:
            out[warp, j] = total
            cuda.atomic.add(writes, (warp, j), 1)

    return many_sums_kernel


@pytest.mark.parametrize("count", [1, 2, 4, 8, 16, 32])
def test_warp_sums_many_values_at_once(count):
    """Each of a lane's ``count`` values summed over its warp: every lane ends with one of the sums (the
    one its index names), and the writer lanes hold every value exactly once between them."""
    x = np.random.default_rng(count).standard_normal((64, count)).astype(np.float32)
    want = x.astype(np.float64).reshape(2, 32, count).sum(axis=1)  # (warp, value)
    totals, indices = cuda.device_array(64, np.float32), cuda.device_array(64, np.int32)
    out = cuda.to_device(np.full((2, count), np.nan, np.float32))
    writes = cuda.to_device(np.zeros((2, count), np.int32))
    warp_sums_kernel(count)[1, 64](cuda.to_device(x), totals, indices, out, writes)
    np.testing.assert_array_equal(writes.copy_to_host(), 1)
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-5, atol=1e-5)
    idx = indices.copy_to_host()
    assert set(idx[:32]) == set(range(count))
    np.testing.assert_allclose(totals.copy_to_host(), want[np.arange(64) // 32, idx], rtol=1e-5, atol=1e-5)
