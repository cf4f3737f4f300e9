"""The structured-output token mask (numba_vllm.kernels.logits_mask, and engine.structured.mask_logits
for the NumPy backend) against a per-token Python reference.

Vocabulary sizes are awkward (not multiples of 32, one past, one short); masks are random words,
all-allowed and all-masked words included (the sign bit too). Rows not named must be untouched.
"""

import numpy as np
import pytest
from numba import cuda

from numba_vllm.engine.structured import bitmask_words, mask_logits
from numba_vllm.kernels import logits_mask as logits_mask_module
from numba_vllm.kernels._launch import KernelError
from numba_vllm.kernels.logits_mask import apply_token_bitmask

pytestmark = pytest.mark.gpu_too  # `make test-gpu` runs these on the GPU as well

gpu = pytest.mark.gpu


def _rng():
    seed = np.random.SeedSequence().entropy % 2**32
    print(f"random seed {seed}")  # shown by pytest when the test fails
    return np.random.default_rng(seed)


def _reference(logits, rows, bitmask):
    """Token by token: -inf where bit v % 32 of word v // 32 is clear."""
    out = logits.copy()
    for c, row in enumerate(rows):
        for v in range(logits.shape[1]):
            word = int(bitmask[c, v // 32]) & 0xFFFFFFFF  # the int32's 32 bits
            if not (word >> (v % 32)) & 1:
                out[row, v] = -np.inf
    return out


def _case(rng, num_rows, vocab_size, rows):
    logits = rng.standard_normal((num_rows, vocab_size)).astype(np.float32)
    bitmask = rng.integers(-(2**31), 2**31, (len(rows), bitmask_words(vocab_size)), dtype=np.int64).astype(np.int32)
    bitmask[0, 0] = -1  # every token of a word allowed (all bits, the sign bit included)
    if bitmask.shape[1] > 1:
        bitmask[-1, 1] = 0  # none allowed
    return logits, np.array(rows, np.int32), bitmask


@pytest.mark.parametrize(
    "num_rows, vocab_size, rows",
    [
        (1, 31, [0]),
        (3, 33, [2, 0]),
        (4, 100, [1, 3, 0]),
        (2, 257, [1]),  # two parts of 256 columns
        (5, 600, [4, 0, 2]),  # three parts
        pytest.param(32, 128256, list(range(0, 32, 3)), marks=gpu),
    ],
)
def test_masked_rows_match_the_reference_and_others_are_untouched(num_rows, vocab_size, rows):
    rng = _rng()
    logits, rows, bitmask = _case(rng, num_rows, vocab_size, rows)
    device = cuda.to_device(logits)
    apply_token_bitmask(device, cuda.to_device(rows), cuda.to_device(bitmask))
    np.testing.assert_array_equal(device.copy_to_host(), _reference(logits, rows, bitmask))


def test_rows_wider_than_the_grid_loop(monkeypatch):
    """With fewer blocks than parts of 256 columns, each thread walks several columns."""
    monkeypatch.setattr(logits_mask_module, "MASK_MAX_PARTS", 2)
    rng = _rng()
    logits, rows, bitmask = _case(rng, 2, 1100, [1])  # 5 parts' worth of columns over 2 blocks
    assert logits_mask_module.mask_parts(1100) == 2
    device = cuda.to_device(logits)
    apply_token_bitmask(device, cuda.to_device(rows), cuda.to_device(bitmask))
    np.testing.assert_array_equal(device.copy_to_host(), _reference(logits, rows, bitmask))


def test_no_rows_launches_nothing(monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("launched")

    monkeypatch.setattr(logits_mask_module, "launch", no_launch)
    logits = cuda.to_device(np.zeros((2, 40), np.float32))
    apply_token_bitmask(logits, cuda.to_device(np.zeros(0, np.int32)), cuda.to_device(np.zeros((0, 2), np.int32)))


@pytest.mark.parametrize(
    "rows, bitmask, message",
    [
        (np.zeros(1, np.int64), np.zeros((1, 2), np.int32), "rows: dtype int64"),
        (np.zeros(1, np.int32), np.zeros((1, 1), np.int32), r"bitmask: shape \(1, 1\), expected \(1, 2\)"),
        (np.zeros(2, np.int32), np.zeros((1, 2), np.int32), r"bitmask: shape \(1, 2\), expected \(2, 2\)"),
        (np.zeros(1, np.int32), np.zeros((1, 2), np.uint32), "bitmask: dtype uint32"),
    ],
)
def test_bad_inputs_are_refused_by_name(rows, bitmask, message):
    logits = cuda.to_device(np.zeros((2, 40), np.float32))
    with pytest.raises(KernelError, match=message):
        apply_token_bitmask(logits, cuda.to_device(rows), cuda.to_device(bitmask))


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 100, 1000])
def test_numpy_mask_matches_the_reference(vocab_size):
    rng = _rng()
    logits, rows, bitmask = _case(rng, 3, vocab_size, [0, 1, 2])
    masked = logits.copy()
    mask_logits(masked, bitmask)
    np.testing.assert_array_equal(masked, _reference(logits, rows, bitmask))


def test_numpy_mask_refuses_a_bitmask_of_the_wrong_width():
    with pytest.raises(ValueError, match="does not fit"):
        mask_logits(np.zeros((1, 40), np.float32), np.zeros((1, 1), np.int32))
