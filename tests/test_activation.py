"""SiLU-and-multiply (numba_vllm.kernels.activation) against reference.silu_and_mul.

Tolerance (float32): expf is within 2 ulps on a GPU, the approximate reciprocal within 1, and an
add and two multiplies each round once; silu(g) * u has no cancellation, so the error is relative
per element: rtol 2e-6 (about 16 ulps), no absolute slack. Inputs include |g| near and past expf's
overflow (88.7), where the reciprocal of 1 + exp(-g) is a subnormal (kept, not flushed to zero).
Simulator shapes: few rows, F not a multiple of 32 or of the block; gpu-marked: Llama 3.2 1B
(F = 8192) at 1, 64 and 4096 rows. The bf16 copy (gemm_wgmma's x workspace) must be the float32
output rounded to nearest even, bit for bit (NumPy's rounding, and gemm_wgmma's conversion pass).
"""

import numpy as np
import pytest
from numba import cuda

from numba_vllm.kernels import activation as activation_module
from numba_vllm.kernels._launch import KernelError
from numba_vllm.kernels.activation import silu_and_mul
from numba_vllm.loading.bf16 import bf16_bits, to_bf16
from numba_vllm.model import reference
from tests.helpers.products import wgmma_conversion

gpu = pytest.mark.gpu
RTOL = 2e-6
# In the simulator exp(100) is a Python float; adding it to a float32 overflows to inf with a warning.
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning"),
              pytest.mark.gpu_too]  # `make test-gpu` runs these on the GPU as well


def _rng():
    seed = np.random.SeedSequence().entropy % 2**32
    print(f"random seed {seed}")  # shown by pytest when the test fails
    return np.random.default_rng(seed)


def _gate_up(rng, num_rows, width):
    """(T, 2F) float32: gate values over the whole useful range (and a few extreme ones), up ~ N(0, 1)."""
    gate = rng.standard_normal((num_rows, width), dtype=np.float32) * np.float32(4.0)
    extremes = np.array([-100.0, -88.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 88.0, 100.0], np.float32)
    flat = gate.reshape(-1)
    flat[: min(len(extremes), flat.size)] = extremes[: flat.size]
    up = rng.standard_normal((num_rows, width), dtype=np.float32)
    return np.concatenate([gate, up], axis=1)


def _check(gate_up, bf16_copy=False):
    """out against the reference; with ``bf16_copy``, the copy against out rounded (NumPy and the conversion pass)."""
    num_rows, num_cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = cuda.to_device(np.full((num_rows, num_cols), np.nan, np.float32))
    bits = cuda.to_device(np.full((num_rows, num_cols), 0xFFFF, np.uint16)) if bf16_copy else None  # poisoned
    silu_and_mul(cuda.to_device(gate_up), out, bits)
    with np.errstate(over="ignore"):  # exp(100) overflows to inf in the reference too
        expected = reference.silu_and_mul(gate_up[:, :num_cols], gate_up[:, num_cols:])
    got = out.copy_to_host()
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=0)
    if bf16_copy:
        np.testing.assert_array_equal(bits.copy_to_host(), bf16_bits(to_bf16(got)))
        if num_cols % 2 == 0:  # the conversion pass takes pairs
            np.testing.assert_array_equal(bits.copy_to_host(), wgmma_conversion(out))


@pytest.mark.parametrize(
    "num_rows, width",
    [
        (1, 37),
        (3, 100),
        (5, 300),  # two blocks along the row
        pytest.param(1, 8192, marks=gpu),
        pytest.param(64, 8192, marks=gpu),
        pytest.param(4096, 8192, marks=gpu),
    ],
)
def test_silu_and_mul_matches_reference(num_rows, width):
    _check(_gate_up(_rng(), num_rows, width))


@pytest.mark.parametrize("num_rows, width", [(1, 37), (9, 20), (33, 12), (3, 300)])  # rows 1 .. 33, odd and even F
def test_silu_and_mul_bf16_copy_is_the_output_rounded(num_rows, width):
    _check(_gate_up(_rng(), num_rows, width), bf16_copy=True)


def test_grid_smaller_than_the_array_loops(monkeypatch):
    monkeypatch.setattr(activation_module, "ACTIVATION_MAX_COL_BLOCKS", 1)  # 600 columns on 256 threads
    monkeypatch.setattr(activation_module, "ACTIVATION_MAX_ROW_BLOCKS", 2)  # 5 rows on 2 row blocks
    _check(_gate_up(_rng(), 5, 600))


def test_bad_arguments_are_named():
    out = cuda.to_device(np.zeros((2, 4), np.float32))
    with pytest.raises(KernelError, match="odd width"):
        silu_and_mul(cuda.to_device(np.zeros((2, 9), np.float32)), out)
    with pytest.raises(KernelError, match="out: shape"):
        silu_and_mul(cuda.to_device(np.zeros((2, 10), np.float32)), out)
    with pytest.raises(KernelError, match="gate_up: dtype float64"):
        silu_and_mul(cuda.to_device(np.zeros((2, 8))), out)
    gate_up = cuda.to_device(np.zeros((2, 8), np.float32))
    with pytest.raises(KernelError, match="out_bits: dtype float32"):
        silu_and_mul(gate_up, out, out)
    with pytest.raises(KernelError, match="out_bits: shape"):
        silu_and_mul(gate_up, out, cuda.to_device(np.zeros((3, 4), np.uint16)))
