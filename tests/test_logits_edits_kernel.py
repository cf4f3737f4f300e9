"""The logits-edits kernel (numba_vllm.kernels.logits_edits) against a NumPy formula written here.

Each entry's rule (mask, bias, repetition over seen tokens, frequency and presence over output
counts) is spelled out below element by element, independently of `engine.logits_edits.apply_edits`;
rows not listed must come back untouched, bit for bit.
"""

import numpy as np
import pytest
from numba import cuda

from numba_vllm.engine.logits_edits import MASKED, SEEN
from numba_vllm.kernels.logits_edits import edit_logits

pytestmark = pytest.mark.gpu_too  # `make test-gpu` runs these on the GPU as well


def test_edits_match_the_formula_and_leave_other_rows_alone():
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((4, 53)) * 2).astype(np.float32)
    rows = np.array([2, 0], np.int32)
    tokens = np.array([0, 5, 7, 52, 3, 9, 11], np.int32)  # row 2: 4 entries; row 0: 3
    offsets = np.array([0, 4, 7], np.int32)
    flags = np.array([SEEN, MASKED, 0, SEEN, SEEN | MASKED, SEEN, 0], np.int32)
    counts = np.array([2, 0, 1, 0, 1, 3, 0], np.int32)
    bias = np.array([0.5, 0.0, -1.5, 0.0, 0.0, 2.0, 7.0], np.float32)
    penalties = np.array([[1.3, 0.4, 0.25], [0.7, -0.2, 1.0]], np.float32)
    device = cuda.to_device(logits)
    edit_logits(device, *(cuda.to_device(a) for a in (rows, offsets, tokens, flags, counts, bias, penalties)))
    got = device.copy_to_host()
    want = logits.copy()
    for r, row in enumerate(rows):
        rep, freq, pres = (float(x) for x in penalties[r])
        for e in range(offsets[r], offsets[r + 1]):
            t = tokens[e]
            if flags[e] & MASKED:
                want[row, t] = -np.inf
                continue
            z = float(logits[row, t]) + float(bias[e])
            if flags[e] & SEEN:
                z = z / rep if z > 0 else z * rep
            if counts[e] > 0:
                z = z - freq * counts[e] - pres
            want[row, t] = z
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[[1, 3]], logits[[1, 3]])
