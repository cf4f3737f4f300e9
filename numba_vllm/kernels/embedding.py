"""Token embedding: gather rows of the bf16 embedding table into float32 activations.

    x[t, :] = float32(embedding[token_ids[t], :])        token_ids (T,) int32, embedding (V, D) bf16

Thread mapping: one block per token (grid = T) of ``min(EMBEDDING_MAX_THREADS, ceil(D / 4) rounded
up to 32)`` threads: 512 for Llama 3.2 1B (D = 2048). The row is copied in tiles of
``blockDim.x * EMBEDDING_COLS_PER_THREAD`` columns; in a tile, thread ``x`` copies columns
``tile + x + c * blockDim.x`` for ``c < 4``, loading all 4 before storing any (4 loads in flight).
The 32 lanes of a warp read 32 neighbouring bf16 values (64 bytes) and write 32 neighbouring
float32 values (128 bytes): every access is coalesced. No shared memory; the per-thread (4,) array
lives in registers (constant-trip loops, unrolled).

A token id outside ``[0, V)`` is a bug upstream (the tokenizer or the scheduler). A kernel cannot
raise, and reading outside the table would crash the context or copy garbage, so the kernel fills
that row with NaN instead: the mistake then surfaces as NaN logits, which tests and the engine
notice, rather than as a plausible wrong token.

The table is passed to the kernel as its uint16 view and converted with
``vector_load.bf16_bits_to_f32`` (a shift and a bit-cast: exact, so the output equals the table
entries bit for bit). Not ``float32(table[i, j])`` on a bf16 array: in numba-cuda 0.30.4 that is a
call into a separately compiled C++ shim taking its argument by pointer (local memory and an ABI
call per element in the PTX).
"""

import math

import numpy as np
from numba import cuda, float32

from numba_vllm.kernels._launch import check_array, launch
from numba_vllm.kernels.jit import kernel
from numba_vllm.kernels.reductions import WARP_SIZE
from numba_vllm.kernels.vector_load import bf16_bits_to_f32
from numba_vllm.loading.bf16 import BF16

EMBEDDING_MAX_THREADS = 1024  # threads per block; a row wider than 4 columns a thread loops
EMBEDDING_COLS_PER_THREAD = 4  # columns a thread loads before storing them (a compile-time constant)


@kernel
def embedding_kernel(token_ids, embedding_bits, x):
    """x[t, :] = embedding[token_ids[t], :] as float32; NaN row for an id outside the table.

    token_ids (T,) int32, embedding_bits (V, D) uint16 (the bf16 table's bits), x (T, D) float32.
    Block t handles token t.
    """
    values = cuda.local.array(EMBEDDING_COLS_PER_THREAD, float32)  # (4,) this thread's values in a tile
    t = cuda.blockIdx.x
    token_id = token_ids[t]
    in_table = 0 <= token_id < embedding_bits.shape[0]
    num_cols = x.shape[1]
    tile_width = cuda.blockDim.x * EMBEDDING_COLS_PER_THREAD
    for tile in range(0, num_cols, tile_width):
        first = tile + cuda.threadIdx.x
        for c in range(EMBEDDING_COLS_PER_THREAD):  # every load first: they overlap in flight
            j = first + c * cuda.blockDim.x
            if j < num_cols:
                values[c] = bf16_bits_to_f32(embedding_bits[token_id, j]) if in_table else float32(math.nan)
        for c in range(EMBEDDING_COLS_PER_THREAD):
            j = first + c * cuda.blockDim.x
            if j < num_cols:
                x[t, j] = values[c]


def embedding(token_ids, embedding_table, x) -> None:
    """Write the embeddings of ``token_ids`` into ``x`` (device arrays).

    token_ids: (T,) int32; embedding_table: (V, D) bf16; x: (T, D) float32, overwritten.
    """
    check_array("token_ids", token_ids, dtype="int32", ndim=1)
    check_array("embedding_table", embedding_table, dtype=BF16, ndim=2)
    num_tokens = token_ids.shape[0]
    dim = embedding_table.shape[1]
    check_array("x", x, dtype="float32", shape=(num_tokens, dim))
    if num_tokens == 0:
        return
    cols_per_thread = -(-dim // EMBEDDING_COLS_PER_THREAD)
    num_threads = min(EMBEDDING_MAX_THREADS, -(-cols_per_thread // WARP_SIZE) * WARP_SIZE)
    launch(embedding_kernel, num_tokens, num_threads, token_ids, embedding_table.view(np.uint16), x)
