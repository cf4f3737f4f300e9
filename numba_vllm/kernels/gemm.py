"""Tiled matrix product for prefill: out (M, N) f32 = x (M, K) f32 @ w (N, K) bf16 .T (or out += ...).

The classic register-blocked SGEMM, with bf16 weights converted to float32 as they are staged:
Numba has no tensor-core API, so this runs on the FP32 FMA units (H200: 67 TFLOP/s datasheet).

Tiling (all sizes are the UPPER_CASE constants below):

- A block of ``BLOCK_THREADS`` = 256 threads computes a ``BLOCK_M x BLOCK_N`` = 128 x 128 tile of
  ``out``; ``blockIdx.x`` picks the columns (rows of ``w``), ``blockIdx.y`` the rows (tokens).
- It walks K in steps of ``BLOCK_K`` = 16. Each step stages a 128 x 16 slice of ``x`` and of ``w``
  in shared memory, *transposed* (``xs[k, m]``, ``ws[k, n]``) so that the 4 values a thread needs
  for one k are adjacent and are read as one 16-byte shared load.
- Thread ``(tx, ty)`` = ``(tid % 16, tid // 16)`` owns an 8 x 8 micro-tile of the output: rows
  ``ty*4 + {0..3}`` and ``64 + ty*4 + {0..3}``, columns ``tx*4 + {0..3}`` and ``64 + tx*4 + {0..3}``.
  Per k it reads 8 values of ``x`` and 8 of ``w`` from shared memory and does 64 FMAs into its
  ``acc`` (8 x 8 in ``cuda.local.array``, indexed only by constant, fully unrolled loops, so it
  lives in registers). Splitting the micro-tile in two halves 64 apart keeps a warp's shared loads
  on few 16-byte rows (broadcast) instead of strided ones (bank conflicts).
- Staging is double-buffered: while the block computes on buffer ``tile % 2``, each thread already
  holds the next slice in registers (its global loads were issued before the FMAs, so their latency
  hides behind them); it stores them into the other buffer at the top of the next step. One
  ``syncthreads`` per step suffices (see the comment at it).
- Global loads: ``x`` as 16-byte ``ld.global.nc.v4.f32`` (2 per thread per step), ``w`` as one
  16-byte ``ld.global.nc.v4.u32`` (8 bf16) per thread per step, unpacked with shifts
  (``vector_load.py``).

Edges: rows past M and N are clamped to the last row when loading (their products land only in
outputs that are not stored), and the stores are guarded. A K slice that runs past K, or any slice
when K % 8 != 0 or an array is not 16-byte aligned, is loaded element by element with zeros past K.

Shared memory: 2 buffers x (16 x 132 + 16 x 132) floats = 33 KB (132 = 128 + 4 padding, which
halves the bank conflicts of the transposing stores and keeps rows 16-byte aligned).

Registers: the 64 accumulators, 16 operands and 12 staged values take ~157 registers, so only one
256-thread block fits on an SM. ``gemm_two_blocks_kernel`` is the same code compiled with a cap of
128 registers (ptxas spills a few bytes: local memory that the PTX does not show): two blocks per SM
hide each other's barriers and latencies, which pays when there are more blocks than SMs. The
launcher picks by grid size; measured figures are at the definition below.
"""


from numba import cuda, float32

from numba_vllm.kernels._launch import launch, num_sms
from numba_vllm.kernels.gemv import check_linear_args, weight_bits
from numba_vllm.kernels.jit import device_function, kernel
from numba_vllm.kernels.vector_load import (
    SHARED_ALIGN,
    bf16_bits_to_f32,
    bf16x2_to_f32,
    load_f32x4,
    load_shared_f32x4,
    load_u32x4,
    vector_aligned,
)

BLOCK_M = 128  # output rows (tokens) per block
BLOCK_N = 128  # output columns (rows of w) per block
BLOCK_K = 16  # K per shared-memory stage
THREAD_M = 8  # output rows per thread: two groups of 4, HALF_M apart
THREAD_N = 8  # output columns per thread: two groups of 4, HALF_N apart
HALF_M = BLOCK_M // 2
HALF_N = BLOCK_N // 2
THREADS_N = BLOCK_N // THREAD_N  # 16 threads across the columns
BLOCK_THREADS = (BLOCK_M // THREAD_M) * THREADS_N  # 256
SMEM_PAD = 4  # floats added to each shared row: fewer bank conflicts, rows stay 16-byte aligned
XS_ROW = BLOCK_M + SMEM_PAD  # floats per k row of the staged x slice
WS_ROW = BLOCK_N + SMEM_PAD  # floats per k row of the staged w slice
X_VECTORS = BLOCK_M * BLOCK_K // 4 // BLOCK_THREADS  # 16-byte loads of x per thread per stage (2)
W_ROW_VECTORS = BLOCK_K // 8  # 16-byte loads per row of the w slice (2): 256 = one per thread
TWO_BLOCK_REGISTERS = 128  # register cap of gemm_two_blocks_kernel: 2 blocks of 256 threads per SM


@kernel(fastmath=True)
def gemm_kernel(x, w_bits, out, accumulate, vectors_ok):
    # x (M, K) f32; w_bits (N, K) uint16 (bf16 bits); out (M, N) f32
    # vectors_ok: 1 when K % 8 == 0 and x, w are 16-byte aligned (16-byte loads allowed)
    num_tokens = x.shape[0]
    k_dim = x.shape[1]
    num_rows = w_bits.shape[0]
    xs = cuda.shared.array((2, BLOCK_K, XS_ROW), float32, SHARED_ALIGN)  # x slices, transposed
    ws = cuda.shared.array((2, BLOCK_K, WS_ROW), float32, SHARED_ALIGN)  # w slices, transposed
    acc = cuda.local.array((THREAD_M, THREAD_N), float32)  # this thread's outputs
    x_next = cuda.local.array((X_VECTORS, 4), float32)  # next x slice, on its way to shared
    w_next = cuda.local.array(8, float32)  # next w slice (8 values of one row)
    a = cuda.local.array(THREAD_M, float32)  # x values of one k
    b = cuda.local.array(THREAD_N, float32)  # w values of one k

    tid = cuda.threadIdx.x
    tx = tid % THREADS_N
    ty = tid // THREADS_N
    m0 = cuda.blockIdx.y * BLOCK_M
    n0 = cuda.blockIdx.x * BLOCK_N

    # What this thread stages: x rows (m0 + x_row[i]) at k offsets x_k[i]; w row (n0 + w_row) at w_k.
    # Four (two) consecutive threads cover one 64-byte (32-byte) row segment: whole memory sectors.
    w_row = tid // W_ROW_VECTORS
    w_k = (tid % W_ROW_VECTORS) * 8
    w_src = min(n0 + w_row, num_rows - 1)

    for i in range(THREAD_M):
        for j in range(THREAD_N):
            acc[i, j] = float32(0.0)

    num_tiles = (k_dim + BLOCK_K - 1) // BLOCK_K
    # Load slice 0 into registers.
    _load_slice(x, w_bits, x_next, w_next, tid, m0, w_src, w_k, 0, vectors_ok)
    for tile in range(num_tiles):
        buf = tile % 2
        for i in range(X_VECTORS):
            flat = tid + i * BLOCK_THREADS
            row = flat // 4
            k = (flat % 4) * 4
            for j in range(4):
                xs[buf, k + j, row] = x_next[i, j]
        for j in range(8):
            ws[buf, w_k + j, w_row] = w_next[j]
        # Wait until the whole slice is in buffer `buf`. This also guarantees that every thread
        # finished computing on the previous slice, which lived in the other buffer: that buffer
        # is the one the next iteration's stores overwrite, so no second barrier is needed.
        cuda.syncthreads()
        if tile + 1 < num_tiles:  # issue the next slice's global loads before the FMAs
            _load_slice(x, w_bits, x_next, w_next, tid, m0, w_src, w_k, (tile + 1) * BLOCK_K, vectors_ok)
        for kk in range(BLOCK_K):
            a[0], a[1], a[2], a[3] = load_shared_f32x4(xs, (buf, kk, ty * 4))
            a[4], a[5], a[6], a[7] = load_shared_f32x4(xs, (buf, kk, HALF_M + ty * 4))
            b[0], b[1], b[2], b[3] = load_shared_f32x4(ws, (buf, kk, tx * 4))
            b[4], b[5], b[6], b[7] = load_shared_f32x4(ws, (buf, kk, HALF_N + tx * 4))
            for i in range(THREAD_M):
                for j in range(THREAD_N):
                    acc[i, j] += a[i] * b[j]

    for i in range(THREAD_M):
        m = m0 + (i // 4) * HALF_M + ty * 4 + i % 4
        for j in range(THREAD_N):
            n = n0 + (j // 4) * HALF_N + tx * 4 + j % 4
            if m < num_tokens and n < num_rows:
                if accumulate:
                    out[m, n] += acc[i, j]
                else:
                    out[m, n] = acc[i, j]


@device_function
def _load_slice(x, w_bits, x_next, w_next, tid, m0, w_src, w_k, k0, vectors_ok):
    """Load the K slice starting at k0 of this thread's share of x and w into registers."""
    num_tokens = x.shape[0]
    k_dim = x.shape[1]
    fast = vectors_ok != 0 and k0 + BLOCK_K <= k_dim
    for i in range(X_VECTORS):
        flat = tid + i * BLOCK_THREADS
        m = min(m0 + flat // 4, num_tokens - 1)
        k = k0 + (flat % 4) * 4
        if fast:
            x_next[i, 0], x_next[i, 1], x_next[i, 2], x_next[i, 3] = load_f32x4(x, (m, k))
        else:
            for j in range(4):
                x_next[i, j] = x[m, k + j] if k + j < k_dim else float32(0.0)
    k = k0 + w_k
    if fast:
        w0, w1, w2, w3 = load_u32x4(w_bits, (w_src, k))
        w_next[0], w_next[1] = bf16x2_to_f32(w0)
        w_next[2], w_next[3] = bf16x2_to_f32(w1)
        w_next[4], w_next[5] = bf16x2_to_f32(w2)
        w_next[6], w_next[7] = bf16x2_to_f32(w3)
    else:
        for j in range(8):
            w_next[j] = bf16_bits_to_f32(w_bits[w_src, k + j]) if k + j < k_dim else float32(0.0)


# The same kernel with registers capped so that two blocks fit on an SM (65536 / (256 x 128)); ptxas
# then spills ~40 bytes per thread to local memory. On an H200, uncapped (157 registers, one block
# per SM) vs capped: 26.7 vs 32.1 TFLOP/s at M=4096, N=8192, K=2048 (2048 blocks), but 13.3 vs 11.6
# at M=512, N=2048 (64 blocks, fewer than the SMs: occupancy cannot help, the spills still cost).
gemm_two_blocks_kernel = kernel(fastmath=True, max_registers=TWO_BLOCK_REGISTERS)(gemm_kernel.py_func)


def gemm(x, w, out, accumulate: bool = False) -> None:
    """out = x @ w.T (or out += x @ w.T), any shape.

    x (M, K) f32, w (N, K) bf16 device array (or its uint16 bits view), out (M, N) f32.
    """
    num_tokens, num_rows, k_dim = check_linear_args(x, w, out)
    w_bits = weight_bits(w)
    vectors_ok = 1 if k_dim % 8 == 0 and vector_aligned(x) and vector_aligned(w_bits) else 0
    grid = (-(-num_rows // BLOCK_N), -(-num_tokens // BLOCK_M))
    # More blocks than SMs: two blocks per SM pay for the spills. Fewer: keep every register.
    chosen = gemm_two_blocks_kernel if grid[0] * grid[1] > num_sms() else gemm_kernel
    launch(chosen, grid, BLOCK_THREADS, x, w_bits, out, 1 if accumulate else 0, vectors_ok)

