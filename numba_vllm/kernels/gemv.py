"""Skinny matrix products for decode: out (M, N) f32 = x (M, K) f32 @ w (N, K) bf16 .T, M <= 64.

With a few tokens the product is bound by reading the weights: every weight is used M times, and
for M = 1 the kernel does 2 FLOP per 2-byte weight. The job is to stream ``w`` once at full memory
bandwidth, so the kernel is laid out around the weight loads.

Thread mapping (``gemv_kernel``):

- A block is ``WARPS_PER_BLOCK`` = 8 warps. Warps form *row groups* of ``warps_per_group`` warps
  (1, 2, 4 or 8, chosen by the launcher). A row group computes ``ROWS`` = 4 consecutive rows of
  ``w`` for ``tokens`` (1, 2 or 4) consecutive tokens: ``ROWS * tokens`` outputs. ``blockIdx.y``
  picks the rows, ``blockIdx.x`` the tokens: the blocks of all token groups of one set of rows are
  launched one after the other, so the rows they share come from L2 after the first.
- The warps of a group split K between them: a lane handles the 16-byte chunks (8 weights) number
  ``part * 32 + lane``, then every ``32 * warps_per_group``-th chunk after it, where ``part`` is its
  warp's place in the group. Consecutive lanes read consecutive 16 bytes of a row: a warp reads 512
  contiguous bytes per row per step, one ``ld.global.nc.v4.u32`` each (``vector_load.py``).
- Per chunk a lane loads the chunk of each of its ``ROWS`` rows first (independent loads, in flight
  together), unpacks the bf16 pairs with shifts, then for each token loads the 8 matching ``x``
  values (two 16-byte loads) and does ``ROWS * 8`` FMAs. Partial sums live in a ``(ROWS, TOKENS)``
  register array (indexed by constant, unrolled loops only, so it never touches local memory).
- Reduction: ``warp_sums`` (``reductions.py``) sums the lane's ``ROWS * tokens`` partials over the warp
  at once, a butterfly that halves the values each lane carries at every step (16 outputs in 16
  shuffles, not 80); the lane left with each output writes it to shared memory, ``syncthreads``, then
  one thread per output adds the group's ``warps_per_group`` partials and writes (or adds to) ``out``.

Why split K across warps: a lane keeps only a few loads in flight, and the memory system needs about
a latency's worth of bytes in flight (~4.8 TB/s x ~0.7 us, ~25 KB per SM) to reach its bandwidth.
With 2048 rows and one warp per group there are too few warps on the chip; splitting K multiplies
the warps. With 128256 rows (the vocabulary head) there are plenty, and ``warps_per_group = 1``
avoids the cross-warp step. The launcher aims at ``TARGET_WARPS / tokens`` warps: with more tokens
a warp has more loads in flight (x) and more sums to reduce, and on an H200 one warp per group was
fastest from 4 tokens up.

``x`` is not staged in shared memory: at batch 1 every warp of an SM reads the same few KB of it, so
after the first warp it comes from L1, and a staging copy would add a barrier for nothing. With many
tokens that stops holding: x is re-read once per row group, from L2, and that caps gemv at ~16
TFLOP/s at M = 32 on an H200 (still 5x the 128-wide gemm tile there, which leaves most of the GPU
idle at such M). Staging x per block is the next step if batched decode needs it.

Rows past N and tokens past M are clamped to the last row and token (a duplicate computation whose
result is not written), so every lane of every warp runs the same loop and takes part in the
shuffles.

Variants: ``ROWS`` and ``tokens`` size register arrays, so they are compile-time constants; the
module builds one kernel per token count in ``TOKEN_TILES`` and fusion (``gemv_t1_kernel``,
``gemv_t4_norm_silu_kernel``, ...: ``gemv_kernel_for``) and the launcher picks the smallest token
tile >= M (M > 4 uses several token blocks).
Measured on an H200 (Llama 3.2 1B shapes): 4 rows per group beat 1, 2 and 8; 4 tokens per block
beat 8 (whose 32 accumulators per lane cost occupancy and shuffles).

Fusions (fast path only), each a compile-time variant, so the plain kernel pays nothing for them:

- ``normalize``: the RMSNorm before the product, ``x <- x / sqrt(mean(x^2) + eps) * g``, done on
  the fly. A lane multiplies each x value it loads by the norm weight ``g`` (one more 16-byte load
  per chunk, shared by all tokens) and adds its square to a per-token ``sum_sq``; the warps of a row
  group together see every x of a token exactly once, so ``sum_sq`` reduces with the dot products
  (one more partial per token in shared memory), and the stored value is ``dot * 1/sqrt(sum_sq/K +
  eps)``: the scale is the same for the whole row, so it can come after the sum. This removes the
  norm's launch and its pass over x; the cost is 8 FMAs per loaded x chunk per token.
- ``silu_mul``: SwiGLU's ``silu(gate) * up`` in the store. ``w`` is ``[gate; up]`` (2F, K); a row
  group takes 2 gate rows and the 2 up rows of the same columns (``ROWS / 2`` columns), so the
  thread that stores column ``j`` holds both dot products and writes ``silu(gate_j) * up_j`` to an
  (M, F) output: no (M, 2F) intermediate, no activation launch.

Requirements of the fast path: K % 8 == 0 and 16-byte aligned ``x`` and ``w``. Otherwise (tiny test
models with K = 48 are fine, K = 100 is not) the launcher uses ``gemv_unaligned_kernel``: one warp
per row, scalar 2-byte loads, tokens in a loop. Correct for any shape; not fast.
"""

import functools
import math

import numpy as np
from numba import cuda, float32

from numba_vllm.kernels._launch import KernelError, check_array, launch
from numba_vllm.kernels.jit import kernel
from numba_vllm.kernels.reductions import WARP_SIZE, warp_sum, warp_sums
from numba_vllm.kernels.vector_load import (
    BF16_PER_VECTOR,
    bf16_bits_to_f32,
    bf16x2_to_f32,
    load_f32x4,
    load_u32x4,
    vector_aligned,
)
from numba_vllm.loading.bf16 import BF16

MAX_TOKENS = 64  # the largest M the launcher accepts; more tokens belong to gemm.py
WARPS_PER_BLOCK = 8
BLOCK_THREADS = WARPS_PER_BLOCK * WARP_SIZE
ROWS = 4  # rows of w per row group
TOKEN_TILES = (1, 2, 4)  # tokens per block of the compiled variants
TARGET_WARPS = 16384  # at batch 1, warps to launch before splitting K stops (~2 waves of 132 SMs x 64)
MAX_WARPS_PER_GROUP = WARPS_PER_BLOCK


def _make_gemv_kernel(tokens, normalize=False, silu_mul=False, rows=ROWS):
    """The fast-path kernel for a (rows, tokens) register tile, optionally with an RMSNorm of x
    fused into its loads (``normalize``) and SwiGLU fused into its stores (``silu_mul``); see the
    module docstring."""
    outputs = rows * tokens  # dot products of a row group
    sums = outputs + tokens if normalize else outputs  # per warp: the dot products, then each token's sum of x^2
    half = rows // 2  # silu_mul: a row group's gate rows (then as many up rows), its output columns
    stored = half * tokens if silu_mul else outputs  # values a row group writes
    sum_dots = warp_sums(outputs)  # (rows and tokens are powers of two)
    sum_squares = warp_sums(tokens)

    @kernel(fastmath=True)
    def gemv_kernel(x, w_bits, out, accumulate, group_shift, norm_bits, eps):
        # x (M, K) f32; w_bits (N, K) uint16 (bf16 bits); K % 8 == 0
        # out (M, N) f32, or with silu_mul (M, N / 2) (w is [gate; up], each N / 2 rows)
        # norm_bits (K,) uint16: the RMSNorm weight's bf16 bits (read only with normalize); eps f32
        # group_shift: log2(warps_per_group), so that the splits below are shifts, not divisions
        num_tokens = x.shape[0]
        k_dim = x.shape[1]
        num_rows = w_bits.shape[0]
        num_cols = num_rows // 2 if silu_mul else num_rows  # columns of out
        partial = cuda.shared.array((WARPS_PER_BLOCK, sums), float32)  # each warp's sums
        acc = cuda.local.array((rows, tokens), float32)  # this lane's partial dot products
        dots = cuda.local.array(outputs, float32)  # the same, flat: reduced over the warp in place
        sum_sq = cuda.local.array(tokens, float32)  # normalize: this lane's partial sums of x^2
        wf = cuda.local.array((rows, BF16_PER_VECTOR), float32)  # one chunk of each row
        gf = cuda.local.array(BF16_PER_VECTOR, float32)  # normalize: the chunk's norm weights

        lane = cuda.threadIdx.x % WARP_SIZE
        warp = cuda.threadIdx.x // WARP_SIZE
        warps_per_group = 1 << group_shift
        groups_per_block = WARPS_PER_BLOCK >> group_shift
        group = warp >> group_shift
        part = warp & (warps_per_group - 1)
        # first output column of the group: with silu_mul its rows are gate col0.., then up col0..
        col0 = (cuda.blockIdx.y * groups_per_block + group) * (half if silu_mul else rows)
        token0 = cuda.blockIdx.x * tokens

        for r in range(rows):
            for t in range(tokens):
                acc[r, t] = float32(0.0)
        for t in range(tokens):
            sum_sq[t] = float32(0.0)

        num_chunks = k_dim // BF16_PER_VECTOR
        chunk = part * WARP_SIZE + lane
        while chunk < num_chunks:  # (a while loop: range() with a run-time step divides to count)
            k = chunk * BF16_PER_VECTOR
            for r in range(rows):
                if silu_mul:  # rows past the end are clamped: computed, never stored
                    row = min(col0 + r % half, num_cols - 1) + (r // half) * num_cols
                else:
                    row = min(col0 + r, num_rows - 1)
                w0, w1, w2, w3 = load_u32x4(w_bits, (row, k))
                wf[r, 0], wf[r, 1] = bf16x2_to_f32(w0)
                wf[r, 2], wf[r, 3] = bf16x2_to_f32(w1)
                wf[r, 4], wf[r, 5] = bf16x2_to_f32(w2)
                wf[r, 6], wf[r, 7] = bf16x2_to_f32(w3)
            if normalize:
                g0, g1, g2, g3 = load_u32x4(norm_bits, k)
                gf[0], gf[1] = bf16x2_to_f32(g0)
                gf[2], gf[3] = bf16x2_to_f32(g1)
                gf[4], gf[5] = bf16x2_to_f32(g2)
                gf[6], gf[7] = bf16x2_to_f32(g3)
            for t in range(tokens):
                token = min(token0 + t, num_tokens - 1)
                x0, x1, x2, x3 = load_f32x4(x, (token, k))
                x4, x5, x6, x7 = load_f32x4(x, (token, k + 4))
                if normalize:  # sum x^2 for the norm's scale, and apply its weights now
                    sum_sq[t] += x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3 + x4 * x4 + x5 * x5 + x6 * x6 + x7 * x7
                    x0, x1, x2, x3 = x0 * gf[0], x1 * gf[1], x2 * gf[2], x3 * gf[3]
                    x4, x5, x6, x7 = x4 * gf[4], x5 * gf[5], x6 * gf[6], x7 * gf[7]
                for r in range(rows):
                    a = acc[r, t]
                    a += wf[r, 0] * x0
                    a += wf[r, 1] * x1
                    a += wf[r, 2] * x2
                    a += wf[r, 3] * x3
                    a += wf[r, 4] * x4
                    a += wf[r, 5] * x5
                    a += wf[r, 6] * x6
                    a += wf[r, 7] * x7
                    acc[r, t] = a
            chunk += WARP_SIZE * warps_per_group

        for r in range(rows):
            for t in range(tokens):
                dots[r * tokens + t] = acc[r, t]
        total, o, writer = sum_dots(dots, lane)  # each dot product over the warp: 16 shuffles for 16, not 80
        if writer:  # this lane holds dot product o (= r * tokens + t)
            partial[warp, o] = total
        if normalize:
            total, t, writer = sum_squares(sum_sq, lane)
            if writer:  # token t's sum of x^2
                partial[warp, outputs + t] = total
        cuda.syncthreads()  # wait for every warp's sums

        i = cuda.threadIdx.x  # one thread per value the block stores: (group g, row r, token t)
        if i < groups_per_block * stored:
            g = i // stored
            o = i % stored  # = r * tokens + t
            t = o % tokens
            first = g * warps_per_group
            total = float32(0.0)
            for p in range(warps_per_group):
                total += partial[first + p, o]
            scale = float32(1.0)
            if normalize:  # the group's warps together saw each x of the token once
                sq = float32(0.0)
                for p in range(warps_per_group):
                    sq += partial[first + p, outputs + t]
                scale = float32(1.0) / math.sqrt(sq / float32(k_dim) + eps)
            total *= scale
            if silu_mul:  # o is a gate row's; the up row of the same column is half rows further
                up = float32(0.0)
                for p in range(warps_per_group):
                    up += partial[first + p, o + half * tokens]
                total = total / (float32(1.0) + math.exp(-total)) * (up * scale)
            col = (cuda.blockIdx.y * groups_per_block + g) * (half if silu_mul else rows) + o // tokens
            token = token0 + t
            if col < num_cols and token < num_tokens:
                if accumulate:
                    out[token, col] += total
                else:
                    out[token, col] = total

    suffix = ("_norm" if normalize else "") + ("_silu" if silu_mul else "")
    gemv_kernel.py_func.__name__ = f"gemv_t{tokens}{suffix}_kernel"  # errors name the variant that failed
    return gemv_kernel


_KERNELS = {  # (tokens, normalize, silu_mul) -> kernel; numba compiles each on its first launch
    (tokens, normalize, silu_mul): _make_gemv_kernel(tokens, normalize, silu_mul)
    for tokens in TOKEN_TILES
    for normalize in (False, True)
    for silu_mul in (False, True)
}


def gemv_kernel_for(tokens: int, normalize: bool = False, silu_mul: bool = False):
    """The fast-path kernel of a token tile (one of TOKEN_TILES) and fusions."""
    return _KERNELS[(tokens, normalize, silu_mul)]


@kernel(fastmath=True)
def gemv_unaligned_kernel(x, w_bits, out, accumulate):
    """Any K, any alignment: one warp per row of w, lanes stride K one element at a time."""
    # x (M, K) f32; w_bits (N, K) uint16 (bf16 bits); out (M, N) f32
    num_tokens = x.shape[0]
    k_dim = x.shape[1]
    num_rows = w_bits.shape[0]
    lane = cuda.threadIdx.x % WARP_SIZE
    row = cuda.blockIdx.x * WARPS_PER_BLOCK + cuda.threadIdx.x // WARP_SIZE
    w_row = min(row, num_rows - 1)  # clamped so the whole warp joins warp_sum
    for token in range(num_tokens):
        acc = float32(0.0)
        for k in range(lane, k_dim, WARP_SIZE):
            acc += bf16_bits_to_f32(w_bits[w_row, k]) * x[token, k]
        total = warp_sum(acc)
        if lane == 0 and row < num_rows:
            if accumulate:
                out[token, row] += total
            else:
                out[token, row] = total


def weight_bits(w):
    """The (N, K) uint16 view of a bf16 weight (no copy); uint16 arrays pass through."""
    return w if np.dtype(w.dtype) == np.uint16 else w.view(np.uint16)


def check_linear_args(x, w, out, out_cols=None, out_dtype=np.float32):
    """Check x (M, K) f32, w (N, K) bf16 (or its uint16 bits), out (M, out_cols or N) of out_dtype
    (f32 unless said); return M, N, K."""
    check_array("x", x, np.float32, ndim=2)
    if np.dtype(w.dtype) not in (BF16, np.dtype(np.uint16)):
        raise KernelError(f"w: dtype {w.dtype}, expected bfloat16 (or its uint16 bits)")
    num_tokens, k_dim = x.shape
    check_array("w", w, shape=(None, k_dim))
    num_rows = w.shape[0]
    check_array("out", out, out_dtype, shape=(num_tokens, num_rows if out_cols is None else out_cols))
    return num_tokens, num_rows, k_dim


def plan_gemv(num_tokens: int, num_rows: int, k_dim: int):
    """(tokens per block, warps per row group, grid) of the fast path.

    grid.y stays below CUDA's 65535: K is split (fewer rows per block) only while the row groups
    are fewer than TARGET_WARPS, i.e. N < 4 * 16384; unsplit, a block covers 32 rows.
    """
    tokens = next(t for t in TOKEN_TILES if t >= min(num_tokens, TOKEN_TILES[-1]))
    token_blocks = -(-num_tokens // tokens)
    groups = -(-num_rows // ROWS) * token_blocks
    warps_per_group = 1
    chunks_per_row = k_dim // BF16_PER_VECTOR
    while (
        warps_per_group < MAX_WARPS_PER_GROUP
        and groups * warps_per_group < TARGET_WARPS // tokens
        and chunks_per_row >= 2 * WARP_SIZE * warps_per_group  # each warp keeps >= 1 chunk per lane
    ):
        warps_per_group *= 2
    rows_per_block = ROWS * (WARPS_PER_BLOCK // warps_per_group)
    grid = (token_blocks, -(-num_rows // rows_per_block))
    return tokens, warps_per_group, grid


@functools.cache
def _unused_norm_weight():
    """The norm-weight argument of the variants without a norm (never read): one shared array."""
    return cuda.device_array(BF16_PER_VECTOR, np.uint16)


def gemv_fuses(x, w) -> bool:
    """Whether the fast path runs for x and w, and with it the fusions (``norm``, ``silu_mul``):
    K a multiple of 8 and both 16-byte aligned."""
    return x.shape[1] % BF16_PER_VECTOR == 0 and vector_aligned(x) and vector_aligned(weight_bits(w))


def gemv(x, w, out, accumulate: bool = False, norm=None, silu_mul: bool = False) -> None:
    """out = x @ w.T (or out += x @ w.T) for M <= 64 tokens.

    x (M, K) f32, w (N, K) bf16 device array (or its uint16 bits view), out (M, N) f32.
    Fusions (fast path only, see ``gemv_fuses``):
    - ``norm=(weight, eps)``, weight (K,) bf16: the product uses rms_norm(x) * weight in place of x,
      normalised on the fly (no launch, no pass over memory for the norm);
    - ``silu_mul=True``: w is [gate; up] (2F, K) and out (M, F) = silu(x @ gate.T) * (x @ up.T).
    """
    out_cols = w.shape[0] // 2 if silu_mul else None
    num_tokens, num_rows, k_dim = check_linear_args(x, w, out, out_cols)
    if not 1 <= num_tokens <= MAX_TOKENS:
        raise KernelError(f"gemv: {num_tokens} tokens, expected 1..{MAX_TOKENS} (use gemm)")
    if silu_mul and num_rows % 2:
        raise KernelError(f"gemv: silu_mul needs [gate; up] stacked, an even number of rows, got {num_rows}")
    w_bits = weight_bits(w)
    flag = 1 if accumulate else 0
    if gemv_fuses(x, w_bits):
        if norm is not None:
            norm_weight, eps = norm
            check_array("norm weight", norm_weight, shape=(k_dim,))
            norm_bits = weight_bits(norm_weight)
        else:
            norm_bits, eps = _unused_norm_weight(), 0.0
        tokens, warps_per_group, grid = plan_gemv(num_tokens, num_rows, k_dim)
        group_shift = warps_per_group.bit_length() - 1
        kernel_ = gemv_kernel_for(tokens, norm is not None, silu_mul)
        launch(kernel_, grid, BLOCK_THREADS, x, w_bits, out, flag, group_shift, norm_bits, float32(eps))
    elif norm is not None or silu_mul:
        raise KernelError("gemv: norm and silu_mul need K % 8 == 0 and 16-byte aligned x and w (see gemv_fuses)")
    else:
        grid = -(-num_rows // WARPS_PER_BLOCK)
        launch(gemv_unaligned_kernel, grid, BLOCK_THREADS, x, w_bits, out, flag)
