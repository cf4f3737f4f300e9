"""Shared by the attention tests: paged K/V caches built on the host, NaN-poisoned device arrays and
the float64 attention reference."""

from __future__ import annotations

import numpy as np
from numba import cuda

from numba_vllm.loading.bf16 import to_bf16, upload_bf16
from numba_vllm.model import reference
from numba_vllm.model.config import PAGE_SIZE

RTOL = 1e-5  # float32 kernel vs float64 reference on the same bf16 K/V


ATOL = 1e-5  # outputs are averages of N(0, 1) values: O(0.1 .. 1)


class PagedCache:
    """K/V of several sequences in a bf16 page pool with shuffled page ids, plus the same K/V
    contiguous in float32 (after bf16 rounding) for the reference."""

    def __init__(self, rng, seq_lens, num_kv_heads, head_dim, spare_pages=2, unwritten=np.nan):
        self.seq_lens = list(seq_lens)
        pages = [-(-n // PAGE_SIZE) for n in self.seq_lens]
        self.num_pages = 1 + sum(pages) + spare_pages  # page 0 is the null page
        page_ids = rng.permutation(np.arange(1, self.num_pages)).astype(np.int32)
        shape = (self.num_pages, PAGE_SIZE, num_kv_heads, head_dim)
        self.k_pool = np.full(shape, unwritten, np.float32)  # NaN (or `unwritten`) wherever no token lives
        self.v_pool = np.full(shape, unwritten, np.float32)
        self.block_tables = np.zeros((len(self.seq_lens), max(pages) + 1), np.int32)  # padded with 0
        self.k, self.v = [], []  # per sequence (n, KVH, HD) float32, bf16-exact
        used = 0
        for s, n in enumerate(self.seq_lens):
            self.block_tables[s, : pages[s]] = page_ids[used : used + pages[s]]
            used += pages[s]
            k = to_bf16(rng.standard_normal((n, num_kv_heads, head_dim))).astype(np.float32)
            v = to_bf16(rng.standard_normal((n, num_kv_heads, head_dim))).astype(np.float32)
            self.k.append(k)
            self.v.append(v)
            pos = np.arange(n)
            self.k_pool[self.block_tables[s, pos // PAGE_SIZE], pos % PAGE_SIZE] = k
            self.v_pool[self.block_tables[s, pos // PAGE_SIZE], pos % PAGE_SIZE] = v

    def kv_indices(self, s, positions):
        """kv indices (page_id * PAGE_SIZE + offset) of sequence s's positions, int32."""
        positions = np.asarray(positions)
        return (self.block_tables[s, positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE).astype(np.int32)

    def device(self):
        """(k_cache, v_cache, block_tables) on the device."""
        return upload_bf16(self.k_pool), upload_bf16(self.v_pool), cuda.to_device(self.block_tables)


def nan_device(shape):
    return cuda.to_device(np.full(shape, np.nan, np.float32))


def reference_attention(q, k, v, positions, scale):
    """reference.attention in float64 with an arbitrary scale (it uses 1/sqrt(HD): rescale q)."""
    head_dim = q.shape[-1]
    q64 = q.astype(np.float64) * (scale * np.sqrt(head_dim))
    return reference.attention(q64, k.astype(np.float64), v.astype(np.float64), np.asarray(positions))


# (start_pos, new tokens): whole prompts of 1, 17 and 33 tokens; chunks after a cached prefix,
# ending at 17 (15 + 2), 32 (16 + 16) and 33 (5 + 28) tokens.
PREFILL_SEQS = [(0, 1), (0, 17), (15, 2), (16, 16), (5, 28), (0, 33)]

