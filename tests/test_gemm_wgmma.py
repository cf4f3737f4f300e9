"""gemm_wgmma (Hopper wgmma product) and the wgmma.py intrinsics under it.

Reference: float64 NumPy on the bf16-rounded inputs, with test_gemv's tolerance (|out - ref| <=
1e-5 * (|x_bf16| @ |w|.T) (+ |out before|)), the output poisoned with NaN so an unwritten element
fails. The same tests run on an H200 with ``NUMBA_VLLM_TEST_GPU=1`` (the ``gpu`` ones only there).

The wgmma probe stages A (64 x 64) and B (16 x 64) in shared memory by the layout written out here
(128-byte rows, chunk c of row r at chunk c ^ (r % 8), from a 1024-byte boundary), runs four k-steps
of ``wgmma m64n16k16`` through ``smem_descriptor``, and writes each thread's 8 accumulators by the
documented fragment layout: on the simulator it checks the emulation against NumPy, on a GPU the
hardware against the same NumPy (the layout and descriptor encoding are the hardware's, not ours).

Simulator shapes are small (a 128-thread block per warpgroup; every wgmma is a 128-thread
rendezvous): M from 1, N and K not multiples of the tile, K past the pipeline depth, a K split, each
tiling once; ``slow`` marks the 256-thread tilings.
"""

import functools

import numpy as np
import pytest
from numba import cuda, float32, uint32
from test_gemv import check_product, launch_case

from numba_vllm.kernels import gemm_wgmma as gw
from numba_vllm.kernels import matmul
from numba_vllm.kernels.jit import kernel
from numba_vllm.kernels.wgmma import (
    ATOM_BYTES,
    DESC_K_STEP,
    fence_proxy_async,
    shared_address,
    smem_descriptor,
    wgmma_bf16,
    wgmma_commit,
    wgmma_fence,
    wgmma_wait,
)
from numba_vllm.loading.bf16 import BF16

PROBE_N = 16
PROBE_K = 64
_probe_mma = wgmma_bf16(PROBE_N)
_probe_fence = wgmma_fence(PROBE_N)
_probe_wait = wgmma_wait(PROBE_N, 0)


def run_gemm_wgmma(m, n, k, accumulate, seed=0, x_offset=0, launcher=gw.gemm_wgmma):
    """Launch on fresh random data, check against the bf16-rounded reference. x_offset > 0 misaligns x."""
    got, x, w, out0 = launch_case(m, n, k, accumulate, seed, x_offset, launcher)
    check_product(got, x.astype(BF16).astype(np.float32), w, out0, accumulate)


# ---- one wgmma, staged by hand ---------------------------------------------------------------------


@kernel
def _wgmma_probe_kernel(a_bits, b_bits, d):
    # a_bits (64, 64) uint16: A[m, k] bf16 bits; b_bits (16, 64) uint16: B[k, n] at [n, k]; d (64, 16) f32
    smem = cuda.shared.array(0, uint32)
    tid = cuda.threadIdx.x
    base = shared_address(smem, 0)
    pad = (ATOM_BYTES - (base & (ATOM_BYTES - 1))) & (ATOM_BYTES - 1)
    first = pad >> 2
    for i in range(tid, (64 + PROBE_N) * 8, 128):  # 16-byte chunk c of row r, rows of A then of B
        r = i // 8
        c = i % 8
        for j in range(4):
            k = 8 * c + 2 * j
            if r < 64:
                word = uint32(a_bits[r, k]) | (uint32(a_bits[r, k + 1]) << uint32(16))
            else:
                word = uint32(b_bits[r - 64, k]) | (uint32(b_bits[r - 64, k + 1]) << uint32(16))
            smem[first + r * 32 + (c ^ (r % 8)) * 4 + j] = word
    fence_proxy_async()
    cuda.syncthreads()
    acc = cuda.local.array(PROBE_N // 2, float32)
    for i in range(PROBE_N // 2):
        acc[i] = float32(0.0)
    desc_a = smem_descriptor(base + pad)
    desc_b = smem_descriptor(base + pad + 64 * 128)
    _probe_fence(acc)
    for kk in range(PROBE_K // 16):
        _probe_mma(acc, smem, desc_a + kk * DESC_K_STEP, desc_b + kk * DESC_K_STEP)
    wgmma_commit()
    _probe_wait(acc)
    row = 16 * (tid // 32) + ((tid % 32) >> 2)  # acc[4j + 2h + e] = D[row + 8h, 8j + 2q + e]
    col = 2 * (tid & 3)
    d[row, col] = acc[0]
    d[row, col + 1] = acc[1]
    d[row + 8, col] = acc[2]
    d[row + 8, col + 1] = acc[3]
    d[row, col + 8] = acc[4]
    d[row, col + 9] = acc[5]
    d[row + 8, col + 8] = acc[6]
    d[row + 8, col + 9] = acc[7]


def _run_probe(a, b):
    """D (64, 16) of the probe: A (64, 64) bf16 @ B (64, 16) bf16."""
    d = cuda.to_device(np.full((64, PROBE_N), np.nan, np.float32))
    a_bits = cuda.to_device(np.ascontiguousarray(a.view(np.uint16)))
    b_bits = cuda.to_device(np.ascontiguousarray(b.T).view(np.uint16))
    shared_bytes = (64 + PROBE_N) * 128 + ATOM_BYTES
    _wgmma_probe_kernel[1, 128, 0, shared_bytes](a_bits, b_bits, d)
    return d.copy_to_host()


def test_wgmma_is_exact_on_small_integers():
    """Small integers: exact in any order, so D must be A @ B exactly (layouts, descriptors, k-steps)."""
    rng = np.random.default_rng(1)
    a = rng.integers(-4, 5, (64, PROBE_K)).astype(BF16)
    b = rng.integers(-4, 5, (PROBE_K, PROBE_N)).astype(BF16)
    np.testing.assert_array_equal(_run_probe(a, b), a.astype(np.float64) @ b.astype(np.float64))


def test_wgmma_reads_every_element_where_the_layout_says():
    """A[m, k] = m (2m for odd k), B = identity: D[m, n] = A[m, n], so a misplaced row or column shows."""
    a = (np.arange(64, dtype=np.float32)[:, None] * (1 + np.arange(PROBE_K) % 2)[None, :]).astype(BF16)  # odd k: 2m
    b = np.eye(PROBE_K, PROBE_N, dtype=np.float32).astype(BF16)
    np.testing.assert_array_equal(_run_probe(a, b), a.astype(np.float32)[:, :PROBE_N])


# ---- the GEMM ------------------------------------------------------------------------------------

SIM_CASES = [  # (M, N, K, accumulate)
    (40, 72, 200, False),  # 4 K slices (more than the stages), the last partial; N not a multiple of 16
    (40, 72, 200, True),
    (1, 16, 8, True),  # one token, one 16-byte chunk of K
    (3, 130, 64, False),  # 2 column tiles, the second with 2 columns
]


@pytest.mark.parametrize("m,n,k,accumulate", SIM_CASES)
def test_gemm_wgmma_small_tiling(m, n, k, accumulate):
    run_gemm_wgmma(m, n, k, accumulate, seed=m + k, launcher=functools.partial(gw.gemm_wgmma, config=gw.SMALL))


@pytest.mark.slow
@pytest.mark.parametrize("config", [gw.LARGE, gw.MEDIUM], ids=["large", "medium"])
def test_gemm_wgmma_two_warpgroups(config):
    """130 rows: two row tiles, the second warpgroup of the first holding rows 64..127."""
    run_gemm_wgmma(130, 40, 136, True, launcher=functools.partial(gw.gemm_wgmma, config=config))


@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_wgmma_split_k_sums_its_parts(accumulate):
    """K = 264: five 64-wide slices, split 2 ways (3 + 2) and 3 ways (2 + 2 + 1)."""
    for split in (2, 3):
        launcher = functools.partial(gw.gemm_wgmma, config=gw.SMALL, split=split)
        run_gemm_wgmma(5, 24, 264, accumulate, seed=split, launcher=launcher)


def test_gemm_wgmma_converts_x_in_row_chunks(monkeypatch):
    """A workspace smaller than x: the product goes in chunks of rows (here 3 rows of K = 16)."""
    monkeypatch.setattr(gw, "X_WORKSPACE_VALUES", 3 * 16)
    run_gemm_wgmma(7, 9, 16, True, launcher=functools.partial(gw.gemm_wgmma, config=gw.SMALL))


def test_gemm_wgmma_misaligned_x():
    """x is read element by element when rounded to bf16: any alignment works."""
    run_gemm_wgmma(7, 9, 16, False, x_offset=1, launcher=functools.partial(gw.gemm_wgmma, config=gw.SMALL))


def test_k_not_a_multiple_of_8_goes_to_gemm_tc():
    """K = 20: no 16-byte copies of w rows; gemm_tc computes the product."""
    run_gemm_wgmma(9, 5, 20, True)


def test_linear_sends_prefill_to_gemm_wgmma_when_asked():
    launcher = functools.partial(matmul.linear, gemm="wgmma")
    run_gemm_wgmma(matmul.GEMV_MAX_TOKENS + 1, 33, 16, True, launcher=launcher)


@pytest.mark.parametrize(
    "m, n, sms, want",
    [(4096, 8192, 132, gw.LARGE), (512, 128256, 132, gw.LARGE), (2048, 2048, 132, gw.MEDIUM), (512, 2048, 132, gw.SMALL),
     (1, 1, 132, gw.SMALL), (128, 256, 1, gw.LARGE)],
)  # fmt: skip
def test_the_largest_tiling_that_fills_the_sms_is_picked(m, n, sms, want):
    assert gw.pick_tile_config(m, n, num_sms=sms) == want


@pytest.mark.parametrize(
    "config, blocks, k, want",
    [(gw.LARGE, 1024, 2048, 1), (gw.LARGE, 64, 2048, 2), (gw.SMALL, 32, 2048, 8), (gw.SMALL, 32, 256, 1),
     (gw.SMALL, 128, 8192, 2)],
)  # fmt: skip
def test_k_is_split_while_the_sms_have_room(config, blocks, k, want):
    assert gw.pick_k_split(config, blocks, k, num_sms=132) == want


def test_tilings_fit_in_shared_memory():
    for config in gw.TILE_CONFIGS:
        assert config.shared_bytes <= 227 * 1024
        assert config.block_m * (config.block_n + gw.OUT_PAD_WORDS) * 4 + ATOM_BYTES <= config.shared_bytes


# ---- GPU -----------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_wgmma_gpu_random_values():
    rng = np.random.default_rng(5)
    a = rng.standard_normal((64, PROBE_K)).astype(BF16)
    b = rng.standard_normal((PROBE_K, PROBE_N)).astype(BF16)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    assert np.all(np.abs(_run_probe(a, b) - a64 @ b64) <= 1e-5 * (np.abs(a64) @ np.abs(b64)))


@pytest.mark.gpu
@pytest.mark.parametrize("config", gw.TILE_CONFIGS, ids=["large", "medium", "small"])
@pytest.mark.parametrize("m,n,k,accumulate", [(256, 2048, 8192, True), (77, 3072, 2048, False), (333, 1003, 1000, True)])
def test_gemm_wgmma_gpu_each_tiling(m, n, k, accumulate, config):
    run_gemm_wgmma(m, n, k, accumulate, seed=m, launcher=functools.partial(gw.gemm_wgmma, config=config))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(64, 2048, 2048), (128, 8192, 2048), (512, 2048, 8192), (300, 128256, 2048)])
def test_gemm_wgmma_gpu_decode_shapes(m, n, k):
    run_gemm_wgmma(m, n, k, True, seed=n)


@pytest.mark.gpu
def test_gemm_wgmma_gpu_misaligned_x():
    run_gemm_wgmma(200, 2048, 2048, True, x_offset=3)
