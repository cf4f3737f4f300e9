"""RMSNorm and the fused residual-add + RMSNorm (numba_vllm.kernels.rmsnorm) against reference.rms_norm.

Tolerances (float32): the kernel sums squares in a different order than NumPy's pairwise sum and
rounds sqrt and the division once each; the output is x * inv_rms * w, so its error is relative
per element: rtol 2e-6 (about 16 float32 ulps), no absolute slack (a zero stays exactly zero).
The residual update of the fused kernel is one float32 addition: compared exactly.
Simulator shapes: few rows, D not a multiple of 32 (40, 72, 100), 300 and 1000 (3 and 8 warps); gpu-marked:
Llama 3.2 1B (D = 2048) at 1, 64 and 4096 rows.

The bf16 output (the x workspace of gemm_wgmma) must be the float32 output rounded to nearest even,
bit for bit: equal to NumPy's rounding of the float32 variant's output and to what gemm_wgmma's own
conversion pass makes of it (so the products, and the engine's tokens, do not change).
"""

import numpy as np
import pytest
from numba import cuda

from numba_vllm.kernels import rmsnorm as rmsnorm_module
from numba_vllm.kernels._launch import KernelError
from numba_vllm.kernels.rmsnorm import add_rms_norm, rms_norm
from numba_vllm.loading.bf16 import bf16_bits, bf16_from_bits, to_bf16, upload_bf16
from numba_vllm.model import reference
from tests.helpers.products import wgmma_conversion

pytestmark = pytest.mark.gpu_too  # `make test-gpu` runs these on the GPU as well

gpu = pytest.mark.gpu
EPS = 1e-5
RTOL = 2e-6

SHAPES = [
    (1, 40),
    (3, 72),
    (5, 100),
    (2, 300),  # 3 warps
    (1, 1000),  # 8 warps
    pytest.param(1, 2048, marks=gpu),
    pytest.param(64, 2048, marks=gpu),
    pytest.param(4096, 2048, marks=gpu),
]


def _rng():
    seed = np.random.SeedSequence().entropy % 2**32
    print(f"random seed {seed}")  # shown by pytest when the test fails
    return np.random.default_rng(seed)


def _inputs(rng, num_rows, dim):
    """x (T, D) float32 with rows of very different scales (one all zero), weight (D,) bf16."""
    scales = np.float32(10.0) ** rng.uniform(-3, 3, (num_rows, 1)).astype(np.float32)
    x = (rng.standard_normal((num_rows, dim), dtype=np.float32) * scales).astype(np.float32)
    if num_rows > 1:
        x[-1] = 0.0  # rms 0: out = 0 * (1 / sqrt(eps)) * w = 0
    weight = to_bf16(1.0 + 0.1 * rng.standard_normal(dim))  # (D,) bf16
    return x, weight


def _nan_device(shape):
    return cuda.to_device(np.full(shape, np.nan, np.float32))


def _expected(x, weight):
    return reference.rms_norm(x, weight.astype(np.float32), EPS)


@pytest.mark.parametrize("num_rows, dim", SHAPES)
def test_rms_norm_matches_reference(num_rows, dim):
    x, weight = _inputs(_rng(), num_rows, dim)
    out = _nan_device(x.shape)
    rms_norm(cuda.to_device(x), upload_bf16(weight), out, EPS)
    np.testing.assert_allclose(out.copy_to_host(), _expected(x, weight), rtol=RTOL, atol=0)


@pytest.mark.parametrize("num_rows, dim", SHAPES)
def test_add_rms_norm_updates_residual_and_normalizes_it(num_rows, dim):
    rng = _rng()
    x, weight = _inputs(rng, num_rows, dim)
    residual = rng.standard_normal(x.shape, dtype=np.float32)
    if num_rows > 1:
        residual[-1] = 0.0  # with x's zero row: a zero sum
    d_x, d_residual, out = cuda.to_device(x), cuda.to_device(residual), _nan_device(x.shape)
    add_rms_norm(d_x, d_residual, upload_bf16(weight), out, EPS)
    new_residual = residual + x  # (T, D) float32: the same single rounding as the kernel
    np.testing.assert_array_equal(d_residual.copy_to_host(), new_residual)
    np.testing.assert_allclose(out.copy_to_host(), _expected(new_residual, weight), rtol=RTOL, atol=0)
    np.testing.assert_array_equal(d_x.copy_to_host(), x)  # x is read only


@pytest.mark.parametrize("num_rows, dim", [(1, 40), (9, 37), (33, 72), (2, 300)])  # rows 1 .. 33, odd and even D
def test_rms_norm_bf16_output_is_the_f32_output_rounded(num_rows, dim):
    x, weight = _inputs(_rng(), num_rows, dim)
    d_x, d_weight = cuda.to_device(x), upload_bf16(weight)
    out = _nan_device(x.shape)
    rms_norm(d_x, d_weight, out, EPS)
    bits = cuda.to_device(np.full(x.shape, 0xFFFF, np.uint16))  # (T, D) poisoned: a bf16 NaN no row makes
    rms_norm(d_x, d_weight, bits, EPS)
    got = bits.copy_to_host()
    np.testing.assert_array_equal(got, bf16_bits(to_bf16(out.copy_to_host())))
    if dim % 2 == 0:  # the conversion pass takes pairs
        np.testing.assert_array_equal(got, wgmma_conversion(out))
    want = _expected(x, weight)  # (T, D) float32: within one bf16 rounding (2^-8 relative) of NumPy
    np.testing.assert_allclose(bf16_from_bits(got).astype(np.float32), want, rtol=2**-8 + RTOL, atol=0)


def test_out_may_be_x(monkeypatch):
    rng = _rng()
    x, weight = _inputs(rng, 3, 100)
    residual = rng.standard_normal(x.shape, dtype=np.float32)
    d_x = cuda.to_device(x)
    rms_norm(d_x, upload_bf16(weight), d_x, EPS)  # in place
    np.testing.assert_allclose(d_x.copy_to_host(), _expected(x, weight), rtol=RTOL, atol=0)

    d_x, d_residual = cuda.to_device(x), cuda.to_device(residual)
    add_rms_norm(d_x, d_residual, upload_bf16(weight), d_x, EPS)  # x's buffer receives the norm
    np.testing.assert_array_equal(d_residual.copy_to_host(), residual + x)
    np.testing.assert_allclose(d_x.copy_to_host(), _expected(residual + x, weight), rtol=RTOL, atol=0)


def test_rows_wider_than_the_block_loop(monkeypatch):
    """Two tiles: the second pass reads the row again instead of keeping it in registers."""
    monkeypatch.setattr(rmsnorm_module, "RMSNORM_MAX_THREADS", 32)  # 300 columns: 3 tiles of 32 x 4
    rng = _rng()
    x, weight = _inputs(rng, 2, 300)
    out = _nan_device(x.shape)
    rms_norm(cuda.to_device(x), upload_bf16(weight), out, EPS)
    np.testing.assert_allclose(out.copy_to_host(), _expected(x, weight), rtol=RTOL, atol=0)
    residual = rng.standard_normal(x.shape, dtype=np.float32)
    d_residual, out = cuda.to_device(residual), _nan_device(x.shape)
    add_rms_norm(cuda.to_device(x), d_residual, upload_bf16(weight), out, EPS)
    np.testing.assert_array_equal(d_residual.copy_to_host(), residual + x)
    np.testing.assert_allclose(out.copy_to_host(), _expected(residual + x, weight), rtol=RTOL, atol=0)


def test_bad_arguments_are_named():
    x = cuda.to_device(np.zeros((2, 8), np.float32))
    weight = upload_bf16(np.ones(8, np.float32))
    with pytest.raises(KernelError, match="weight: dtype float32"):
        rms_norm(x, cuda.to_device(np.ones(8, np.float32)), x, EPS)
    with pytest.raises(KernelError, match="weight: shape"):
        rms_norm(x, upload_bf16(np.ones(9, np.float32)), x, EPS)
    with pytest.raises(KernelError, match="out: shape"):
        rms_norm(x, weight, cuda.to_device(np.zeros((3, 8), np.float32)), EPS)
    with pytest.raises(KernelError, match=r"out: shape \(2, 4\)"):
        rms_norm(x, weight, cuda.to_device(np.zeros((2, 4), np.uint16)), EPS)
    with pytest.raises(KernelError, match="out: dtype int32"):
        rms_norm(x, weight, cuda.to_device(np.zeros((2, 8), np.int32)), EPS)
    with pytest.raises(KernelError, match="x: must be C-contiguous"):
        rms_norm(cuda.to_device(np.zeros((2, 16), np.float32))[:, ::2], weight, x, EPS)  # a strided view
    residual = cuda.to_device(np.zeros((2, 8), np.float32))
    with pytest.raises(KernelError, match="must not be residual"):
        add_rms_norm(x, residual, weight, residual, EPS)
