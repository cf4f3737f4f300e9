"""gemm (prefill-sized x @ w.T) against float64 NumPy on the bf16-rounded weights.

Reference and tolerance: tests/helpers/products.py, as for gemv: |out - ref| <= 1e-5 * (|x| @ |w|.T)
per element (+ |out before| when accumulating), the output poisoned with NaN before the launch.

Simulator cases (each block is 256 simulated threads, ~1-2 s): K = 72 (four full 16-wide slices on
the 16-byte path, then a half slice loaded element by element), K = 100 (K % 8 != 0: every slice
element by element), K = 40 through a misaligned x; M or N past one 128-wide block, N odd. ``gpu``
tests run Llama 3.2 1B prefill shapes with fresh random inputs.
"""

import pytest

from numba_vllm.kernels.gemm import gemm
from tests.helpers.products import PREFILL_GPU_CASES, run_product

pytestmark = pytest.mark.gpu_too  # `make test-gpu` runs these on the GPU as well

SIM_CASES = [
    (17, 33, 72, False),
    (3, 70, 100, True),
    (1, 130, 40, True),  # two blocks along N; one token
    (133, 5, 24, False),  # two blocks along M
]


@pytest.mark.parametrize("m,n,k,accumulate", SIM_CASES)
def test_gemm_small(m, n, k, accumulate):
    run_product(m, n, k, accumulate, launcher=gemm)


def test_gemm_misaligned_x():
    run_product(5, 9, 40, True, x_offset=1, launcher=gemm)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,accumulate", PREFILL_GPU_CASES)
def test_gemm_gpu(m, n, k, accumulate):
    run_product(m, n, k, accumulate, seed=m + k, launcher=gemm)


@pytest.mark.gpu
def test_gemm_gpu_misaligned_x():
    run_product(200, 2048, 2048, True, x_offset=3, launcher=gemm)
