"""RMSNorm, alone and fused with the residual add that precedes it in every Llama layer.

    rms_norm:      out = x / sqrt(mean(x^2) + eps) * weight
    add_rms_norm:  residual += x;  out = rms_norm(residual) * weight      (one pass over memory)

x, residual, out (T, D) float32; weight (D,) bf16; eps a float32 scalar. ``rms_norm`` can store its
out as bf16 bits instead ((T, D) uint16, rounded to nearest even): the normed x of a product that
``gemm_wgmma`` runs, written straight into the bf16 workspace that GEMM copies to shared memory by
the TMA, so no float32 copy is written and no conversion pass reads it back (``matmul.linear``).

Thread mapping: one block per row (grid = T) of ``min(RMSNORM_MAX_THREADS, ceil(D / 4) rounded up
to 32)`` threads: 512 for Llama 3.2 1B (D = 2048), each owning 4 columns. The row is walked in
tiles of ``blockDim.x * RMSNORM_COLS_PER_THREAD`` columns; in a tile, thread ``x`` owns columns
``tile + x + c * blockDim.x`` for ``c < 4``, so each warp instruction touches 32 neighbouring floats
(coalesced). A thread loads its 4 values before using any of them, so 4 loads are in flight at
once (one at a time would leave an SM far short of the ~32 KB in flight that HBM needs).

1. Each thread sums the squares of its columns (columns past the end of the row count as 0: every
   thread must take part in the block reduction).
2. ``reductions.block_sum`` adds the partial sums: a warp-shuffle butterfly in each warp, the warp
   results through ``scratch`` in shared memory, then a second butterfly. Every thread gets the
   total, so no broadcast is needed.
3. Each thread scales its own columns by ``1 / sqrt(total / D + eps)`` and the weight.

Shared memory: ``scratch``, 32 float32 (128 bytes), one slot per warp for ``block_sum``. The
per-thread (4,) arrays live in registers: their loops have a constant trip count, so the compiler
unrolls them and every index is a constant.

When the row fits in one tile (D <= 4 * RMSNORM_MAX_THREADS = 4096: Llama 3.2 1B and 3B, 3.1 8B), each
thread keeps its columns in registers between the passes and the row is read from memory once.
A wider row is read again in the second pass (mostly L1/L2 hits), which keeps the kernel valid
for any D.

The fused variant exists because the residual add and the norm always come together
(``h = norm(x + attn_out)``, twice per layer): doing both in one kernel saves a launch and a full
read and write of the (T, D) activations. For a row wider than one tile, the second pass reads
back the residual values the same thread wrote in the first pass, so no barrier is needed.

The bf16 weight reaches the kernels as its uint16 view and is converted by a shift and a bit-cast
(``vector_load.bf16_bits_to_f32``): numba-cuda's own ``float32(w[j])`` on a bf16 element is a call
into a C++ shim through local memory.

Aliasing: ``out`` may be the same array as ``x`` (every element of x is read, by the thread that
later writes that element of out, before it is written). In ``add_rms_norm``, ``out`` must not be
``residual``: that would overwrite the residual stream with the normalized values.
"""

import math

import numpy as np
from numba import cuda, float32

from numba_vllm.kernels._launch import KernelError, check_array, launch
from numba_vllm.kernels.jit import device_function, kernel
from numba_vllm.kernels.mma import f32_to_bf16_bits
from numba_vllm.kernels.reductions import WARP_SIZE, block_sum
from numba_vllm.kernels.vector_load import bf16_bits_to_f32
from numba_vllm.loading.bf16 import BF16

RMSNORM_MAX_THREADS = 1024  # threads per block; a row wider than 4 columns a thread loops
RMSNORM_COLS_PER_THREAD = 4  # columns a thread loads before using them (a compile-time constant)


@device_function
def _store_normed(values, weight_bits, out, t, inv_rms, xs, ws, bf16_out):
    """Step 3, both kernels' second pass over row t: out[t, j] = values[t, j] * inv_rms * weight[j]
    for this thread's columns, as float32, or with ``bf16_out`` as bf16 bits rounded to nearest even.

    values, out (T, D): the normed values (x, or add_rms_norm's residual) and where they go (float32,
    or uint16 with ``bf16_out``); xs, ws (4,) float32 scratch, xs holding this thread's values of the
    row's one tile when the row fits one (else they are read again: in add_rms_norm the residual
    values this same thread wrote in the first pass, so no barrier is needed). ``bf16_out`` is the
    same at every call site of a kernel, so the branch on it is folded away.
    """
    num_cols = values.shape[1]
    tile_width = cuda.blockDim.x * RMSNORM_COLS_PER_THREAD
    row_in_registers = num_cols <= tile_width
    for tile in range(0, num_cols, tile_width):
        first = tile + cuda.threadIdx.x
        for c in range(RMSNORM_COLS_PER_THREAD):
            j = first + c * cuda.blockDim.x
            if j < num_cols:
                if not row_in_registers:
                    xs[c] = values[t, j]
                ws[c] = bf16_bits_to_f32(weight_bits[j])
        for c in range(RMSNORM_COLS_PER_THREAD):
            j = first + c * cuda.blockDim.x
            if j < num_cols:
                value = xs[c] * inv_rms * ws[c]
                if bf16_out:
                    out[t, j] = f32_to_bf16_bits(value)
                else:
                    out[t, j] = value


def _make_rms_norm_kernel(bf16_out: bool):
    """The norm kernel storing float32 (``bf16_out`` False) or bf16 bits rounded to nearest even (True:
    the x workspace of ``gemm_wgmma``, which then copies it as it is). ``bf16_out`` is a constant of
    the compiled code: the branch on it costs nothing."""

    @kernel
    def rms_norm_kernel(x, weight_bits, out, eps):
        """out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight. Block t handles row t.

        x (T, D) float32; weight_bits (D,) uint16 (the bf16 weight's bits); eps float32;
        out (T, D) float32, or uint16 (bf16 bits) in the bf16 variant.
        """
        scratch = cuda.shared.array(32, float32)  # (32,) one partial sum per warp, for block_sum
        xs = cuda.local.array(RMSNORM_COLS_PER_THREAD, float32)  # (4,) this thread's x values in a tile
        ws = cuda.local.array(RMSNORM_COLS_PER_THREAD, float32)  # (4,) and weights
        t = cuda.blockIdx.x
        num_cols = x.shape[1]
        tile_width = cuda.blockDim.x * RMSNORM_COLS_PER_THREAD
        sum_sq = float32(0.0)
        for tile in range(0, num_cols, tile_width):
            first = tile + cuda.threadIdx.x
            for c in range(RMSNORM_COLS_PER_THREAD):  # every load first: they overlap in flight
                j = first + c * cuda.blockDim.x
                xs[c] = x[t, j] if j < num_cols else float32(0.0)
            for c in range(RMSNORM_COLS_PER_THREAD):
                sum_sq += xs[c] * xs[c]
        total = block_sum(sum_sq, scratch)
        inv_rms = float32(1.0) / math.sqrt(total / float32(num_cols) + eps)
        _store_normed(x, weight_bits, out, t, inv_rms, xs, ws, bf16_out)  # xs: this thread's x

    return rms_norm_kernel


rms_norm_kernel = _make_rms_norm_kernel(False)
rms_norm_bf16_kernel = _make_rms_norm_kernel(True)


@kernel
def add_rms_norm_kernel(x, residual, weight_bits, out, eps):
    """residual[t] += x[t]; out[t] = rms_norm(residual[t]) * weight. Block t handles row t.

    x, residual, out (T, D) float32; weight_bits (D,) uint16 (the bf16 weight's bits); eps float32.
    """
    scratch = cuda.shared.array(32, float32)  # (32,) one partial sum per warp, for block_sum
    xs = cuda.local.array(RMSNORM_COLS_PER_THREAD, float32)  # (4,) x, then residual + x, in a tile
    rs = cuda.local.array(RMSNORM_COLS_PER_THREAD, float32)  # (4,) residual, then the weights
    t = cuda.blockIdx.x
    num_cols = x.shape[1]
    tile_width = cuda.blockDim.x * RMSNORM_COLS_PER_THREAD
    sum_sq = float32(0.0)
    for tile in range(0, num_cols, tile_width):
        first = tile + cuda.threadIdx.x
        for c in range(RMSNORM_COLS_PER_THREAD):  # every load first: they overlap in flight
            j = first + c * cuda.blockDim.x
            if j < num_cols:
                xs[c] = x[t, j]
                rs[c] = residual[t, j]
        for c in range(RMSNORM_COLS_PER_THREAD):
            j = first + c * cuda.blockDim.x
            if j < num_cols:
                v = rs[c] + xs[c]
                residual[t, j] = v
                xs[c] = v
                sum_sq += v * v
    total = block_sum(sum_sq, scratch)
    inv_rms = float32(1.0) / math.sqrt(total / float32(num_cols) + eps)
    _store_normed(residual, weight_bits, out, t, inv_rms, xs, rs, False)  # xs: this thread's residual + x


def _num_threads(dim: int) -> int:
    cols_per_thread = -(-dim // RMSNORM_COLS_PER_THREAD)
    return min(RMSNORM_MAX_THREADS, -(-cols_per_thread // WARP_SIZE) * WARP_SIZE)


def rms_norm(x, weight, out, eps: float) -> None:
    """out = rms_norm(x) * weight, row by row (device arrays; ``out`` may be ``x``).

    x: (T, D) float32; weight: (D,) bf16; eps: e.g. 1e-5; out: (T, D), overwritten: float32, or
    uint16 for the bf16 bits of the values (rounded to nearest even, as ``gemm_wgmma`` rounds x: how
    ``matmul.linear`` writes the normed x straight into that GEMM's bf16 workspace).
    """
    check_array("x", x, dtype="float32", ndim=2)
    num_rows, dim = x.shape
    check_array("weight", weight, dtype=BF16, shape=(dim,))
    bf16_out = np.dtype(out.dtype) == np.uint16
    check_array("out", out, dtype="uint16" if bf16_out else "float32", shape=(num_rows, dim))
    if num_rows == 0:
        return
    kernel_ = rms_norm_bf16_kernel if bf16_out else rms_norm_kernel
    launch(kernel_, num_rows, _num_threads(dim), x, weight.view(np.uint16), out, float32(eps))


def add_rms_norm(x, residual, weight, out, eps: float) -> None:
    """Residual add and RMSNorm in one pass (device arrays).

    Afterwards ``residual`` holds ``residual + x`` (the updated residual stream) and ``out`` holds
    ``rms_norm(residual + x) * weight`` (the input of the next matmul); ``x`` is unchanged unless
    ``out`` is ``x``.

    x: (T, D) float32; residual: (T, D) float32, updated in place; weight: (D,) bf16;
    out: (T, D) float32, overwritten, may be ``x`` but not ``residual``; eps: e.g. 1e-5.
    """
    check_array("x", x, dtype="float32", ndim=2)
    num_rows, dim = x.shape
    check_array("residual", residual, dtype="float32", shape=(num_rows, dim))
    check_array("weight", weight, dtype=BF16, shape=(dim,))
    check_array("out", out, dtype="float32", shape=(num_rows, dim))
    if out is residual:
        raise KernelError("add_rms_norm: out must not be residual (it would overwrite the residual stream)")
    if num_rows == 0:
        return
    launch(add_rms_norm_kernel, num_rows, _num_threads(dim), x, residual, weight.view(np.uint16), out, float32(eps))
