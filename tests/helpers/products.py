"""Random matrix products (out = x @ w.T, x float32, w bf16) launched and checked against NumPy.

Reference: float64 NumPy on the same inputs (the bf16-rounded weights), so the only error left is
the kernel's float32 accumulation. Tolerance, per element: |out - ref| <= RTOL * (|x| @ |w|.T)
(+ |out before| when accumulating), i.e. relative to the sum of the magnitudes of the products,
which bounds the rounding error of any summation order; RTOL = 1e-5 is ~100 float32 ulps. The output
is poisoned with NaN before the launch (unless accumulating), so an unwritten element fails.
Used by the gemv, gemm and gemm_tc tests.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from numba_vllm.kernels.gemv import gemv
from numba_vllm.loading.bf16 import BF16, upload_bf16

RTOL = 1e-5

# (M, N, K, accumulate): Llama 3.2 1B prefill shapes, for the gemm and gemm_tc tests on a GPU
PREFILL_GPU_CASES = [
    (512, 2048, 2048, False),  # q_proj / o_proj
    (512, 2048, 2048, True),  # o_proj + residual
    (300, 8192, 2048, False),  # gate / up, M not a multiple of 128
    (257, 2048, 8192, True),  # down_proj + residual
    (4096, 8192, 2048, False),  # the benchmark shape
    (100, 1000, 2050, False),  # K % 8 != 0 at size
    (65, 128256, 2048, False),  # vocabulary head over many tokens
]


def random_case(rng, m, n, k, accumulate):
    """Host inputs: x (m, k) f32, w (n, k) bf16, out0 (m, n) f32 (NaN unless accumulating)."""
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) * 0.05).astype(BF16)
    out0 = rng.standard_normal((m, n)).astype(np.float32) if accumulate else np.full((m, n), np.nan, np.float32)
    return x, w, out0


def check_product(got, x, w, out0, accumulate):
    """Compare a kernel's out with float64 NumPy on the same (bf16-rounded) inputs."""
    x64, w64 = x.astype(np.float64), w.astype(np.float32).astype(np.float64)
    ref = x64 @ w64.T
    scale = np.abs(x64) @ np.abs(w64).T
    if accumulate:
        ref += out0
        scale += np.abs(out0)
    assert not np.isnan(got).any(), f"{np.isnan(got).sum()} outputs unwritten (NaN)"
    err = np.abs(got - ref)
    worst = np.unravel_index(np.argmax(err / (scale + 1e-30)), err.shape)
    assert np.all(err <= RTOL * scale + 1e-30), f"at {worst}: got {got[worst]}, want {ref[worst]}"


def launch_case(m, n, k, accumulate, seed, x_offset, launcher):
    """Run `launcher(x, w, out, accumulate)` on fresh random data; returns (out, x, w, out0) on the host.
    x_offset > 0 views x at a misaligned address."""
    rng = np.random.default_rng(seed)
    x, w, out0 = random_case(rng, m, n, k, accumulate)
    if x_offset:
        x_big = np.zeros(m * k + x_offset, np.float32)
        x_big[x_offset:] = x.ravel()
        d_x = cuda.to_device(x_big)[x_offset:].reshape(m, k)
    else:
        d_x = cuda.to_device(x)
    d_out = cuda.to_device(out0)
    launcher(d_x, upload_bf16(w), d_out, accumulate)
    return d_out.copy_to_host(), x, w, out0


def run_product(m, n, k, accumulate, seed=0, x_offset=0, launcher=gemv):
    """Launch on fresh random data and check against the float64 product."""
    got, x, w, out0 = launch_case(m, n, k, accumulate, seed, x_offset, launcher)
    check_product(got, x, w, out0, accumulate)


def wgmma_conversion(x) -> np.ndarray:
    """The bf16 bits (M, K) uint16 that gemm_wgmma's conversion pass (`_x_to_bf16_kernel`) makes of a
    device x (M, K) f32, K even: what a producer writing x's bf16 copy itself must match bit for bit."""
    from numba_vllm.kernels._launch import launch
    from numba_vllm.kernels.gemm_wgmma import CONVERT_THREADS, _x_to_bf16_kernel

    m, k = x.shape
    pairs = cuda.to_device(np.zeros((m, k // 2), np.uint32))
    launch(_x_to_bf16_kernel, max(1, -(-pairs.size // CONVERT_THREADS)), CONVERT_THREADS, x, pairs)
    return pairs.copy_to_host().view(np.uint16).reshape(m, k)
