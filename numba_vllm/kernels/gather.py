"""Gathering rows: out[i, :] = x[row_ids[i], :] (float32, or int32).

Used after the last layer: of the T tokens a step computes, only the last token of each sequence
that samples needs logits, so those rows are gathered before the final norm and the vocabulary-sized
head (for a 2048-token prefill that skips 2047 rows of a 128k-wide product). And, on int32 rows of
one column, to feed the tokens a step sampled on the device into the next step's token ids
(overlapped scheduling: the host has not seen them yet).

Thread mapping: block i copies row i; its threads stride over the D columns (coalesced).
No shared memory.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from numba_vllm.kernels._launch import KernelError, check_array, launch
from numba_vllm.kernels.jit import kernel

GATHER_THREADS = 256
GATHER_DTYPES = (np.dtype(np.float32), np.dtype(np.int32))


@kernel
def gather_rows_kernel(x, row_ids, out):
    """x (T, D) f32 or int32; row_ids (B,) int32; out (B, D), x's dtype."""
    i = cuda.blockIdx.x
    src = row_ids[i]
    for j in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
        out[i, j] = x[src, j]


def gather_rows(x, row_ids, out) -> None:
    """out = x[row_ids] (device arrays): x (T, D) float32 or int32, row_ids (B,) int32 in [0, T),
    out (B, D) of x's dtype."""
    check_array("x", x, ndim=2)
    if np.dtype(x.dtype) not in GATHER_DTYPES:
        raise KernelError(f"x: dtype {x.dtype}, expected one of {', '.join(map(str, GATHER_DTYPES))}")
    check_array("row_ids", row_ids, "int32", ndim=1)
    check_array("out", out, x.dtype, shape=(row_ids.shape[0], x.shape[1]))
    if row_ids.shape[0]:
        launch(gather_rows_kernel, row_ids.shape[0], GATHER_THREADS, x, row_ids, out)
