"""Causal prefill attention over the paged KV cache, for a ragged batch of prompts or prompt chunks.

Sequence ``s`` has ``n = cu_seqlens[s + 1] - cu_seqlens[s]`` new tokens, rows ``cu_seqlens[s] ..``
of ``q``, at positions ``start_pos[s] .. start_pos[s] + n - 1`` (``start_pos > 0`` when a prefix is
already cached: chunked prefill, prefix reuse). Their K/V are already in the cache (``rope.py``'s
kernel stores them first), so a new token at position ``p`` attends to cached positions ``0 .. p`` of its
sequence, found through ``block_tables[s]``: the cached prefix and the new tokens alike.

Thread mapping: FlashAttention's tiling on CUDA cores. A thread block per (kv head, sequence,
tile of ``BLOCK_ROWS`` query rows); grid ``(KVH, S, row tiles)``. A *query row* is one (new
token, query head) pair of the kv head's group, rows ordered token-major (row ``r``: token
``r // group``, head ``r % group``), so the group's heads share every K/V tile the block loads
(GQA for free) and ``BLOCK_ROWS`` need not be a multiple of ``group``.

The block walks the keys ``0 .. last position of its rows`` in tiles of ``BLOCK_KEYS``:

1. stage the tile's K and V rows (bf16 -> float32) in shared memory, 16 bytes per load;
2. ``S = Q K^T`` for the tile: the 128 threads form 16 row groups x 8 key groups, each thread a
   ``ROWS_PER_THREAD x KEYS_PER_THREAD`` block of S kept in registers (register tiling: each
   shared-memory value read feeds several multiply-adds);
3. causal mask, online softmax: the row's new max is the max over its 8 key-group threads
   (neighbouring lanes: 3 ``shfl_xor`` steps); ``P = exp(S - m)`` goes to shared memory;
   each thread rescales its running sums by ``exp(m_old - m_new)``;
4. ``O += P V``: each thread owns its rows x ``HD / 8`` dims (dims ``kg, kg + 8, ...``).

At the end the 8 key groups' shares of each row sum ``sum_exp`` are added (shuffles), and
``O / sum_exp`` is written.
Shared memory (HD 64): Q 64 x 65, K and V 32 x 65, P 64 x 33 float32 = 42 KiB; rows padded by
one float so the threads of a warp hit different banks. The query tile with the latest
positions, which has the most keys, is scheduled first (the grid's slowest dimension runs in
reverse), so the long tiles do not trail at the end.

Keys past the context are never loaded (zeros are staged instead); rows past a sequence's new
tokens compute a copy of its last row and are not written.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, float32

from numba_vllm.kernels._launch import KernelError, check_array, launch
from numba_vllm.kernels.jit import device_function, kernel
from numba_vllm.kernels.reductions import FULL_MASK
from numba_vllm.kernels.vector_load import BF16_PER_VECTOR, bf16x2_to_f32, load_u32x4
from numba_vllm.loading.bf16 import BF16
from numba_vllm.model.config import PAGE_SIZE

ROW_GROUPS = 16  # threads along query rows
KEY_GROUPS = 8  # threads along keys (and along head dims for O): neighbouring lanes
THREADS = ROW_GROUPS * KEY_GROUPS
SUPPORTED_HEAD_DIMS = (8, 16, 32, 64, 128, 256)
MAX_GROUP = 16


def tile_sizes(head_dim: int) -> tuple[int, int]:
    """(BLOCK_ROWS, BLOCK_KEYS) for a head dim: Q, K, V and P tiles within 48 KiB of shared memory."""
    return min(64, 4096 // head_dim), min(32, 2048 // head_dim)


@device_function
def _store_bf16x8(tile, row, d0, words):
    """Unpack 4 words of bf16 pairs into ``tile[row, d0 .. d0 + 7]`` as float32."""
    tile[row, d0], tile[row, d0 + 1] = bf16x2_to_f32(words[0])
    tile[row, d0 + 2], tile[row, d0 + 3] = bf16x2_to_f32(words[1])
    tile[row, d0 + 4], tile[row, d0 + 5] = bf16x2_to_f32(words[2])
    tile[row, d0 + 6], tile[row, d0 + 7] = bf16x2_to_f32(words[3])


@functools.cache
def prefill_attention_kernel_for(group: int, head_dim: int):
    """The prefill attention kernel compiled for ``group`` query heads per kv head and ``head_dim``."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise KernelError(f"prefill_attention: head_dim {head_dim} not supported (one of {SUPPORTED_HEAD_DIMS})")
    if not 1 <= group <= MAX_GROUP:
        raise KernelError(f"prefill_attention: {group} query heads per kv head, at most {MAX_GROUP}")
    block_rows, block_keys = tile_sizes(head_dim)
    rows_per_thread = block_rows // ROW_GROUPS  # HD 64: 4
    keys_per_thread = block_keys // KEY_GROUPS  # HD 64: 4
    dims_per_thread = head_dim // KEY_GROUPS  # HD 64: 8
    vectors_per_row = head_dim // BF16_PER_VECTOR  # 16-byte loads per K or V row
    stride = head_dim + 1  # padded row length of the Q, K, V tiles (bank conflicts)
    p_stride = block_keys + 1  # padded row length of the P tile
    # Array sizes must be plain constants (a product computed in the kernel is a run-time value).
    acc_len = rows_per_thread * dims_per_thread
    num_scores = rows_per_thread * keys_per_thread
    minus_inf = float32(-math.inf)

    @kernel
    def prefill_attention_kernel(q, k_cache, v_cache, block_tables, cu_seqlens, start_pos, scale, out):
        """q, out: (T, H, HD) f32; k_cache, v_cache: (P, PAGE_SIZE, KVH, HD) uint16 (bf16 bits);
        block_tables: (S, max_pages) int32; cu_seqlens: (S + 1,) int32; start_pos: (S,) int32."""
        kv_head = cuda.blockIdx.x
        s = cuda.blockIdx.y
        tile = cuda.gridDim.z - 1 - cuda.blockIdx.z  # latest rows (most keys) first
        first_token = cu_seqlens[s]
        num_new = cu_seqlens[s + 1] - first_token
        first_row = tile * block_rows
        if first_row >= num_new * group:
            return  # this sequence has fewer rows than the longest one: the whole block leaves
        start = start_pos[s]
        tid = cuda.threadIdx.x
        rg = tid // KEY_GROUPS  # row group: rows rg * rows_per_thread + i
        kg = tid % KEY_GROUPS  # key group: keys kg + 8 j, dims kg + 8 e

        q_tile = cuda.shared.array((block_rows, stride), float32)  # scale * q, one row per (token, head)
        k_tile = cuda.shared.array((block_keys, stride), float32)
        v_tile = cuda.shared.array((block_keys, stride), float32)
        p_tile = cuda.shared.array((block_rows, p_stride), float32)  # exp(S - m)

        # Stage the block's query rows (rows past the sequence repeat its last token).
        x = tid
        while x < block_rows * head_dim:
            r = x // head_dim
            d = x % head_dim
            token = min((first_row + r) // group, num_new - 1)
            head = kv_head * group + (first_row + r) % group
            q_tile[r, d] = q[first_token + token, head, d] * scale
            x += THREADS

        q_pos = cuda.local.array(rows_per_thread, np.int32)  # position of each of my rows
        m = cuda.local.array(rows_per_thread, float32)  # running max per row
        sum_exp = cuda.local.array(rows_per_thread, float32)  # this thread's share (its keys) of the row sum
        acc = cuda.local.array(acc_len, float32)  # (rows, dims) of P V
        scores = cuda.local.array(num_scores, float32)  # (rows, keys)
        for i in range(rows_per_thread):
            row = first_row + rg * rows_per_thread + i
            q_pos[i] = start + min(row // group, num_new - 1)
            m[i] = minus_inf
            sum_exp[i] = float32(0.0)
            for e in range(dims_per_thread):
                acc[i * dims_per_thread + e] = float32(0.0)
        last_row = min(first_row + block_rows, num_new * group) - 1
        num_keys = start + last_row // group + 1  # keys 0 .. position of the last row
        context_len = start + num_new

        for key0 in range(0, num_keys, block_keys):
            # 1. Stage K and V of keys key0 .. key0 + block_keys - 1 (zeros past the context).
            vec = tid
            while vec < block_keys * vectors_per_row:
                j = vec // vectors_per_row
                d0 = (vec % vectors_per_row) * BF16_PER_VECTOR
                pos = key0 + j
                if pos < context_len:
                    page = block_tables[s, pos // PAGE_SIZE]
                    _store_bf16x8(k_tile, j, d0, load_u32x4(k_cache, (page, pos % PAGE_SIZE, kv_head, d0)))
                    _store_bf16x8(v_tile, j, d0, load_u32x4(v_cache, (page, pos % PAGE_SIZE, kv_head, d0)))
                else:
                    for e in range(BF16_PER_VECTOR):
                        k_tile[j, d0 + e] = float32(0.0)
                        v_tile[j, d0 + e] = float32(0.0)
                vec += THREADS
            cuda.syncthreads()  # wait for the K/V tile (and, the first time, the Q tile)

            # 2. S = (scale Q) K^T for my rows x keys.
            for x in range(num_scores):
                scores[x] = float32(0.0)
            for d in range(head_dim):
                for i in range(rows_per_thread):
                    qd = q_tile[rg * rows_per_thread + i, d]
                    for j in range(keys_per_thread):
                        scores[i * keys_per_thread + j] += qd * k_tile[kg + KEY_GROUPS * j, d]

            # 3. Causal mask and online softmax; P to shared memory.
            for i in range(rows_per_thread):
                tile_max = minus_inf
                for j in range(keys_per_thread):
                    x = i * keys_per_thread + j
                    if key0 + kg + KEY_GROUPS * j > q_pos[i]:
                        scores[x] = minus_inf  # a later position (or past the context): masked
                    tile_max = max(tile_max, scores[x])
                offset = 1
                while offset < KEY_GROUPS:  # max over the row's 8 key groups (lanes kg ^ offset)
                    tile_max = max(tile_max, cuda.shfl_xor_sync(FULL_MASK, tile_max, offset))
                    offset *= 2
                # Finite: the first tile holds key 0, which every row sees.
                m_new = max(m[i], tile_max)
                alpha = math.exp(m[i] - m_new)  # 0 on the first tile (m = -inf)
                m[i] = m_new
                row_sum = float32(0.0)
                for j in range(keys_per_thread):
                    p = math.exp(scores[i * keys_per_thread + j] - m_new)
                    row_sum += p
                    p_tile[rg * rows_per_thread + i, kg + KEY_GROUPS * j] = p
                sum_exp[i] = sum_exp[i] * alpha + row_sum
                for e in range(dims_per_thread):
                    acc[i * dims_per_thread + e] *= alpha
            cuda.syncthreads()  # wait for the whole P tile

            # 4. O += P V for my rows x dims.
            for j in range(block_keys):
                for i in range(rows_per_thread):
                    p = p_tile[rg * rows_per_thread + i, j]
                    for e in range(dims_per_thread):
                        acc[i * dims_per_thread + e] += p * v_tile[j, kg + KEY_GROUPS * e]
            cuda.syncthreads()  # wait until every thread is done with K, V and P before restaging

        # Row sums: add the 8 key groups' shares; write O / sum_exp for the rows that exist.
        for i in range(rows_per_thread):
            total = sum_exp[i]
            offset = 1
            while offset < KEY_GROUPS:
                total += cuda.shfl_xor_sync(FULL_MASK, total, offset)
                offset *= 2
            row = first_row + rg * rows_per_thread + i
            if row < num_new * group:
                token = first_token + row // group
                head = kv_head * group + row % group
                for e in range(dims_per_thread):
                    out[token, head, kg + KEY_GROUPS * e] = acc[i * dims_per_thread + e] / total

    return prefill_attention_kernel


class PrefillShape(NamedTuple):
    """What a prefill attention launch is sized by."""

    group: int  # query heads per kv head
    head_dim: int
    num_kv_heads: int
    num_seqs: int
    max_new_tokens: int  # the most new tokens of any sequence


def check_prefill_args(
    name, q, k_cache, v_cache, block_tables, cu_seqlens, start_pos, out, max_new_tokens
) -> PrefillShape | None:
    """The checks both prefill attention launchers make (`prefill_attention`'s argument contract);
    None when there is nothing to launch. `max_new_tokens` None is read from cu_seqlens (a copy to the host)."""
    check_array("q", q, "float32", ndim=3)
    num_tokens, num_heads, head_dim = q.shape
    check_array("k_cache", k_cache, BF16, (None, PAGE_SIZE, None, head_dim))
    num_kv_heads = k_cache.shape[2]
    check_array("v_cache", v_cache, BF16, tuple(k_cache.shape))
    check_array("block_tables", block_tables, "int32", ndim=2)
    num_seqs = block_tables.shape[0]
    check_array("cu_seqlens", cu_seqlens, "int32", (num_seqs + 1,))
    check_array("start_pos", start_pos, "int32", (num_seqs,))
    check_array("out", out, "float32", (num_tokens, num_heads, head_dim))
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise KernelError(f"{name}: {num_heads} query heads not a multiple of {num_kv_heads} kv heads")
    if max_new_tokens is None:
        cu = cu_seqlens.copy_to_host() if hasattr(cu_seqlens, "copy_to_host") else np.asarray(cu_seqlens)
        max_new_tokens = int(np.max(np.diff(cu))) if num_seqs else 0
    if num_tokens == 0 or num_seqs == 0 or max_new_tokens <= 0:
        return None
    return PrefillShape(num_heads // num_kv_heads, head_dim, num_kv_heads, num_seqs, max_new_tokens)


def prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens, start_pos, scale: float, out,
                      max_new_tokens: int | None = None) -> None:
    """Causal attention of a ragged batch of new tokens over their sequences' cached K/V.

    q: (T, H, HD) f32, the new tokens of all sequences back to back; k_cache, v_cache:
    (num_pages, PAGE_SIZE, KVH, HD) bf16, already holding the new tokens' K/V;
    block_tables: (S, max_pages) int32; cu_seqlens: (S + 1,) int32, sequence s owns q rows
    cu_seqlens[s] .. cu_seqlens[s + 1] - 1; start_pos: (S,) int32, position of each sequence's
    first new token; scale: usually 1 / sqrt(HD); out: (T, H, HD) f32.
    max_new_tokens: the most new tokens of any sequence (sizes the grid); when None it is read
    from cu_seqlens, which copies it to the host.
    """
    shape = check_prefill_args("prefill_attention", q, k_cache, v_cache, block_tables, cu_seqlens, start_pos, out, max_new_tokens)
    if shape is None:
        return
    group, head_dim, num_kv_heads, num_seqs, max_new_tokens = shape
    kernel_ = prefill_attention_kernel_for(group, head_dim)
    block_rows, _ = tile_sizes(head_dim)
    num_row_tiles = -(-max_new_tokens * group // block_rows)
    launch(kernel_, (num_kv_heads, num_seqs, num_row_tiles), THREADS, q, k_cache.view(np.uint16),
           v_cache.view(np.uint16), block_tables, cu_seqlens, start_pos, np.float32(scale), out)
