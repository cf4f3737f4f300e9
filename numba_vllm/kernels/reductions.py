"""Warp and block reductions of float32 values, shared by the kernels.

Warp level: a butterfly. At each step lane ``i`` adds (or maxes) the value of lane
``i ^ offset`` for ``offset = 16, 8, 4, 2, 1``; after five steps every lane holds the result,
so no broadcast is needed. All 32 lanes of the warp must call it (the mask is the full warp).

Block level (one block of ``blockDim.x`` threads, a multiple of 32, at most 1024):

1. each warp reduces its values; lane 0 writes the warp's result to ``scratch[warp]``;
2. ``syncthreads``; then every warp loads the ``num_warps`` partials into its lanes (0 in the
   lanes beyond them) and reduces them again, so every thread gets the block result without a
   second broadcast through shared memory;
3. ``syncthreads`` again before returning, so a following ``block_sum``/``block_max`` may
   overwrite ``scratch`` while no warp still reads it.

The caller declares ``scratch`` (``cuda.shared.array(32, float32)``), not the device function:
the kernel then shows its whole shared-memory budget in one place, and one scratch array can
serve several reductions in a row.

Rules for callers: every thread of the block calls ``block_*`` (it contains ``syncthreads``),
so threads without data contribute ``float32(0.0)`` (sum) or ``float32(-math.inf)`` (max)
instead of returning early; the block is one-dimensional and its size a multiple of 32
(a partial warp would shuffle with lanes that do not exist: undefined on a GPU, NaN in the
simulator).
"""

import math

from numba import cuda, float32

from numba_vllm.kernels.jit import device_function

FULL_MASK = 0xFFFFFFFF
WARP_SIZE = 32


@device_function
def warp_sum(x):
    """Sum of ``x`` over the 32 lanes of the warp, returned in every lane."""
    offset = WARP_SIZE // 2
    while offset > 0:
        x += cuda.shfl_xor_sync(FULL_MASK, x, offset)
        offset //= 2
    return x


@device_function
def warp_max(x):
    """Maximum of ``x`` over the 32 lanes of the warp, returned in every lane."""
    offset = WARP_SIZE // 2
    while offset > 0:
        x = max(x, cuda.shfl_xor_sync(FULL_MASK, x, offset))
        offset //= 2
    return x


@device_function
def block_sum(x, scratch):
    """Sum of ``x`` over the block, returned in every thread.

    scratch: (32,) float32 shared array, overwritten.
    """
    lane = cuda.threadIdx.x % WARP_SIZE
    warp = cuda.threadIdx.x // WARP_SIZE
    num_warps = cuda.blockDim.x // WARP_SIZE
    x = warp_sum(x)
    if lane == 0:
        scratch[warp] = x
    cuda.syncthreads()  # wait for every warp's partial sum
    partial = scratch[lane] if lane < num_warps else float32(0.0)
    total = warp_sum(partial)
    cuda.syncthreads()  # wait until every warp has read scratch, so it can be reused
    return total


@device_function
def block_max(x, scratch):
    """Maximum of ``x`` over the block, returned in every thread.

    scratch: (32,) float32 shared array, overwritten.
    """
    lane = cuda.threadIdx.x % WARP_SIZE
    warp = cuda.threadIdx.x // WARP_SIZE
    num_warps = cuda.blockDim.x // WARP_SIZE
    x = warp_max(x)
    if lane == 0:
        scratch[warp] = x
    cuda.syncthreads()  # wait for every warp's partial maximum
    partial = scratch[lane] if lane < num_warps else float32(-math.inf)
    result = warp_max(partial)
    cuda.syncthreads()  # wait until every warp has read scratch, so it can be reused
    return result
