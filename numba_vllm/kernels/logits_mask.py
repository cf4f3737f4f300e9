"""Structured output's token mask: the logits of disallowed tokens set to -inf, in place, on the device.

    logits[rows[c], v] = -inf   where bit (v % 32) of bitmask[c, v // 32] is 0

logits (B, V) float32, the step's rows; rows (C,) int32, the constrained rows among them; bitmask
(C, ceil(V / 32)) int32, one packed mask per constrained row (llguidance's layout: bit set = token
allowed; `engine/structured.py` fills it). Only constrained rows are touched and the sampler then
runs unchanged, so a step with no constraint launches nothing and its rows pay nothing. The NumPy
backend's counterpart is `engine.structured.mask_logits`.

Thread mapping: grid (C, parts), blocks of ``MASK_THREADS`` threads, one column per thread:
``parts = min(ceil(V / MASK_THREADS), MASK_MAX_PARTS)`` blocks share row c, and thread ``x`` of
block (c, p) handles columns ``p * MASK_THREADS + x``, then that plus ``parts * MASK_THREADS``, and
so on (a grid-stride loop). Blocks start on a multiple of 256 columns, so the 32 lanes of a warp read
the same bitmask word (one broadcast load) and write 32 neighbouring logits (one coalesced store,
issued only for lanes whose token is masked). Each thread reads one 4-byte word per column it owns
and nothing else: the logits are only written, never read. No shared memory, no synchronisation.

A row id outside ``[0, B)`` is a bug in the caller; a kernel cannot raise, so such a row is
skipped (the launcher cannot see device values without a copy).
"""

import math

from numba import cuda, float32

from numba_vllm.kernels._launch import check_array, launch
from numba_vllm.kernels.jit import kernel

MASK_THREADS = 256  # threads per block, one column each: 8 warps, each on one bitmask word
MASK_MAX_PARTS = 128  # blocks per row at most; wider rows loop (V = 128 256 is 501 blocks of columns: 4 each)
WORD_BITS = 32  # tokens per bitmask word
WORD_SHIFT = 5  # log2(WORD_BITS)


@kernel
def logits_mask_kernel(logits, rows, bitmask):
    """logits[rows[c], v] = -inf where bit v % 32 of bitmask[c, v // 32] is clear. Block (c, p):
    part p of constrained row c.

    logits (B, V) float32; rows (C,) int32; bitmask (C, ceil(V / 32)) int32.
    """
    c = cuda.blockIdx.x
    row = rows[c]
    if row < 0 or row >= logits.shape[0]:
        return
    num_cols = logits.shape[1]
    stride = cuda.gridDim.y * cuda.blockDim.x
    for v in range(cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x, num_cols, stride):
        word = bitmask[c, v >> WORD_SHIFT]  # v // 32 and v % 32 below, without signed division (v >= 0)
        if (word >> (v & (WORD_BITS - 1))) & 1 == 0:
            logits[row, v] = float32(-math.inf)


def mask_parts(vocab_size: int) -> int:
    """Blocks per constrained row (grid.y)."""
    return max(1, min(-(-vocab_size // MASK_THREADS), MASK_MAX_PARTS))


def apply_token_bitmask(logits, rows, bitmask) -> None:
    """Mask the constrained rows of ``logits`` in place (device arrays).

    logits: (B, V) float32; rows: (C,) int32, distinct rows of logits; bitmask: (C, ceil(V / 32))
    int32, row c the mask of logits row rows[c]. Nothing is launched when C is 0.
    """
    check_array("logits", logits, dtype="float32", ndim=2)
    check_array("rows", rows, dtype="int32", ndim=1)
    num_rows = rows.shape[0]
    vocab_size = logits.shape[1]
    check_array("bitmask", bitmask, dtype="int32", shape=(num_rows, -(-vocab_size // WORD_BITS)))
    if num_rows == 0 or vocab_size == 0:
        return
    launch(logits_mask_kernel, (num_rows, mask_parts(vocab_size)), MASK_THREADS, logits, rows, bitmask)
