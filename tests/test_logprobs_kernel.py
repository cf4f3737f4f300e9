"""The logprobs kernel (numba_vllm.kernels.logprobs) against NumPy in float64.

Independent reference: log-softmax computed here with NumPy in float64, the rank as the count of
logits >= the token's, the top k by a stable sort on (-value, index). Small awkward shapes (a
vocabulary that is no multiple of the block, k = 0 and k = 20, repeated values to test the tie
rule, rows picked out of order) in the simulator; outputs poisoned with NaN / -7 beforehand so a
slot the kernel forgets to write shows. The GPU test runs a Llama-sized row (V = 128256).
"""

import numpy as np
import pytest
from numba import cuda

from numba_vllm.kernels._launch import KernelError
from numba_vllm.kernels.logprobs import logprobs

pytestmark = pytest.mark.gpu_too  # `make test-gpu` runs these on the GPU as well


def _reference(logits, rows, tokens, k):
    z = logits[rows].astype(np.float64)  # (R, V)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)  # (R,)
    chosen = z[np.arange(len(rows)), tokens]
    ranks = (z >= chosen[:, None]).sum(1)
    order = [sorted(range(z.shape[1]), key=lambda i, row=row: (-row[i], i))[:k] for row in z]  # by value, then index
    order = np.array(order, np.int64).reshape(len(rows), k)
    return chosen - lse, ranks, order, np.take_along_axis(z, order, 1) - lse[:, None]


def _run(logits, rows, tokens, k):
    out_lp = cuda.to_device(np.full((len(rows), k + 1), np.nan, np.float32))  # poisoned
    out_ids = cuda.to_device(np.full((len(rows), k + 1), -7, np.int32))
    logprobs(cuda.to_device(logits), cuda.to_device(np.asarray(rows, np.int32)), cuda.to_device(np.asarray(tokens, np.int32)), k,
             out_lp, out_ids)  # fmt: skip
    return out_lp.copy_to_host(), out_ids.copy_to_host()


def _check(logits, rows, tokens, k):
    lp, ids = _run(logits, rows, tokens, k)
    chosen, ranks, order, top = _reference(logits, rows, tokens, k)
    np.testing.assert_allclose(lp[:, 0], chosen, rtol=0, atol=2e-5)
    np.testing.assert_array_equal(ids[:, 0], ranks)
    np.testing.assert_array_equal(ids[:, 1:], order)
    np.testing.assert_allclose(lp[:, 1:], top, rtol=0, atol=2e-5)


@pytest.mark.parametrize("vocab, k", [(37, 5), (200, 20), (131, 0), (20, 20)])
def test_logprobs_match_numpy(vocab, k):
    rng = np.random.default_rng(vocab + k)
    logits = (rng.standard_normal((5, vocab)) * 3).astype(np.float32)
    rows = [3, 0, 4]  # out of order, row 1 and 2 not asked
    tokens = rng.integers(0, vocab, len(rows))
    _check(logits, rows, tokens, k)


def test_ties_go_to_the_lower_index_and_count_in_the_rank():
    logits = np.tile(np.array([1.0, 5.0, 5.0, -2.0, 5.0, 0.5, 1.0], np.float32), (2, 1))
    logits[1, 0] = 9.0
    _check(logits, [0, 1], [2, 6], 4)  # token 2 ties with 1 and 4: rank 3, as vLLM counts
    lp, ids = _run(logits, [0], [2], 4)
    assert ids[0].tolist() == [3, 1, 2, 4, 0]


def test_k_beyond_the_vocabulary_is_refused():
    with pytest.raises(KernelError, match="logprobs: k = 21"):
        _run(np.zeros((1, 40), np.float32), [0], [0], 21)


@pytest.mark.gpu
def test_llama_sized_rows_on_the_gpu():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((8, 128256)) * 4).astype(np.float32)
    rows, tokens = np.arange(8), rng.integers(0, 128256, 8)
    lp, ids = _run(logits, rows, tokens, 20)
    z = logits.astype(np.float64)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    np.testing.assert_allclose(lp[:, 0], z[rows, tokens] - lse, atol=1e-4)
    np.testing.assert_array_equal(ids[:, 0], (z >= z[rows, tokens][:, None]).sum(1))
    order = np.argsort(-z, axis=1, kind="stable")[:, :20]
    np.testing.assert_array_equal(ids[:, 1:], order)


@pytest.mark.slow  # compiles two kernels to PTX (seconds each)
def test_logprobs_and_edits_kernels_compile_without_fp64():
    from numba_vllm.bench.kernel_report import select
    from tests.helpers.ptx import check_compiled_clean, compile_ptx

    variants = select(("logprobs", "logits_edits"))
    results = compile_ptx(variants)
    for v in variants:
        check_compiled_clean(results[v.key], v.hot)
    assert "shfl.sync.bfly" in results["logprobs"]["ptx"]
