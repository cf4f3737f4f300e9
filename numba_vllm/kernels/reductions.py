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

Many values at once (``warp_sums``): a lane holding ``count`` values to be summed over the warp would
spend 5 shuffles on each with the butterfly. Instead, at the step of offset 16 each lane sends the
half of its values its partner keeps and adds the half it receives to the half it keeps (lanes
``i`` with bit 4 clear keep the first half); at offset 8 the same with the half of that, and so on:
after log2(count) steps each lane holds one value, summed over the 2^steps lanes that differ in the
bits done, and the rest of the butterfly finishes it. count - 1 + 5 - log2(count) shuffles in all:
16 instead of 80 for 16 values.

The caller declares ``scratch`` (``cuda.shared.array(32, float32)``), not the device function:
the kernel then shows its whole shared-memory budget in one place, and one scratch array can
serve several reductions in a row.

Rules for callers: every thread of the block calls ``block_*`` (it contains ``syncthreads``),
so threads without data contribute ``float32(0.0)`` (sum) or ``float32(-math.inf)`` (max)
instead of returning early; the block is one-dimensional and its size a multiple of 32
(a partial warp would shuffle with lanes that do not exist: undefined on a GPU, NaN in the
simulator).
"""

import functools
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


@functools.cache
def warp_sums(count: int):
    """The device function ``sums(values, lane)`` for ``count`` values a lane (a power of two, at most
    32): sums ``values[:count]`` (a local array, used as scratch) over the warp's lanes, each value
    separately (the module docstring). Returns ``(total, index, writer)``: the sum this lane ends with,
    which of the values it is (the lane's bits 4, 3, ..., as many as the halvings, bit 4 the highest),
    and whether the lane is the first of those ending with it (the lanes that differ from it only in the
    bits below the halvings'), so that the writers hold each value once between them. Every lane of
    the warp must call it."""
    assert count in (1, 2, 4, 8, 16, 32), count
    steps = count.bit_length() - 1  # halvings: log2(count)

    @device_function
    def sums(values, lane):
        n = count
        offset = WARP_SIZE // 2
        for _ in range(steps):  # (constant trip counts: unrolled, every index a constant)
            n //= 2
            upper = (lane & offset) != 0  # this lane keeps values n .. 2n - 1, its partner 0 .. n - 1
            for i in range(n):
                low = values[i]
                high = values[i + n]
                received = cuda.shfl_xor_sync(FULL_MASK, low if upper else high, offset)
                values[i] = (high if upper else low) + received
            offset //= 2
        total = values[0]
        while offset > 0:
            total += cuda.shfl_xor_sync(FULL_MASK, total, offset)
            offset //= 2
        index = (lane >> (5 - steps)) & (count - 1)
        writer = (lane & ((WARP_SIZE >> steps) - 1)) == 0
        return total, index, writer

    return sums


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
