"""div / mod (numba_vllm.kernels.index_math) against NumPy's floor division, in a kernel.

The kernels divide non-negative indices by compile-time constants (a GQA group of 3 or 4, a warp's
32 lanes, a page's 16 tokens, a stage count of 3) and by run-time values (a persistent grid's items
per row tile). Runs on the simulator, or on a GPU with NUMBA_VLLM_TEST_GPU=1.
"""

import numpy as np
import pytest
from numba import cuda

from numba_vllm.kernels.index_math import div, mod
from numba_vllm.kernels.jit import kernel

pytestmark = pytest.mark.gpu_too  # `make test-gpu` runs these on the GPU as well

DIVISORS = (1, 3, 4, 16, 32, 128, 1000)


@kernel
def div_mod_kernel(a, b, quotients, remainders):
    """quotients[i], remainders[i] = div(a[i], b[i]), mod(a[i], b[i]); a, b: (n,) int32."""
    i = cuda.grid(1)
    if i < a.shape[0]:
        quotients[i] = div(a[i], b[i])
        remainders[i] = mod(a[i], b[i])


@pytest.mark.parametrize("divisor", DIVISORS)
def test_div_and_mod_are_floor_division_of_non_negative_indices(divisor):
    values = np.array([0, 1, 2, 3, 15, 16, 17, 127, 128, 129, 4095, 65_537, 2**31 - 1], dtype=np.int32)
    divisors = np.full_like(values, divisor)
    quotients = np.full_like(values, -1)
    remainders = np.full_like(values, -1)
    div_mod_kernel[1, 32](values, divisors, quotients, remainders)
    np.testing.assert_array_equal(quotients, values // divisor)
    np.testing.assert_array_equal(remainders, values % divisor)
