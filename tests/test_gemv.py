"""gemv (decode-sized x @ w.T), the ``linear`` dispatcher, and the 16-byte load helpers under them.

Reference and tolerance: tests/helpers/products.py (float64 NumPy on the same bf16-rounded inputs,
1e-5 of the sum of the products' magnitudes per element).

Simulator cases are small and awkward: M in {1, 2, 3, 5, 17} (every token tile, and several token
blocks), N not a multiple of the rows per block, K = 40/72 (fast path: K % 8 == 0 but not a multiple
of the 256 elements a warp covers) and K = 48 via a misaligned view, K = 100 (K % 8 != 0: the
unaligned kernel). ``gpu`` tests run Llama 3.2 1B shapes with fresh random inputs.
"""

import functools

import ml_dtypes
import numpy as np
import pytest
from numba import cuda, float32

from numba_vllm.kernels._launch import KernelError
from numba_vllm.kernels.gemv import gemv, plan_gemv
from numba_vllm.kernels.jit import kernel
from numba_vllm.kernels.matmul import linear
from numba_vllm.kernels.vector_load import (
    SHARED_ALIGN,
    bf16_bits_to_f32,
    bf16x2_to_f32,
    load_f32x2,
    load_f32x4,
    load_shared_f32x4,
    load_u32x4,
    store_f32x2,
)
from numba_vllm.loading.bf16 import BF16, upload_bf16
from tests.helpers.products import run_product

pytestmark = pytest.mark.gpu_too  # `make test-gpu` runs these on the GPU as well

# (M, N, K, accumulate): N = 33, 70 are not multiples of 32 or 16 rows per block.
SIM_CASES = [
    (1, 33, 72, False),  # batch 1, 1 token a block; 9 chunks: lanes 9..31 idle
    (1, 70, 40, True),
    (2, 33, 40, True),  # 2 tokens a block
    (3, 70, 72, False),  # 4 tokens a block, token 3 clamped
    pytest.param(17, 33, 40, True, marks=pytest.mark.slow),  # 4 tokens a block, 5 token blocks, the last with 1 token
    (3, 33, 100, True),  # K % 8 != 0: unaligned kernel
    (5, 70, 100, False),
]


@pytest.mark.parametrize("m,n,k,accumulate", SIM_CASES)
def test_gemv_small(m, n, k, accumulate):
    run_product(m, n, k, accumulate)


def test_gemv_misaligned_x_uses_unaligned_kernel():
    run_product(2, 33, 48, True, x_offset=1)


def test_gemv_splits_k_across_warps():
    """A long row with few rows: the launcher splits K over warps; the cross-warp sum is tested."""
    assert plan_gemv(1, 5, 512)[1] == 2
    run_product(1, 5, 512, False)


def test_linear_dispatches_both_ways():
    run_product(2, 33, 40, False, launcher=linear)  # gemv
    # the fp32 gemm: the tensor-core path rounds x (tests/test_gemm_tc.py)
    run_product(65, 33, 40, True, launcher=functools.partial(linear, gemm="fp32"))


def fused_reference(x, w, g, eps, silu_mul):
    """float64 rms_norm(x) * g @ w.T, then silu(gate) * up over its two halves when `silu_mul`."""
    x64 = x.astype(np.float64)
    normed = x64 / np.sqrt((x64**2).mean(axis=1, keepdims=True) + eps) * g.astype(np.float64)
    product = normed @ w.astype(np.float64).T
    if not silu_mul:
        return product, np.abs(normed) @ np.abs(w.astype(np.float64)).T
    gate, up = np.split(product, 2, axis=1)
    return gate / (1 + np.exp(-gate)) * up, np.abs(product).max() * np.ones_like(gate)


# (M, N, K, silu_mul): N = 10 has 5 output columns of SwiGLU, the last group's second one clamped;
# K = 512 with few rows splits K over warps (the sums of x^2 cross warps too); M = 5, 17: token blocks
FUSED_CASES = [(1, 36, 48, False), (3, 20, 72, True), (5, 10, 40, True), (1, 6, 512, True), (17, 12, 40, False)]


@pytest.mark.parametrize("m,n,k,silu_mul", FUSED_CASES)
def test_fused_norm_and_silu_match_numpy(m, n, k, silu_mul):
    """gemv with the RMSNorm applied on load (and SwiGLU on store); `linear` above the gemv token
    limit runs rms_norm, the product and silu_and_mul as separate kernels and must agree."""
    rng = np.random.default_rng(m * n + k)
    x = (rng.standard_normal((m, k)) * 3).astype(np.float32)
    w = (rng.standard_normal((n, k)) * 0.1).astype(BF16)
    g = (1 + 0.3 * rng.standard_normal(k)).astype(BF16)
    eps = 1e-5
    want, scale = fused_reference(x, w, g, eps, silu_mul)
    out = cuda.to_device(np.full(want.shape, np.nan, np.float32))
    normed = cuda.to_device(np.zeros((m, k), np.float32))
    gate_up = cuda.to_device(np.zeros((m, n), np.float32))
    linear(  # above the gemv limit: the fp32 gemm (the tensor-core path rounds x to bf16)
        cuda.to_device(x), upload_bf16(w), out, norm=(upload_bf16(g), eps), silu_mul=silu_mul, normed=normed, gate_up=gate_up,
        gemm="fp32",
    )
    got = out.copy_to_host()
    assert not np.isnan(got).any()
    assert np.all(np.abs(got - want) <= 1e-4 * scale + 1e-6), np.abs(got - want).max()


def test_fused_variants_need_the_fast_path():
    x = cuda.to_device(np.zeros((2, 100), np.float32))  # K % 8 != 0: the unaligned kernel, which fuses nothing
    w = upload_bf16(np.zeros((8, 100), np.float32))
    with pytest.raises(KernelError, match="norm and silu_mul need"):
        gemv(x, w, cuda.to_device(np.zeros((2, 8), np.float32)), norm=(upload_bf16(np.ones(100, np.float32)), 1e-5))
    with pytest.raises(KernelError, match="even number of rows"):
        gemv(x, upload_bf16(np.zeros((7, 100), np.float32)), cuda.to_device(np.zeros((2, 3), np.float32)), silu_mul=True)


def test_gemv_rejects_bad_arguments():
    x = cuda.to_device(np.zeros((2, 16), np.float32))
    w = upload_bf16(np.zeros((8, 16), np.float32))
    with pytest.raises(KernelError, match="out: shape"):
        gemv(x, w, cuda.to_device(np.zeros((2, 9), np.float32)))
    with pytest.raises(KernelError, match="w: dtype"):
        gemv(x, cuda.to_device(np.zeros((8, 16), np.float32)), cuda.to_device(np.zeros((2, 8), np.float32)))
    with pytest.raises(KernelError, match="tokens"):
        gemv(cuda.to_device(np.zeros((65, 16), np.float32)), w, cuda.to_device(np.zeros((65, 8), np.float32)))


def test_plan_gemv_splits_k_only_while_warps_are_few():
    assert plan_gemv(1, 128256, 2048)[1] == 1  # the vocabulary head has warps to spare
    assert plan_gemv(1, 2048, 8192)[1] == 8  # down_proj: 512 row groups
    assert plan_gemv(8, 8192, 2048)[1] == 1  # 4 tokens a block: one warp per group
    tokens, _, grid = plan_gemv(17, 33, 72)
    assert (tokens, grid) == (4, (5, 2))


# ---- vector_load ---------------------------------------------------------------------------------


@kernel
def vector_load_kernel(words16, words32, xf, out_u32, out_f32):
    # words16 (2, 16) uint16; words32 (8,) uint32; xf (2, 8) f32
    # out_u32 (3, 4) uint32; out_f32 (5, 8) f32
    shared = cuda.shared.array(8, float32, SHARED_ALIGN)
    if cuda.threadIdx.x == 0:
        for j in range(8):
            shared[j] = xf[1, j]
    cuda.syncthreads()  # wait for shared to be filled
    if cuda.threadIdx.x != 0:
        return
    a = load_u32x4(words16, (1, 8))  # elements 8..15 of row 1
    b = load_u32x4(words32, 4)
    for j in range(4):
        out_u32[0, j] = a[j]
        out_u32[1, j] = b[j]
    c = load_f32x4(xf, (0, 4))
    d = load_shared_f32x4(shared, 4)
    for j in range(4):
        out_f32[0, j] = c[j]
        out_f32[1, j] = d[j]
    for j in range(4):
        lo, hi = bf16x2_to_f32(a[j])
        out_f32[2, 2 * j] = lo
        out_f32[2, 2 * j + 1] = hi
    for j in range(8):
        out_f32[3, j] = bf16_bits_to_f32(words16[0, j])
    e0, e1 = load_f32x2(xf, (1, 2))
    store_f32x2(out_f32, (4, 6), e0 + float32(1.0), e1 + float32(1.0))


def test_vector_load_helpers():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2, 16)).astype(ml_dtypes.bfloat16)
    bits = w.view(np.uint16)
    words = rng.integers(0, 2**32, 8, dtype=np.uint32)
    xf = rng.standard_normal((2, 8)).astype(np.float32)
    out_u32 = cuda.to_device(np.zeros((3, 4), np.uint32))
    out_f32 = cuda.to_device(np.full((5, 8), np.nan, np.float32))
    vector_load_kernel[1, 32](cuda.to_device(bits), cuda.to_device(words), cuda.to_device(xf), out_u32, out_f32)
    got_u32, got_f32 = out_u32.copy_to_host(), out_f32.copy_to_host()
    np.testing.assert_array_equal(got_u32[0], bits[1, 8:].view(np.uint32))  # little-endian pairs
    np.testing.assert_array_equal(got_u32[1], words[4:])
    np.testing.assert_array_equal(got_f32[0, :4], xf[0, 4:])
    np.testing.assert_array_equal(got_f32[1, :4], xf[1, 4:])
    np.testing.assert_array_equal(got_f32[2], w[1, 8:].astype(np.float32))  # exact conversion
    np.testing.assert_array_equal(got_f32[3], w[0, :8].astype(np.float32))
    np.testing.assert_array_equal(got_f32[4, 6:], xf[1, 2:4] + np.float32(1.0))  # an 8-byte pair, read and written
    assert np.isnan(got_f32[4, :6]).all()  # nothing else


# ---- GPU: Llama 3.2 1B shapes --------------------------------------------------------------------

GPU_CASES = [
    (1, 2048, 2048, False),  # q_proj / o_proj
    (1, 8192, 2048, False),  # gate / up
    (1, 2048, 8192, True),  # down_proj + residual
    (1, 128256, 2048, False),  # vocabulary head
    (8, 512, 2048, False),  # k/v_proj
    (8, 2048, 8192, True),
    (32, 8192, 2048, False),
    (64, 2048, 2048, True),
    (3, 1000, 200, True),  # K % 8 == 0 but short rows
    (5, 1000, 2050, False),  # K % 8 != 0: unaligned kernel at size
]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,accumulate", GPU_CASES)
def test_gemv_gpu(m, n, k, accumulate):
    run_product(m, n, k, accumulate, seed=m * 7 + k)


@pytest.mark.gpu
def test_gemv_gpu_misaligned_x():
    run_product(4, 2048, 2048, True, x_offset=2)


@pytest.mark.gpu
def test_vector_load_helpers_gpu():
    test_vector_load_helpers()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m,n,k,silu_mul", [(1, 3072, 2048, False), (1, 16384, 2048, True), (8, 16384, 2048, True), (3, 128256, 2048, False)]
)
def test_fused_norm_and_silu_gpu(m, n, k, silu_mul):
    """Llama 3.2 1B's fused products: qkv with attn_norm, gate_up with mlp_norm and SwiGLU, the head."""
    test_fused_norm_and_silu_match_numpy(m, n, k, silu_mul)
