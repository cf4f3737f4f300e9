"""gather_rows (numba_vllm.kernels.gather) against NumPy indexing: float32 activations and int32 tokens."""

import numpy as np
import pytest
from numba import cuda

from numba_vllm.kernels._launch import KernelError
from numba_vllm.kernels.gather import gather_rows

pytestmark = pytest.mark.gpu_too  # `make test-gpu` runs these on the GPU as well


@pytest.mark.parametrize("dtype, width", [(np.float32, 300), (np.int32, 1)])
def test_gather_rows_copies_the_chosen_rows_exactly(dtype, width):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((7, width)) * 1000).astype(dtype)  # (T, D)
    rows = np.array([6, 0, 3, 3], np.int32)  # out of order, repeated
    out = cuda.device_array((4, width), dtype)
    gather_rows(cuda.to_device(x), cuda.to_device(rows), out)
    np.testing.assert_array_equal(out.copy_to_host(), x[rows])


def test_gather_rows_checks_dtypes():
    x = cuda.to_device(np.zeros((3, 2), np.float64))
    with pytest.raises(KernelError, match="x: dtype float64"):
        gather_rows(x, cuda.to_device(np.zeros(1, np.int32)), cuda.device_array((1, 2), np.float64))
    with pytest.raises(KernelError, match="out: dtype float32, expected int32"):
        gather_rows(cuda.to_device(np.zeros((3, 1), np.int32)), cuda.to_device(np.zeros(1, np.int32)),
                    cuda.device_array((1, 1), np.float32))  # fmt: skip
