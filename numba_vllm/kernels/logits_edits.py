"""Editing rows of logits in place before sampling: masks, logit_bias and the three penalties.

The host lists, for each row that edits its logits, a few entries with distinct tokens
(`engine/logits_edits.py` says which and why); entry e of row r says everything done to token
``t = tokens[e]`` of logits row ``rows[r]``:

    flags & MASKED:  z[t] = -inf
    else:            z = z[t] + bias[e]
                     if flags & SEEN:   z = z / repetition if z > 0 else z * repetition
                     z = z - frequency * counts[e] - (presence if counts[e] > 0 else 0)

logits (B, V) float32, edited in place; rows (R,) int32 rows of logits to edit; offsets (R + 1,)
int32: row r's entries are offsets[r] .. offsets[r + 1] - 1; tokens, flags, counts (N,) int32;
bias (N,) float32; penalties (R, 3) float32 (repetition, frequency, presence) per row.

Thread mapping: block r edits row rows[r]; its threads stride over the row's entries. Tokens of a
row are distinct, so no two threads write one element. Rows without edits are not in `rows`: they
cost nothing, and a step in which no row edits launches nothing. No shared memory.
"""

from __future__ import annotations

import math

from numba import cuda, float32

from numba_vllm.engine.logits_edits import MASKED, SEEN
from numba_vllm.kernels._launch import check_array, launch
from numba_vllm.kernels.jit import kernel

EDIT_THREADS = 128  # entries of one row edited at once (a row has tens to thousands)


@kernel
def logits_edits_kernel(logits, rows, offsets, tokens, flags, counts, bias, penalties):
    """Apply row r's entries to logits[rows[r]]. Block r: row r. Shapes in the module docstring."""
    r = cuda.blockIdx.x
    row = rows[r]
    repetition = penalties[r, 0]
    frequency = penalties[r, 1]
    presence = penalties[r, 2]
    for e in range(offsets[r] + cuda.threadIdx.x, offsets[r + 1], cuda.blockDim.x):
        t = tokens[e]
        f = flags[e]
        if f & MASKED:
            z = float32(-math.inf)
        else:
            z = logits[row, t] + bias[e]
            if f & SEEN:
                z = z / repetition if z > float32(0.0) else z * repetition
            c = counts[e]
            if c > 0:
                z = z - frequency * float32(c) - presence
        logits[row, t] = z


def edit_logits(logits, rows, offsets, tokens, flags, counts, bias, penalties) -> None:
    """Edit rows of `logits` (B, V) float32 in place (device arrays; shapes in the module docstring).
    Token ids must lie in [0, V) and be distinct within a row (the host's entries are)."""
    check_array("logits", logits, dtype="float32", ndim=2)
    check_array("rows", rows, dtype="int32", ndim=1)
    num_rows = rows.shape[0]
    check_array("offsets", offsets, dtype="int32", shape=(num_rows + 1,))
    check_array("tokens", tokens, dtype="int32", ndim=1)
    n = tokens.shape[0]
    check_array("flags", flags, dtype="int32", shape=(n,))
    check_array("counts", counts, dtype="int32", shape=(n,))
    check_array("bias", bias, dtype="float32", shape=(n,))
    check_array("penalties", penalties, dtype="float32", shape=(num_rows, 3))
    if num_rows:
        launch(logits_edits_kernel, num_rows, EDIT_THREADS, logits, rows, offsets, tokens, flags, counts, bias, penalties)
