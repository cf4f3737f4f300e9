"""Logprobs on the device: per row, one token's log-softmax value and rank, and the top k.

For row ``rows[r]`` of logits z (B, V) and its token ``t = token_ids[r]``:

    lse = log(sum_i exp(z_i))                      (max first, then the sum of exp(z_i - max))
    out_logprobs[r, 0] = z_t - lse                 out_ids[r, 0] = #{i: z_i >= z_t}  (the rank, 1-based)
    out_logprobs[r, 1 + j] = z_(j) - lse           out_ids[r, 1 + j] = (j)   for j < k

where (0), (1), ... order the vocabulary by value, ties to the lower index (`ranks_before`, the
order of the samplers' argmax). Only these k + 1 pairs per row go back to the host, not the row.

logits (B, V) float32; rows (R,) int32; token_ids (R,) int32; k <= MAX_LOGPROBS (a runtime value);
out_logprobs (R, k + 1) float32; out_ids (R, k + 1) int32.

Thread mapping: block r reads row rows[r] twice, its threads striding over the columns (coalesced;
the second pass finds the row in L2). Pass 1: the row maximum (`block_max`), and each thread's own
top k of the columns it reads, kept sorted in a (MAX_LOGPROBS,) local array by insertion (after
the first few hundred columns a new column rarely enters it). Pass 2: the sum of exp(z_i - max)
and the count of columns with z_i >= z_t (`block_sum`: warp-shuffle butterflies, then the warps'
partials through shared memory). Then k rounds merge the threads' lists: each thread offers its
best not yet taken, `block_argmax` picks the winner, and the thread that offered it moves on.
Shared memory: 32 float32 + 32 int32 scratch. Rows that ask for no logprobs are not in `rows`.
"""

from __future__ import annotations

import math

from numba import cuda, float32, int32

from numba_vllm.engine.sampling import MAX_LOGPROBS
from numba_vllm.kernels._launch import KernelError, check_array, launch
from numba_vllm.kernels.jit import kernel
from numba_vllm.kernels.reductions import WARP_SIZE, block_max, block_sum
from numba_vllm.kernels.sample import NO_INDEX, block_argmax, ranks_before

LOGPROBS_MAX_THREADS = 256  # threads per row; a 128k vocabulary is 500 columns a thread
LOGPROBS_MIN_COLS_PER_THREAD = 4  # fewer threads for a small vocabulary


@kernel
def logprobs_kernel(logits, rows, token_ids, k, out_logprobs, out_ids):
    """Block r: row rows[r]'s token logprob, rank and top k (module docstring)."""
    scratch = cuda.shared.array(32, float32)  # (32,) one partial per warp
    scratch_indices = cuda.shared.array(32, int32)  # (32,) for block_argmax
    top_values = cuda.local.array(MAX_LOGPROBS, float32)  # (MAX_LOGPROBS,) this thread's best, best first
    top_indices = cuda.local.array(MAX_LOGPROBS, int32)
    r = cuda.blockIdx.x
    row = rows[r]
    vocab = logits.shape[1]
    held = 0  # entries in this thread's list
    m = float32(-math.inf)
    for i in range(cuda.threadIdx.x, vocab, cuda.blockDim.x):  # pass 1: maximum and the thread's top k
        z = logits[row, i]
        m = max(m, z)
        if k > 0 and (held < k or ranks_before(z, int32(i), top_values[k - 1], top_indices[k - 1])):
            j = held if held < k else k - 1  # the last slot, dropping its entry when the list is full
            while j > 0 and ranks_before(z, int32(i), top_values[j - 1], top_indices[j - 1]):
                top_values[j] = top_values[j - 1]
                top_indices[j] = top_indices[j - 1]
                j -= 1
            top_values[j] = z
            top_indices[j] = int32(i)
            if held < k:
                held += 1
    m = block_max(m, scratch)
    chosen = logits[row, token_ids[r]]
    total = float32(0.0)
    ahead = float32(0.0)  # columns with z >= chosen (exact in float32 below 2**24)
    for i in range(cuda.threadIdx.x, vocab, cuda.blockDim.x):  # pass 2: the sum and the rank
        z = logits[row, i]
        total += math.exp(z - m)
        if z >= chosen:
            ahead += float32(1.0)
    total = block_sum(total, scratch)
    ahead = block_sum(ahead, scratch)
    lse = m + math.log(total)
    if cuda.threadIdx.x == 0:
        out_logprobs[r, 0] = chosen - lse
        out_ids[r, 0] = int32(ahead)
    taken = 0  # entries of this thread's list already merged
    for j in range(k):  # merge: the block's best not yet taken, k times
        v = float32(-math.inf)
        i = int32(NO_INDEX)
        if taken < held:
            v = top_values[taken]
            i = top_indices[taken]
        best_v, best_i = block_argmax(v, i, scratch, scratch_indices)
        if taken < held and i == best_i:
            taken += 1
        if cuda.threadIdx.x == 0:
            out_logprobs[r, 1 + j] = best_v - lse
            out_ids[r, 1 + j] = best_i


def logprobs(logits, rows, token_ids, k: int, out_logprobs, out_ids) -> None:
    """Token logprobs, ranks and top k of rows of `logits` (device arrays; module docstring)."""
    check_array("logits", logits, dtype="float32", ndim=2)
    check_array("rows", rows, dtype="int32", ndim=1)
    num_rows = rows.shape[0]
    check_array("token_ids", token_ids, dtype="int32", shape=(num_rows,))
    if not 0 <= k <= MAX_LOGPROBS or k > logits.shape[1]:
        raise KernelError(f"logprobs: k = {k} outside [0, min({MAX_LOGPROBS}, V = {logits.shape[1]})]")
    check_array("out_logprobs", out_logprobs, dtype="float32", shape=(num_rows, k + 1))
    check_array("out_ids", out_ids, dtype="int32", shape=(num_rows, k + 1))
    if num_rows:
        cols = -(-logits.shape[1] // LOGPROBS_MIN_COLS_PER_THREAD)
        threads = min(LOGPROBS_MAX_THREADS, -(-cols // WARP_SIZE) * WARP_SIZE)
        launch(logprobs_kernel, num_rows, threads, logits, rows, token_ids, k, out_logprobs, out_ids)
