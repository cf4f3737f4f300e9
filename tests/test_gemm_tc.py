"""gemm_tc (tensor-core prefill product) and the mma.py intrinsics under it.

The reference for gemm_tc is float64 NumPy on the bf16-rounded inputs: x rounded to bf16 (nearest
even, as the kernel stages it) and w (already bf16). What is left is the fp32 accumulation, so the
tolerance is tests/helpers/products.py's: |out - ref| <= 1e-5 * (|x_bf16| @ |w|.T) (+ |out before| when
accumulating) per element, ~100 float32 ulps of the sum of the products' magnitudes. (Tensor cores
may truncate addends as they align them, up to ~1 ulp of the largest addend per mma step; on random
data the error stays far below the bound.) The output is poisoned with NaN before the launch, so an
unwritten element fails.

Simulator cases (one 256-thread block of the real 128 x 256 tile costs ~1 s: every ``ldmatrix``
and ``mma`` is a warp rendezvous): M = 40, N = 72, K = 48 (one 16-byte slice, then a half slice
loaded element by element with zeros past K), K = 20 (K % 8 != 0: element by element), 2 x 2 blocks
(M = 129, N = 258), a misaligned x, and ``linear`` routing a prefill to gemm_tc. The intrinsics are
checked directly with one warp: ``mma_bf16_16816`` against NumPy (exactly on small integers, to
fp32 rounding on random values), ``ldmatrix_x4`` against the fragment layout, ``pack_bf16x2``
against integer round to nearest even. ``gpu`` tests run Llama 3.2 1B prefill shapes and ragged
M, N, K with fresh random inputs.
"""

import functools

import numpy as np
import pytest
from numba import cuda, uint32

from numba_vllm.kernels import matmul
from numba_vllm.kernels.gemm_tc import LARGE, SMALL, TILE_CONFIGS, gemm_tc, pick_k_split, pick_tile_config
from numba_vllm.kernels.jit import device_function, kernel
from numba_vllm.kernels.mma import ldmatrix_x4, mma_bf16_16816, pack_bf16x2
from numba_vllm.kernels.vector_load import SHARED_ALIGN
from numba_vllm.loading.bf16 import BF16
from tests.helpers.products import PREFILL_GPU_CASES, check_product, launch_case

pytestmark = pytest.mark.gpu_too  # `make test-gpu` runs these on the GPU as well

# One mma of random values against float64: 16 products + C, each addend may lose up to ~1 ulp
# (2^-23) of the largest one on a tensor core: 17 * 2^-23 ~ 2e-6 of the sum of magnitudes.
MMA_RTOL = 4e-6


def run_gemm_tc(m, n, k, accumulate, seed=0, x_offset=0, launcher=gemm_tc):
    """Launch on fresh random data, check against the bf16-rounded reference. x_offset > 0 misaligns x."""
    got, x, w, out0 = launch_case(m, n, k, accumulate, seed, x_offset, launcher)
    check_product(got, x.astype(BF16).astype(np.float32), w, out0, accumulate)


# ---- the intrinsics, one warp --------------------------------------------------------------------


@device_function
def _pair(bits, row, col):
    """bits[row, col] in the low half and bits[row, col + 1] in the high half of a uint32."""
    return uint32(bits[row, col]) | (uint32(bits[row, col + 1]) << uint32(16))


@kernel
def _mma_probe_kernel(a_bits, bt_bits, c, d):
    # a_bits (16, 16) uint16: A[m, k] as bf16 bits; bt_bits (8, 16) uint16: B.T, i.e. B[k, n] at [n, k]
    # c, d (16, 8) f32. One warp: every lane builds its fragments by the PTX layout, written out here.
    lane = cuda.threadIdx.x
    g = lane >> 2
    t = lane & 3
    d0, d1, d2, d3 = mma_bf16_16816(
        _pair(a_bits, g, 2 * t),
        _pair(a_bits, g + 8, 2 * t),
        _pair(a_bits, g, 2 * t + 8),
        _pair(a_bits, g + 8, 2 * t + 8),
        _pair(bt_bits, g, 2 * t),
        _pair(bt_bits, g, 2 * t + 8),
        c[g, 2 * t],
        c[g, 2 * t + 1],
        c[g + 8, 2 * t],
        c[g + 8, 2 * t + 1],
    )
    d[g, 2 * t] = d0
    d[g, 2 * t + 1] = d1
    d[g + 8, 2 * t] = d2
    d[g + 8, 2 * t + 1] = d3


def _run_mma_probe(a, b, c):
    """D (16, 8) from one warp's mma of A (16, 16) bf16, B (16, 8) bf16, C (16, 8) f32."""
    d = cuda.to_device(np.full((16, 8), np.nan, np.float32))
    a_bits = cuda.to_device(np.ascontiguousarray(a.view(np.uint16)))
    bt_bits = cuda.to_device(np.ascontiguousarray(b.T).view(np.uint16))
    _mma_probe_kernel[1, 32](a_bits, bt_bits, cuda.to_device(c), d)
    return d.copy_to_host()


def test_mma_is_exact_on_small_integers():
    """Small integers: every product and partial sum is exact in fp32, so any order gives A @ B + C."""
    rng = np.random.default_rng(1)
    a = rng.integers(-8, 9, (16, 16)).astype(BF16)
    b = rng.integers(-8, 9, (16, 8)).astype(BF16)
    c = rng.integers(-100, 101, (16, 8)).astype(np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    np.testing.assert_array_equal(_run_mma_probe(a, b, c), want)


def test_mma_matches_numpy_on_random_values():
    """Random values: within fp32 rounding of the float64 product (bf16 products are exact in fp32)."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal((16, 16)).astype(BF16)
    b = rng.standard_normal((16, 8)).astype(BF16)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    want = a64 @ b64 + c
    scale = np.abs(a64) @ np.abs(b64) + np.abs(c)
    got = _run_mma_probe(a, b, c)
    assert np.all(np.abs(got - want) <= MMA_RTOL * scale), np.max(np.abs(got - want) / scale)


@kernel
def _ldmatrix_probe_kernel(src, regs):
    # src (16, 8) uint32: a 16 x 16 bf16 block, two k per word; regs (32, 4) uint32: what each lane got
    tile = cuda.shared.array((16, 8), uint32, SHARED_ALIGN)
    lane = cuda.threadIdx.x
    for i in range(4):
        tile[lane // 2, (lane % 2) * 4 + i] = src[lane // 2, (lane % 2) * 4 + i]
    cuda.syncthreads()  # the tile is in shared memory
    # A-operand addressing: lane points at row lane & 15, k offset 8 * (lane >> 4) (4 words)
    r0, r1, r2, r3 = ldmatrix_x4(tile, (lane & 15, (lane >> 4) * 4))
    regs[lane, 0] = r0
    regs[lane, 1] = r1
    regs[lane, 2] = r2
    regs[lane, 3] = r3


def test_ldmatrix_gives_the_a_fragment_layout():
    src = np.arange(16 * 8, dtype=np.uint32).reshape(16, 8) * np.uint32(0x10001)  # distinct words
    regs = cuda.to_device(np.zeros((32, 4), np.uint32))
    _ldmatrix_probe_kernel[1, 32](cuda.to_device(src), regs)
    got = regs.copy_to_host()
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    want = np.stack([src[g, t], src[g + 8, t], src[g, t + 4], src[g + 8, t + 4]], axis=1)  # a0..a3
    np.testing.assert_array_equal(got, want)


@kernel
def _pack_kernel(values, packed):
    # values (n, 2) f32 -> packed (n,) uint32
    i = cuda.grid(1)
    if i < packed.shape[0]:
        packed[i] = pack_bf16x2(values[i, 0], values[i, 1])


def test_pack_bf16x2_rounds_to_nearest_even():
    ties = [1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), 3.5 * 2.0**-133]  # halfway cases, the last a bf16 subnormal
    rng = np.random.default_rng(3)
    values = np.concatenate([np.array(ties * 2, np.float32), rng.standard_normal(56).astype(np.float32) * 1e3])
    values = values.reshape(-1, 2)
    packed = cuda.to_device(np.zeros(len(values), np.uint32))
    _pack_kernel[1, 32](cuda.to_device(values), packed)
    bits = values.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint32)  # round to nearest even
    np.testing.assert_array_equal(packed.copy_to_host(), rounded[:, 0] | rounded[:, 1] << 16)


# ---- the GEMM ------------------------------------------------------------------------------------

SIM_CASES = [
    (40, 72, 48, False),  # one block; K: a 16-byte slice, then half a slice with zeros past K
    (40, 72, 48, True),
    (9, 5, 20, True),  # K % 8 != 0: every slice element by element
    pytest.param(129, 258, 8, False, marks=pytest.mark.slow),  # 2 x 2 blocks, the second of each: a row / two columns
]


@pytest.mark.parametrize("config", TILE_CONFIGS, ids=["large", "small"])
@pytest.mark.parametrize("m,n,k,accumulate", SIM_CASES)
def test_gemm_tc_small(m, n, k, accumulate, config):
    run_gemm_tc(m, n, k, accumulate, launcher=functools.partial(gemm_tc, config=config))


@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_tc_split_k_sums_its_parts(accumulate):
    """K = 80: three 32-wide slices, split 2 ways (2 + 1 slices) and 3 ways, the parts summed by a second kernel."""
    for split in (2, 3):
        run_gemm_tc(20, 24, 80, accumulate, seed=split, launcher=functools.partial(gemm_tc, config=SMALL, split=split))


@pytest.mark.parametrize(
    "blocks, k, want", [(1024, 2048, 1), (128, 8192, 4), (128, 2048, 4), (16, 2048, 8), (16, 512, 2), (128, 64, 1)]
)
def test_k_is_split_until_the_gpu_has_four_blocks_per_sm(blocks, k, want):
    assert pick_k_split(blocks, k, num_sms=132) == want


@pytest.mark.parametrize(
    "m, n, sms, want",
    [(4096, 8192, 132, LARGE), (512, 128256, 132, LARGE), (256, 2048, 132, SMALL), (8, 8192, 132, SMALL), (1, 1, 132, SMALL),
     (100, 128256, 132, SMALL), (82, 192, 1, SMALL), (128, 256, 1, LARGE)],
)  # fmt: skip
def test_the_largest_tiling_that_fits_and_fills_the_sms_is_picked(m, n, sms, want):
    assert pick_tile_config(m, n, num_sms=sms) == want


def test_gemm_tc_misaligned_x():
    run_gemm_tc(7, 9, 16, True, x_offset=1)


def test_linear_sends_prefill_to_gemm_tc():
    run_gemm_tc(matmul.GEMV_MAX_TOKENS + 1, 33, 16, True, launcher=matmul.linear)


GPU_CASES = PREFILL_GPU_CASES + [(333, 1003, 1000, True)]  # the fp32 gemm's shapes, and ragged M, N and K (K % 32 != 0)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,accumulate", GPU_CASES)
def test_gemm_tc_gpu(m, n, k, accumulate):
    run_gemm_tc(m, n, k, accumulate, seed=m + k)


@pytest.mark.gpu
@pytest.mark.parametrize("config", TILE_CONFIGS, ids=["large", "small"])
@pytest.mark.parametrize("m,n,k,accumulate", [(256, 2048, 8192, True), (77, 3072, 2048, False)])
def test_gemm_tc_gpu_each_tiling(m, n, k, accumulate, config):
    run_gemm_tc(m, n, k, accumulate, seed=m, launcher=functools.partial(gemm_tc, config=config))


@pytest.mark.gpu
def test_gemm_tc_gpu_misaligned_x():
    run_gemm_tc(200, 2048, 2048, True, x_offset=3)


@pytest.mark.gpu
def test_mma_gpu_random_values_many_seeds():
    for seed in range(10, 20):
        rng = np.random.default_rng(seed)
        a = rng.standard_normal((16, 16)).astype(BF16)
        b = rng.standard_normal((16, 8)).astype(BF16)
        c = rng.standard_normal((16, 8)).astype(np.float32)
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        got = _run_mma_probe(a, b, c)
        assert np.all(np.abs(got - (a64 @ b64 + c)) <= MMA_RTOL * (np.abs(a64) @ np.abs(b64) + np.abs(c)))
