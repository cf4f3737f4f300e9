"""SwiGLU's elementwise part: out = silu(gate) * up, with gate and up side by side in one array.

    gate_up (T, 2F) float32: columns [0, F) are the gate projection, [F, 2F) the up projection
    out     (T, F)  float32: out[t, j] = silu(gate_up[t, j]) * gate_up[t, F + j],
                             silu(g) = g / (1 + exp(-g))

The fused (T, 2F) layout is the one the model uses: gate_proj and up_proj are stacked into one
(2F, D) weight and run as a single matmul, which reads the activations once and launches once.
Separate gate and up arrays are not supported; a caller that has them can stack the weights.

Thread mapping: a 2-D grid. ``blockIdx.y`` picks rows ``y, y + gridDim.y, ...``. Along a row, a
block covers tiles of ``ACTIVATION_THREADS * ACTIVATION_COLS_PER_THREAD`` (1024) columns: thread
``x`` takes columns ``tile + x + c * ACTIVATION_THREADS`` for ``c < ACTIVATION_COLS_PER_THREAD``, so
each warp instruction still reads or writes 32 neighbouring floats (coalesced). The thread first
loads all 4 gate and 4 up values into registers, then computes and stores: 8 loads in flight per
thread. With one element per thread, each thread would wait out a full memory latency for 8 bytes,
and an SM (2048 threads) would keep ~16 KB in flight where ~32 KB are needed to stream at the
H200's bandwidth. Rows and columns come from the grid, not from dividing a flat index by F (64-bit
integer division costs ~100 instructions). The launcher sizes the grid to cover the array in one
pass (``ceil(F / 1024)`` x T blocks) up to the caps ``ACTIVATION_MAX_COL_BLOCKS`` and
``ACTIVATION_MAX_ROW_BLOCKS`` (65535 is the hardware limit of gridDim.y); past them the loops
stride. Shared memory: none. The two (4,) per-thread arrays live in registers: their loops have a
constant trip count, so the compiler unrolls them and every index is a constant.

bf16 copy: ``silu_and_mul_bf16_kernel`` also stores each value rounded to bf16 (nearest even) in a
(T, F) uint16 array: the x workspace of ``gemm_wgmma`` when the down product after SwiGLU runs that
GEMM (``matmul.linear``), which then copies the rows as they are instead of converting ``out`` in a
pass of its own. The float32 ``out`` is still written (the model's trace, and a down product that
runs another kernel, read it). When nothing but the down product reads ``out``, ``linear`` skips
these kernels altogether on Hopper: the gate/up product applies ``swiglu`` in its epilogue
(``gemm_wgmma.gemm_wgmma_silu_mul``).

Numerics: precise ``expf``, then the reciprocal of 1 + exp(-g) by the hardware's ``rcp.approx`` (1
ulp) instead of an IEEE division: a few ulp of f32 in all, far below the bf16 rounding the model
applies next. Not for speed here (the kernel is memory-bound) but for the gate/up product's
epilogue, which applies the same ``swiglu`` to 64 pairs of registers a thread: an IEEE division's
code is large enough that the compiler no longer unrolls that loop, and the accumulators would go
to local memory. For g < -88, exp(-g) overflows to inf, its reciprocal is 0, and silu(g) = -0, the
correct limit.
"""

import math

from numba import cuda, float32

from numba_vllm.kernels._launch import KernelError, check_array, launch
from numba_vllm.kernels.approx_math import rcp_approx
from numba_vllm.kernels.jit import device_function, kernel
from numba_vllm.kernels.mma import f32_to_bf16_bits

ACTIVATION_THREADS = 256  # threads per block, all along one row
ACTIVATION_COLS_PER_THREAD = 4  # columns a thread loads before computing (a compile-time constant)
ACTIVATION_MAX_COL_BLOCKS = 256  # blocks along a row: F up to 262144 in one pass; wider rows loop
ACTIVATION_MAX_ROW_BLOCKS = 65535  # blocks across rows (gridDim.y limit); more rows loop


@device_function
def swiglu(gate, up):
    """SwiGLU of one element in f32: silu(gate) * up = gate * (1 / (1 + exp(-gate))) * up, the
    reciprocal approximate (1 ulp; module docstring). These kernels' and the gate/up product's
    epilogue in ``gemm_wgmma``: the same formula, so the same bits."""
    return gate * rcp_approx(float32(1.0) + math.exp(-gate)) * up


@device_function
def _silu_and_mul_rows(gate_up, out, out_bits, bf16_copy):
    """The kernels' body: out[t, j] = silu(gate_up[t, j]) * gate_up[t, F + j] over this block's rows and
    column tiles, and with ``bf16_copy`` the same values rounded to bf16 into out_bits[t, j].

    gate_up (T, 2F) float32; out (T, F) float32; out_bits (T, F) uint16 (read only with ``bf16_copy``).
    """
    gate = cuda.local.array(ACTIVATION_COLS_PER_THREAD, float32)  # (4,) this thread's gate values
    up = cuda.local.array(ACTIVATION_COLS_PER_THREAD, float32)  # (4,) and up values
    num_rows, num_cols = out.shape
    tile_width = cuda.blockDim.x * ACTIVATION_COLS_PER_THREAD
    for t in range(cuda.blockIdx.y, num_rows, cuda.gridDim.y):
        for tile in range(cuda.blockIdx.x * tile_width, num_cols, cuda.gridDim.x * tile_width):
            first = tile + cuda.threadIdx.x
            for c in range(ACTIVATION_COLS_PER_THREAD):  # every load first: they overlap in flight
                j = first + c * cuda.blockDim.x
                if j < num_cols:
                    gate[c] = gate_up[t, j]
                    up[c] = gate_up[t, num_cols + j]
            for c in range(ACTIVATION_COLS_PER_THREAD):
                j = first + c * cuda.blockDim.x
                if j < num_cols:
                    value = swiglu(gate[c], up[c])
                    out[t, j] = value
                    if bf16_copy:
                        out_bits[t, j] = f32_to_bf16_bits(value)


@kernel
def silu_and_mul_kernel(gate_up, out):
    """out[t, j] = silu(gate_up[t, j]) * gate_up[t, F + j]. 2-D grid: (column blocks, row blocks).

    gate_up (T, 2F) float32; out (T, F) float32.
    """
    _silu_and_mul_rows(gate_up, out, out, False)  # (no bf16 copy: out stands in for its unused array)


@kernel
def silu_and_mul_bf16_kernel(gate_up, out, out_bits):
    """``silu_and_mul_kernel``, also storing each value rounded to bf16 (nearest even) in out_bits.

    gate_up (T, 2F) float32; out (T, F) float32; out_bits (T, F) uint16.
    """
    _silu_and_mul_rows(gate_up, out, out_bits, True)


def silu_and_mul(gate_up, out, out_bits=None) -> None:
    """out = silu(gate) * up for gate_up = [gate | up] (device arrays).

    gate_up: (T, 2F) float32, gate in columns [0, F), up in [F, 2F); out: (T, F) float32, overwritten.
    out_bits: None, or (T, F) uint16, overwritten with out's values as bf16 bits, rounded to nearest
    even as ``gemm_wgmma`` rounds x (``matmul.linear`` hands it that GEMM's x workspace, so the down
    product after SwiGLU needs no conversion pass of its own).
    """
    check_array("gate_up", gate_up, dtype="float32", ndim=2)
    num_rows, width = gate_up.shape
    if width % 2:
        raise KernelError(f"gate_up: shape {tuple(gate_up.shape)} has an odd width, expected (T, 2F)")
    check_array("out", out, dtype="float32", shape=(num_rows, width // 2))
    if out_bits is not None:
        check_array("out_bits", out_bits, dtype="uint16", shape=(num_rows, width // 2))
    num_cols = width // 2
    if num_rows == 0 or num_cols == 0:
        return
    tile_width = ACTIVATION_THREADS * ACTIVATION_COLS_PER_THREAD
    grid = (min(ACTIVATION_MAX_COL_BLOCKS, -(-num_cols // tile_width)), min(ACTIVATION_MAX_ROW_BLOCKS, num_rows))
    if out_bits is None:
        launch(silu_and_mul_kernel, grid, ACTIVATION_THREADS, gate_up, out)
    else:
        launch(silu_and_mul_bf16_kernel, grid, ACTIVATION_THREADS, gate_up, out, out_bits)
