"""Shared by the attention tests: paged K/V caches built on the host, NaN-poisoned device arrays and
the float64 attention reference."""

from __future__ import annotations

import numpy as np
from numba import cuda

from numba_vllm.loading.bf16 import BF16, to_bf16, upload_bf16
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


# ---- prefill attention on the tensor cores: the bound of a bf16-rounded P -------------------------

# Each weight of the output is off by a relative 2^-8 at most (P rounded to bf16 for P V, the row sums
# unrounded): |out - ref| <= 2^-8 attention(q, K, |V|); 10% more for the fp32 sums and exp2.approx, and
# PREFILL_ATOL for outputs near zero.
P_BOUND = 1.1 * 2.0**-8  # relative error of a bf16-rounded weight (8 significant bits), plus fp32 slack
PREFILL_ATOL = 2e-6
EDGE_SEQS = [(0, 1), (0, 15), (0, 16), (0, 17), (0, 33)]  # whole prompts around page edges


def check_prefill(launcher, rng, seqs, group, num_kv_heads, head_dim, scale=None, tiling=None, key_scale=None,
                  table_pages=None):
    """Run a prefill attention kernel (``launcher``: prefill_attention_tc or prefill_attention_wgmma) and
    check it against the float64 reference within ``P_BOUND`` (the bf16 rounding of P).

    seqs: (start_pos, num_new) per sequence; the first start_pos tokens are a cached prefix.
    ``tiling``: the launcher's (None: its default).
    ``key_scale``: positions -> powers of two the keys at those positions are multiplied by (exact in
    bf16), to steer where each row's max lies.
    ``table_pages``: the block table's width (padded with page 0 past the sequences' pages), else the
    longest sequence's pages plus one."""
    num_heads = group * num_kv_heads
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    cache = PagedCache(rng, [start + n for start, n in seqs], num_kv_heads, head_dim)
    if key_scale is not None:
        pool = cache.k_pool.reshape(-1, num_kv_heads, head_dim)  # (pages * PAGE_SIZE, KVH, HD) view
        for s, (start, n) in enumerate(seqs):
            positions = np.arange(start + n)
            factor = np.asarray(key_scale(positions), np.float32)[:, None, None]
            cache.k[s] *= factor
            pool[cache.kv_indices(s, positions)] *= factor
    cu_seqlens = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    start_pos = np.array([start for start, _ in seqs], np.int32)
    q = rng.standard_normal((cu_seqlens[-1], num_heads, head_dim)).astype(np.float32)
    out = nan_device(q.shape)
    k_cache, v_cache, block_tables = cache.device()
    if table_pages is not None:
        wide = np.zeros((len(seqs), table_pages), np.int32)
        wide[:, : cache.block_tables.shape[1]] = cache.block_tables
        block_tables = cuda.to_device(wide)
    launcher(cuda.to_device(q), k_cache, v_cache, block_tables, cuda.to_device(cu_seqlens), cuda.to_device(start_pos),
             scale, out, tiling=tiling)
    got = out.copy_to_host()
    q_bf16 = q.astype(BF16).astype(np.float32)
    for s, (start, n) in enumerate(seqs):
        rows = slice(cu_seqlens[s], cu_seqlens[s + 1])
        positions = start + np.arange(n)
        want = reference_attention(q_bf16[rows], cache.k[s], cache.v[s], positions, scale)
        bound = P_BOUND * reference_attention(q_bf16[rows], cache.k[s], np.abs(cache.v[s]), positions, scale) + PREFILL_ATOL
        err = np.abs(got[rows] - want)
        assert not np.isnan(got[rows]).any(), f"sequence {s}: NaN in the output ({start} cached + {n} new)"
        worst = np.unravel_index(np.argmax(err / bound), err.shape)
        assert (err <= bound).all(), (
            f"sequence {s} ({start} cached + {n} new): error {err[worst]:.3g} > bound {bound[worst]:.3g} "
            f"at (token, head, dim) {worst}"
        )
