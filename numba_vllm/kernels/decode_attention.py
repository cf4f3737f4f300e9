"""Paged decode attention: one new query token per sequence against its cached keys and values.

For sequence ``b`` and query head ``h`` (kv head ``h // group``), with ``n = context_lens[b]``
cached tokens (the current token included):

    out[b, h] = sum_j softmax_j(scale * q[b, h] . K[j]) * V[j],   j = 0 .. n - 1

where token ``j`` lives in page ``block_tables[b, j // PAGE_SIZE]`` at offset ``j % PAGE_SIZE``
of the bf16 pools ``k_cache``/``v_cache`` ``(num_pages, PAGE_SIZE, KVH, HD)``.

Thread mapping. A thread block per (kv head, sequence): grid ``(KVH, B)``, ``NUM_WARPS`` (4)
warps, or ``SMALL_GRID_WARPS`` (8) when the grid is too small to fill the GPU (a small batch).
The block serves all ``group = H // KVH`` query heads that share the kv head, so every K/V element
is read from memory once and used ``group`` times from registers.

- A *step* is the tokens one warp handles at a time: ``MAX_LOADS_PER_STEP`` warp loads' worth,
  at most a page (HD 64: a page of 16 tokens; HD 128: half a page), or two pages when ``HD == 8``.
  Warp ``w`` takes steps ``w, w + num_warps, ...`` (so the block's warps walk a sequence's pages
  together: the context is split across warps), looking each page id up one step ahead.
- One 16-byte load (``load_u32x4``) gives a lane 8 bf16 of one token's K row. A token's row of
  ``HD`` values is spread over ``LANES_PER_TOKEN = HD / 8`` neighbouring lanes, so a warp load
  covers ``TOKENS_PER_LOAD = 32 / LANES_PER_TOKEN`` tokens (HD 64: 8 lanes a token, 4 tokens a
  load, 4 loads a page) and reads whole 128-byte rows: coalesced.
- Scores: each lane multiplies its 8 K values by the same 8 dims of every query head of the
  group (q is held in registers, pre-multiplied by ``scale``), and the lanes of a token add their
  partial dot products with ``log2(LANES_PER_TOKEN)`` butterfly shuffles, which leaves the score
  in all of them.
- V is read with the same mapping, so a lane holds V of exactly the token whose score it has:
  it accumulates ``p * V`` for its 8 dims without any exchange. A step's K and V loads are all
  issued before the first score is computed (V kept as raw words until needed), so 4 KiB per
  warp are in flight at once: decode attention is bound by memory latency x bytes in flight.
- Online softmax per lane: each lane keeps, per query head, a running max ``m``, a running sum
  ``sum_exp`` of ``exp(score - m)``, and its 8 dims of ``sum exp(score - m) * V``. A step's scores are
  folded in at once: one rescale by ``exp(m_old - m_new)`` per step, not per token.

Combination. The lanes' states are partial softmaxes over disjoint token sets; a query head's
result is their merge (rescale each to the common max, then add). Each lane writes its state to
shared memory (``part_*``: one partial per (warp, token slot of a load)), ``syncthreads``, then
each thread merges the partials of some (head, dim) outputs and writes ``acc / sum_exp``.
Shared memory: ``num_warps * TOKENS_PER_LOAD * group * (HD + 2)`` float32 (group 4, HD 64, 4 warps:
16.5 KiB).

Registers: group 4 at HD 64 needs ~160 registers a thread; the kernel is capped at
``MAX_REGISTERS`` (128, a few words spill to L1) so that 4 blocks share a multiprocessor and
64 sequences x 8 kv heads run in one wave: measured faster on an H200 than no spill at 3 blocks.

Head dims: ``HD = 8 * 2^k`` from 8 to 256 (one token's row must fit one warp in 16-byte pieces);
``group`` up to ``MAX_GROUP``. The kernel is compiled per (group, HD) by
``decode_attention_kernel_for``, because the per-lane register arrays need compile-time sizes
(a run-time size would put them in slow local memory).

Tokens past the context (the unused tail of the last page) are masked before they touch the
softmax, so garbage or NaN there never reaches the output; pages past the context are never read.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from numba_vllm.bf16 import BF16
from numba_vllm.config import PAGE_SIZE
from numba_vllm.kernels.jit import kernel
from numba_vllm.kernels.launch import KernelError, check_array, launch
from numba_vllm.kernels.reductions import FULL_MASK, WARP_SIZE
from numba_vllm.kernels.vector_load import BF16_PER_VECTOR, bf16x2_to_f32, load_u32x4

NUM_WARPS = 4  # warps per block: a block per (kv head, sequence); 64 seqs x 8 kv heads = 512 blocks
SMALL_GRID_WARPS = 8  # warps per block when there are few blocks (small batches), if group <= 4
SMALL_GRID_BLOCKS = 264  # "few": fewer than two blocks per multiprocessor of an H200 (132)
MAX_REGISTERS = 128  # per thread when group <= 4: 4 blocks of 4 warps fit a multiprocessor
VEC = BF16_PER_VECTOR  # bf16 values per lane per 16-byte load
MAX_LOADS_PER_STEP = 4  # K loads per lane per step: more unrolled code no longer fits registers
MAX_GROUP = 8  # query heads per kv head: bounds registers (2 * 8 * group per lane) and shared memory
SUPPORTED_HEAD_DIMS = (8, 16, 32, 64, 128, 256)


@functools.cache
def decode_attention_kernel_for(group: int, head_dim: int, num_warps: int = NUM_WARPS):
    """The decode attention kernel for ``group`` query heads per kv head, ``head_dim``, and
    blocks of ``num_warps`` warps."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise KernelError(f"decode_attention: head_dim {head_dim} not supported (one of {SUPPORTED_HEAD_DIMS})")
    if not 1 <= group <= MAX_GROUP:
        raise KernelError(f"decode_attention: {group} query heads per kv head, at most {MAX_GROUP}")
    lanes_per_token = head_dim // VEC  # lanes sharing one token's row (HD 64: 8)
    tokens_per_load = WARP_SIZE // lanes_per_token  # tokens one warp load covers (HD 64: 4)
    # tokens a warp handles per step (HD 64: a page; HD 128: half a page; HD 8: two pages)
    step = max(min(PAGE_SIZE, MAX_LOADS_PER_STEP * tokens_per_load), tokens_per_load)
    loads = step // tokens_per_load  # K loads (and V loads) per lane per step (HD 64: 4)
    num_partials = num_warps * tokens_per_load  # lanes' softmax states to merge per (head, dim)
    q_len = group * VEC  # per-lane register arrays: q and acc, (group, VEC) flattened
    num_scores = loads * group  # (loads, group) flattened
    num_v_words = loads * 4  # (loads, 4): 16 bytes of V per load
    threads = num_warps * WARP_SIZE
    minus_inf = float32(-math.inf)

    @kernel(max_registers=MAX_REGISTERS if group <= 4 else None)
    def decode_attention_kernel(q, k_cache, v_cache, block_tables, context_lens, scale, out):
        """q, out: (B, H, HD) f32; k_cache, v_cache: (P, PAGE_SIZE, KVH, HD) uint16 (bf16 bits);
        block_tables: (B, max_pages) int32; context_lens: (B,) int32; scale: f32."""
        kv_head = cuda.blockIdx.x
        b = cuda.blockIdx.y
        warp = cuda.threadIdx.x // WARP_SIZE
        lane = cuda.threadIdx.x % WARP_SIZE
        token_slot = lane // lanes_per_token  # which token of a warp load this lane reads
        d0 = (lane % lanes_per_token) * VEC  # first of the lane's 8 dims
        context_len = context_lens[b]
        num_pages = (context_len + PAGE_SIZE - 1) // PAGE_SIZE
        num_steps = (context_len + step - 1) // step

        q_reg = cuda.local.array(q_len, float32)  # (group, VEC): the lane's dims of each query head
        acc = cuda.local.array(q_len, float32)  # (group, VEC): sum of exp(score - m) * V
        m = cuda.local.array(group, float32)  # running max score per query head
        sum_exp = cuda.local.array(group, float32)  # running sum of exp(score - m)
        scores = cuda.local.array(num_scores, float32)  # (loads, group): this step's scores
        v_words = cuda.local.array(num_v_words, np.uint32)  # (loads, 4): this step's V, bf16 pairs
        for g in range(group):
            h = kv_head * group + g
            for e in range(VEC):
                q_reg[g * VEC + e] = q[b, h, d0 + e] * scale
                acc[g * VEC + e] = float32(0.0)
            m[g] = minus_inf
            sum_exp[g] = float32(0.0)

        # A step's tokens share one page, except for HD 8 where lanes 16-31 read the second page;
        # a page past the context (HD 8) is replaced by the last one: its tokens are masked anyway.
        si = warp
        page_slot = (si * step + token_slot) // PAGE_SIZE
        next_page = block_tables[b, min(page_slot, num_pages - 1)] if si < num_steps else 0
        while si < num_steps:
            page = next_page
            if si + num_warps < num_steps:  # fetch the next step's page id now, use it then
                page_slot = ((si + num_warps) * step + token_slot) // PAGE_SIZE
                next_page = block_tables[b, min(page_slot, num_pages - 1)]
            first = si * step

            # Scores of the step's tokens: q . K, summed over the token's lanes. V is loaded here
            # too (kept as raw words), so its memory latency overlaps K's instead of following it.
            for i in range(loads):
                pos = first + i * tokens_per_load + token_slot
                words = load_u32x4(v_cache, (page, pos % PAGE_SIZE, kv_head, d0))
                for w in range(4):
                    v_words[i * 4 + w] = words[w]
                words = load_u32x4(k_cache, (page, pos % PAGE_SIZE, kv_head, d0))
                k0, k1 = bf16x2_to_f32(words[0])
                k2, k3 = bf16x2_to_f32(words[1])
                k4, k5 = bf16x2_to_f32(words[2])
                k6, k7 = bf16x2_to_f32(words[3])
                for g in range(group):
                    j = g * VEC
                    s = (q_reg[j] * k0 + q_reg[j + 1] * k1 + q_reg[j + 2] * k2 + q_reg[j + 3] * k3
                         + q_reg[j + 4] * k4 + q_reg[j + 5] * k5 + q_reg[j + 6] * k6 + q_reg[j + 7] * k7)
                    offset = 1
                    while offset < lanes_per_token:
                        s += cuda.shfl_xor_sync(FULL_MASK, s, offset)
                        offset *= 2
                    scores[i * group + g] = s if pos < context_len else minus_inf

            # Fold the step into the running softmax: a new max rescales what was summed so far.
            for g in range(group):
                m_new = m[g]
                for i in range(loads):
                    m_new = max(m_new, scores[i * group + g])
                if m_new > minus_inf:  # else this lane has seen no valid token yet
                    alpha = math.exp(m[g] - m_new)  # 0 on the first valid token (m = -inf)
                    sum_exp[g] *= alpha
                    for e in range(VEC):
                        acc[g * VEC + e] *= alpha
                    m[g] = m_new

            # p * V with the same lane mapping: the lane already holds its token's scores.
            for i in range(loads):
                pos = first + i * tokens_per_load + token_slot
                v0, v1 = bf16x2_to_f32(v_words[i * 4])
                v2, v3 = bf16x2_to_f32(v_words[i * 4 + 1])
                v4, v5 = bf16x2_to_f32(v_words[i * 4 + 2])
                v6, v7 = bf16x2_to_f32(v_words[i * 4 + 3])
                if pos < context_len:
                    for g in range(group):
                        p = math.exp(scores[i * group + g] - m[g])
                        sum_exp[g] += p
                        j = g * VEC
                        acc[j] += p * v0
                        acc[j + 1] += p * v1
                        acc[j + 2] += p * v2
                        acc[j + 3] += p * v3
                        acc[j + 4] += p * v4
                        acc[j + 5] += p * v5
                        acc[j + 6] += p * v6
                        acc[j + 7] += p * v7
            si += num_warps

        # Merge the lanes' partial softmaxes: through shared memory, one partial per token slot.
        part_m = cuda.shared.array((num_partials, group), float32)
        part_sum = cuda.shared.array((num_partials, group), float32)
        part_acc = cuda.shared.array((num_partials, group, head_dim), float32)
        part = warp * tokens_per_load + token_slot
        for g in range(group):
            if d0 == 0:  # the token's lanes hold the same m and sum_exp: one writes them
                part_m[part, g] = m[g]
                part_sum[part, g] = sum_exp[g]
            for e in range(VEC):
                part_acc[part, g, d0 + e] = acc[g * VEC + e]
        cuda.syncthreads()  # wait for every lane's partial state

        o = cuda.threadIdx.x
        while o < group * head_dim:  # each thread merges outputs (head g, dim d) in turn
            g = o // head_dim
            d = o % head_dim
            m_all = minus_inf
            for p in range(num_partials):
                m_all = max(m_all, part_m[p, g])
            total_sum = float32(0.0)
            total = float32(0.0)
            for p in range(num_partials):
                if part_m[p, g] > minus_inf:  # partials that saw no token add nothing
                    w = math.exp(part_m[p, g] - m_all)
                    total_sum += w * part_sum[p, g]
                    total += w * part_acc[p, g, d]
            out[b, kv_head * group + g, d] = total / total_sum
            o += threads

    return decode_attention_kernel


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float, out) -> None:
    """Paged attention of one query token per sequence over its cached K/V.

    q: (B, H, HD) f32; k_cache, v_cache: (num_pages, PAGE_SIZE, KVH, HD) bf16;
    block_tables: (B, max_pages) int32; context_lens: (B,) int32, each in 1 .. max_pages * PAGE_SIZE
    (cached tokens, the current one included); scale: usually 1 / sqrt(HD); out: (B, H, HD) f32.
    """
    check_array("q", q, "float32", ndim=3)
    batch, num_heads, head_dim = q.shape
    check_array("k_cache", k_cache, BF16, (None, PAGE_SIZE, None, head_dim))
    num_kv_heads = k_cache.shape[2]
    check_array("v_cache", v_cache, BF16, tuple(k_cache.shape))
    check_array("block_tables", block_tables, "int32", (batch, None))
    check_array("context_lens", context_lens, "int32", (batch,))
    check_array("out", out, "float32", (batch, num_heads, head_dim))
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise KernelError(f"decode_attention: {num_heads} query heads not a multiple of {num_kv_heads} kv heads")
    if batch == 0:
        return
    group = num_heads // num_kv_heads
    # Few blocks (a small batch) leave most multiprocessors idle: give each block more warps,
    # so more of a sequence's pages are in flight at once (shared memory grows with the warps).
    few = batch * num_kv_heads < SMALL_GRID_BLOCKS and group <= 4
    num_warps = SMALL_GRID_WARPS if few else NUM_WARPS
    kernel_ = decode_attention_kernel_for(group, head_dim, num_warps)
    # The kernel reads the caches 16 bytes at a time through their raw uint16 bits.
    launch(kernel_, (num_kv_heads, batch), num_warps * WARP_SIZE, q, k_cache.view(np.uint16), v_cache.view(np.uint16),
           block_tables, context_lens, np.float32(scale), out)
