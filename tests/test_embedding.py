"""Embedding gather (numba_vllm.kernels.embedding) against NumPy indexing.

bf16 -> float32 is exact, so the comparison is bit for bit: the table is random uint16 bit patterns
(NaNs, infinities and subnormals included) and x's bits must be the table's bits shifted left 16.
Simulator shapes are small and awkward (D not a multiple of 32); gpu-marked ones are Llama 3.2 1B.
"""

import numpy as np
import pytest
from numba import cuda

from numba_vllm.kernels import embedding as embedding_module
from numba_vllm.kernels._launch import KernelError
from numba_vllm.kernels.embedding import embedding
from numba_vllm.loading.bf16 import BF16, upload_bf16

pytestmark = pytest.mark.gpu_too  # `make test-gpu` runs these on the GPU as well

gpu = pytest.mark.gpu


def _rng():
    seed = np.random.SeedSequence().entropy % 2**32
    print(f"random seed {seed}")  # shown by pytest when the test fails
    return np.random.default_rng(seed)


def _nan_device(shape):
    return cuda.to_device(np.full(shape, np.nan, np.float32))


def _run(token_ids, table_bits):
    """Gather on the device; return x (T, D) float32 from a NaN-poisoned output."""
    x = _nan_device((len(token_ids), table_bits.shape[1]))
    embedding(cuda.to_device(token_ids), upload_bf16(table_bits.view(BF16)), x)
    return x.copy_to_host()


@pytest.mark.parametrize(
    "num_tokens, vocab_size, dim",
    [
        (1, 7, 40),
        (5, 33, 72),
        (7, 50, 100),
        pytest.param(1, 128256, 2048, marks=gpu),
        pytest.param(64, 128256, 2048, marks=gpu),
        pytest.param(4096, 128256, 2048, marks=gpu),
    ],
)
def test_embedding_copies_rows_bit_for_bit(num_tokens, vocab_size, dim):
    rng = _rng()
    table_bits = rng.integers(0, 2**16, (vocab_size, dim), dtype=np.uint16)  # (V, D) every bf16 pattern
    token_ids = rng.integers(0, vocab_size, num_tokens, dtype=np.int32)  # (T,) repeats allowed
    token_ids[0] = vocab_size - 1  # the last row
    x = _run(token_ids, table_bits)
    expected_bits = table_bits[token_ids].astype(np.uint32) << 16
    np.testing.assert_array_equal(x.view(np.uint32), expected_bits)


def test_ids_outside_the_table_give_nan_rows():
    rng = _rng()
    table_bits = rng.integers(0x3C00, 0x4000, (9, 40), dtype=np.uint16)  # finite values
    token_ids = np.array([3, -1, 9, 0, 2**31 - 1], np.int32)
    x = _run(token_ids, table_bits)
    assert np.isnan(x[[1, 2, 4]]).all()
    np.testing.assert_array_equal(x[[0, 3]].view(np.uint32), table_bits[[3, 0]].astype(np.uint32) << 16)


def test_rows_wider_than_the_block_loop(monkeypatch):
    monkeypatch.setattr(embedding_module, "EMBEDDING_MAX_THREADS", 32)
    rng = _rng()
    table_bits = rng.integers(0, 2**16, (11, 300), dtype=np.uint16)  # 3 tiles of 32 x 4
    token_ids = np.array([10, 4, 4], np.int32)
    x = _run(token_ids, table_bits)
    np.testing.assert_array_equal(x.view(np.uint32), table_bits[token_ids].astype(np.uint32) << 16)


def test_bad_arguments_are_named():
    table = upload_bf16(np.zeros((5, 8), np.float32))
    x = cuda.to_device(np.zeros((2, 8), np.float32))
    with pytest.raises(KernelError, match="token_ids: dtype int64"):
        embedding(cuda.to_device(np.zeros(2, np.int64)), table, x)
    with pytest.raises(KernelError, match="x: shape"):
        embedding(cuda.to_device(np.zeros(3, np.int32)), table, x)
    with pytest.raises(KernelError, match="embedding_table: dtype float32"):
        embedding(cuda.to_device(np.zeros(2, np.int32)), cuda.to_device(np.zeros((5, 8), np.float32)), x)
