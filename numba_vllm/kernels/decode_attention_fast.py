"""Paged decode attention tuned for memory bandwidth; ``decode_attention.py`` is its readable reference.

It computes what ``decode_attention`` computes (read that module first: the lane mapping, the
online softmax and the merge of partial states are the same), for the same inputs:

    out[b, h] = sum_j softmax_j(scale * q[b, h] . K[j]) * V[j],   j = 0 .. context_lens[b] - 1

over the bf16 pools ``k_cache``/``v_cache`` ``(num_pages, PAGE_SIZE, KVH, HD)`` through
``block_tables``. A block per (kv head, sequence[, split]) serves the ``group`` query heads of its kv
head, so each K/V element is loaded once and used ``group`` times; a lane holds 8 dims of one token
(one 16-byte load), a warp handles a step of tokens (a page at HD 64) at a time.

Why a second kernel. A decode step reads every cached K/V byte once, so the kernel should run at
the memory's bandwidth, but with a GQA group of 4 each 4 bytes of K and V cost 8 fused multiply-adds
plus conversions, shuffles and exponentials: the reference spends ~800 instructions per 4 KiB step
of a warp and becomes issue-bound well below the bandwidth. This one differs in:

- Base-2 softmax: q is pre-multiplied by ``scale * log2(e)``, so a probability is one hardware
  ``ex2`` (``exp2_approx``) where ``math.exp`` costs about eight instructions.
- Lazy rescaling: the running max ``m`` moves only when a step's max exceeds it by more than
  ``RESCALE_THRESHOLD`` (8, in log2 units), so probabilities are at most 2^8 and the
  ``exp(m_old - m_new)`` rescale of the accumulators (9 multiplies per head) almost never runs. The
  result is the same softmax; only rounding differs.
- Flat addressing: the pools are passed flattened and the kv head count is a compile-time constant,
  so a step's eight loads are one base address plus constant offsets (the reference spends ~100
  integer instructions a step on 64-bit index arithmetic).
- L2 prefetch (``PREFETCH``): while a warp computes a step it asks L2 for the next step's K/V rows
  (``prefetch_l2``: no registers), page ids being looked up two steps ahead. (Measured on an H200:
  within 3% either way.)
- Masking on words: a token past the context has its K words zeroed before any arithmetic (4 selects
  per load instead of 8 on floats), its score is ``-inf`` and its ``p * V`` is skipped.
- The split over the context (flash-decoding) is chosen by the grid's fill for every batch size and
  context (``pick_split``), not only for tables of 64+ pages: a grid of ``B * KVH`` blocks that
  would leave multiprocessors idle is cut into ranges of ``pages_per_split`` pages.

Split rule (``pick_split``, shapes only: a CUDA graph replays the grid). No split when the grid
already holds ``BLOCKS_PER_SM`` blocks per multiprocessor. Else ``pages_per_split`` is the least
that gives every warp a step (``NUM_WARPS`` pages at HD 64), doubled for every doubling of the grid
past ``SPLIT_REF_BLOCKS`` blocks (a larger batch needs fewer splits to fill the GPU), and raised (in
powers of two) until there are at most ``max_splits`` ranges: ``MAX_SPLITS``, fewer when
``splits * B * KVH`` would pass ``MAX_SPLIT_BLOCKS`` (which bounds the workspace). Llama 3.2 1B on
an H200 (132 SMs): batch 1 at 1,024 tokens, 16 ranges of 4 pages (128 blocks); batch 1 at 16,384,
32 ranges of 32 pages; batch 4 at 4,096, 16 ranges of 16 pages; batch 32 at 4,096, 2 ranges of 128
pages; batch 64 and up, no split. (Measured on an H200 at Llama 3.2 1B's heads: half as many
ranges as with ``SPLIT_REF_BLOCKS`` 16 was as fast or faster at every batch, up to 13% at 4 x 4,096;
fewer, longer ranges let the L2 prefetch run ahead and cost the merge less.)
``pages_per_split`` depends on the table width only through the ``max_splits`` cap, in powers of
two, so a table padded to the next power of two (as the engine's CUDA graphs pad it) gets the same
ranges plus empty ones, which add exact zeros in the merge: bit-identical results. The kernel gets
``pages_per_split`` as an argument.

The split kernel writes each block's partial state (unnormalised ``sum p * V``, the max ``m`` in
log2 units, the sum of ``p``) to ``partials`` ``(splits * B, H, HD + 2)`` (row ``z * B + b``) and
``decode_attention_fast_merge_kernel`` merges the splits of each (b, h) in split order
(deterministic) and writes ``out``.

Registers: group 4 at HD 64 holds q and the accumulators (64 words), a step's scores (16) and its
K/V words (32); the kernel is capped at ``MAX_REGISTERS`` (24 bytes spill) so that
``BLOCKS_PER_SM`` blocks of ``NUM_WARPS`` warps fit a multiprocessor. A warp's step is ~630
instructions (the reference's ~790; ptxas SASS of the loop), still issue-bound: on an H200 it runs
64 x 1,024 tokens in 52.9 us (2.5 TB/s of K/V) and 256 x 512 in 96.8 us, against 68.7 and 139.6 for
the reference (``decode_attention_tc``'s docstring has the table). The model runs
``decode_attention_tc``; this kernel serves the head dims that one does not (and is its fallback).
Measured and dropped: register double-buffering of the next step (207 registers, 2 blocks per SM);
8-warp blocks; no register cap (158 registers, 3 blocks per SM: 64 x 1,024 in 64 us).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, uint32

from numba_vllm.kernels._launch import KernelError, check_array, launch, num_sms
from numba_vllm.kernels.approx_math import exp2_approx
from numba_vllm.kernels.jit import device_function, kernel
from numba_vllm.kernels.kept_views import flat_bits, leading_block
from numba_vllm.kernels.reductions import FULL_MASK, WARP_SIZE
from numba_vllm.kernels.vector_load import BF16_PER_VECTOR, bf16x2_to_f32, load_u32x4, prefetch_l2
from numba_vllm.loading.bf16 import BF16
from numba_vllm.model.config import PAGE_SIZE

NUM_WARPS = 4  # warps per block
BLOCKS_PER_SM = 4  # blocks of NUM_WARPS warps a multiprocessor holds at MAX_REGISTERS: a grid this full is not split
MAX_REGISTERS = 128  # per thread when group <= 4 (65536 / (4 blocks x 128 threads))
PREFETCH = True  # ask L2 for the next step's K/V rows while computing the current step
RESCALE_THRESHOLD = float32(8.0)  # log2 units: the running max moves when a step's max passes it by this much
SPLIT_REF_BLOCKS = 8  # grids up to this many blocks get the shortest ranges; pages per range double per doubling past it
MAX_SPLITS = 32  # ranges per sequence at most (see decode_attention_tc's docstring for why not 64) ...
MAX_SPLIT_BLOCKS = 4096  # ... and splits x B x KVH at most (bounds the workspace)
MERGE_THREADS = 128  # threads per block of the merge kernel, one per (b, h, d) output
MERGE_CHUNK = 16  # ranges whose states a merge thread loads at once (independent loads in flight)
VEC = BF16_PER_VECTOR  # bf16 values per lane per 16-byte load
MAX_LOADS_PER_STEP = 4  # K loads (and V loads) per lane per step
MAX_GROUP = 8  # query heads per kv head
SUPPORTED_HEAD_DIMS = (8, 16, 32, 64, 128, 256)
LOG2E = 1.4426950408889634  # q . k * scale * log2(e): scores in base 2


def step_tokens(head_dim: int) -> tuple[int, int, int]:
    """(tokens_per_load, step, loads) for ``head_dim``: tokens one warp load covers, tokens a warp
    handles per step (HD 64: a page; HD 128: half a page; HD 8: two pages), loads per lane per step."""
    tokens_per_load = WARP_SIZE // (head_dim // VEC)
    step = max(min(PAGE_SIZE, MAX_LOADS_PER_STEP * tokens_per_load), tokens_per_load)
    return tokens_per_load, step, step // tokens_per_load


@functools.cache
def decode_attention_fast_kernel_for(group: int, head_dim: int, num_kv_heads: int, num_warps: int = NUM_WARPS,
                                     split: bool = False, prefetch: bool = PREFETCH,
                                     max_registers: int | None = MAX_REGISTERS):  # fmt: skip
    """The kernel for ``group`` query heads per kv head, ``head_dim``, ``num_kv_heads`` (a
    compile-time constant, so the addresses of a step's loads are one base plus constant offsets),
    blocks of ``num_warps`` warps; ``split``: write partial states of a page range instead of
    ``out``; ``prefetch``: ask L2 for the next step's K/V while computing this one;
    ``max_registers``: the per-thread cap (None: the compiler's choice)."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise KernelError(f"decode_attention_fast: head_dim {head_dim} not supported (one of {SUPPORTED_HEAD_DIMS})")
    if not 1 <= group <= MAX_GROUP:
        raise KernelError(f"decode_attention_fast: {group} query heads per kv head, at most {MAX_GROUP}")
    lanes_per_token = head_dim // VEC  # lanes sharing one token's row (HD 64: 8)
    tokens_per_load, step, loads = step_tokens(head_dim)
    num_partials = num_warps * tokens_per_load  # lanes' softmax states to merge per (head, dim)
    q_len = group * VEC  # per-lane register arrays: q and acc, (group, VEC) flattened
    num_scores = loads * group  # (loads, group) flattened
    num_words = loads * 4  # (loads, 4): 16 bytes of K (or V) per load
    threads = num_warps * WARP_SIZE
    token_stride = num_kv_heads * head_dim  # elements from one token's row to the next in a page
    page_stride = PAGE_SIZE * token_stride
    load_stride = tokens_per_load * token_stride  # elements between a lane's loads in a step
    minus_inf = float32(-math.inf)
    merge_block = block_merge_for(num_partials, group, head_dim, threads, split)

    @kernel(max_registers=max_registers)
    def decode_attention_fast_kernel(q, k_cache, v_cache, block_tables, context_lens, scale_log2, pages_per_split, out):
        """q: (B, H, HD) f32; k_cache, v_cache: (P * PAGE_SIZE * KVH * HD,) uint16, the bf16 pools'
        bits flattened; block_tables: (B, max_pages) int32; context_lens: (B,) int32; scale_log2:
        f32, the softmax scale times log2(e); pages_per_split: int32 (split only); out: (B, H, HD)
        f32, or with ``split`` the partial states (splits * B, H, HD + 2) f32."""
        kv_head = cuda.blockIdx.x
        b = cuda.blockIdx.y
        warp = cuda.threadIdx.x // WARP_SIZE
        lane = cuda.threadIdx.x % WARP_SIZE
        token_slot = lane // lanes_per_token  # which token of a warp load this lane reads
        d0 = (lane % lanes_per_token) * VEC  # first of the lane's 8 dims
        lane_offset = token_slot * token_stride + kv_head * head_dim + d0  # of its first load, in a page
        context_len = context_lens[b]
        if split:  # the tokens of pages [z * pages_per_split, (z + 1) * pages_per_split) in the context
            start = cuda.blockIdx.z * pages_per_split * PAGE_SIZE
            end = min(context_len, start + pages_per_split * PAGE_SIZE)
        else:
            start = 0
            end = context_len
        last_page = (end - 1) // PAGE_SIZE  # the block's last page slot
        num_steps = (end - start + step - 1) // step  # <= 0 for an empty split

        q_reg = cuda.local.array(q_len, float32)  # (group, VEC): the lane's dims of each query head, scaled
        acc = cuda.local.array(q_len, float32)  # (group, VEC): sum of 2^(score - m) * V
        m = cuda.local.array(group, float32)  # running max score (log2 units) per query head, lazily raised
        sum_exp = cuda.local.array(group, float32)  # running sum of 2^(score - m)
        scores = cuda.local.array(num_scores, float32)  # (loads, group): this step's scores
        k_words = cuda.local.array(num_words, uint32)  # (loads, 4): the step's K, bf16 pairs
        v_words = cuda.local.array(num_words, uint32)  # (loads, 4): the step's V, bf16 pairs
        for g in range(group):
            h = kv_head * group + g
            for e in range(VEC):
                q_reg[g * VEC + e] = q[b, h, d0 + e] * scale_log2
                acc[g * VEC + e] = float32(0.0)
            m[g] = minus_inf
            sum_exp[g] = float32(0.0)

        # Step si's tokens share one page (HD 8: lanes 16-31 read the second); a page slot past the
        # block's tokens (HD 8) is replaced by its last one: those tokens are masked. Page ids are
        # looked up two steps ahead of the loads: the next one's is needed for its prefetch.
        si = warp
        page = 0
        if si < num_steps:
            page = block_tables[b, min((start + si * step + token_slot) // PAGE_SIZE, last_page)]
        next_page = 0
        if si + num_warps < num_steps:
            next_page = block_tables[b, min((start + (si + num_warps) * step + token_slot) // PAGE_SIZE, last_page)]
        while si < num_steps:
            nxt = si + num_warps
            # the step's first row in its page: 0 unless a step is part of a page (HD 128+)
            base = page * page_stride + ((si * step) % PAGE_SIZE) * token_stride + lane_offset
            if step > PAGE_SIZE:  # HD 8: lane token_slot reads row token_slot % PAGE_SIZE of its page
                base -= (token_slot // PAGE_SIZE) * page_stride
            for i in range(loads):  # a step's K and V loads all issued before the first score
                kw = load_u32x4(k_cache, base + i * load_stride)
                vw = load_u32x4(v_cache, base + i * load_stride)
                for w in range(4):
                    k_words[i * 4 + w] = kw[w]
                    v_words[i * 4 + w] = vw[w]
            if prefetch and nxt < num_steps:
                ahead = next_page * page_stride + ((nxt * step) % PAGE_SIZE) * token_stride + lane_offset
                if step > PAGE_SIZE:
                    ahead -= (token_slot // PAGE_SIZE) * page_stride
                for i in range(loads):
                    prefetch_l2(k_cache, ahead + i * load_stride)
                    prefetch_l2(v_cache, ahead + i * load_stride)
            page = next_page
            if nxt + num_warps < num_steps:
                next_page = block_tables[b, min((start + (nxt + num_warps) * step + token_slot) // PAGE_SIZE, last_page)]
            first = start + si * step

        # Scores: q . K over the lane's 8 dims, summed over the token's lanes by butterfly shuffles.
            for i in range(loads):
                pos = first + i * tokens_per_load + token_slot
                w0, w1, w2, w3 = k_words[i * 4], k_words[i * 4 + 1], k_words[i * 4 + 2], k_words[i * 4 + 3]
                if pos >= end:  # an unwritten slot may hold any bits (NaN, inf): zero them before the arithmetic
                    w0 = w1 = w2 = w3 = uint32(0)
                k0, k1 = bf16x2_to_f32(w0)
                k2, k3 = bf16x2_to_f32(w1)
                k4, k5 = bf16x2_to_f32(w2)
                k6, k7 = bf16x2_to_f32(w3)
                for g in range(group):
                    j = g * VEC
                    s = (q_reg[j] * k0 + q_reg[j + 1] * k1 + q_reg[j + 2] * k2 + q_reg[j + 3] * k3
                         + q_reg[j + 4] * k4 + q_reg[j + 5] * k5 + q_reg[j + 6] * k6 + q_reg[j + 7] * k7)
                    offset = 1
                    while offset < lanes_per_token:
                        s += cuda.shfl_xor_sync(FULL_MASK, s, offset)
                        offset *= 2
                    scores[i * group + g] = s if pos < end else minus_inf

            # Raise the running max only when the step's max passes it by RESCALE_THRESHOLD.
            for g in range(group):
                m_step = scores[g]
                for i in range(1, loads):
                    m_step = max(m_step, scores[i * group + g])
                if m_step > m[g] + RESCALE_THRESHOLD:  # false while this lane has seen no valid token
                    alpha = exp2_approx(m[g] - m_step)  # 0 on the first valid token (m = -inf)
                    sum_exp[g] *= alpha
                    for e in range(VEC):
                        acc[g * VEC + e] *= alpha
                    m[g] = m_step

            # p * V: the lane holds V of the token whose scores it has.
            for i in range(loads):
                pos = first + i * tokens_per_load + token_slot
                if pos < end:
                    v0, v1 = bf16x2_to_f32(v_words[i * 4])
                    v2, v3 = bf16x2_to_f32(v_words[i * 4 + 1])
                    v4, v5 = bf16x2_to_f32(v_words[i * 4 + 2])
                    v6, v7 = bf16x2_to_f32(v_words[i * 4 + 3])
                    for g in range(group):
                        p = exp2_approx(scores[i * group + g] - m[g])
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
            si = nxt

        # Merge the lanes' partial softmaxes through shared memory, one partial per token slot.
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
        cuda.syncthreads()

        merge_block(out, part_m, part_sum, part_acc, kv_head, b)

    return decode_attention_fast_kernel


@functools.cache
def block_merge_for(num_partials: int, group: int, head_dim: int, threads: int, split: bool):
    """The device function that ends both fast decode kernels (this file's and decode_attention_tc's):
    a block's ``num_partials`` partial softmax states of its kv head's ``group`` query heads, in shared
    memory (part_m, part_sum (num_partials, group) f32, m in log2 units; part_acc (num_partials, group,
    HD) f32 unnormalised sums), merged into ``out``, each of the block's ``threads`` threads taking
    outputs (head g, dim d) in turn: out[b, h] (B, H, HD) f32, or with ``split`` this page range's
    unnormalised state in row ``blockIdx.z * gridDim.y + b`` of the (splits * B, H, HD + 2) partials.
    Call after the block's barrier. The sizes are compile-time constants of the kernels that call it."""
    minus_inf = float32(-math.inf)

    @device_function
    def merge_block(out, part_m, part_sum, part_acc, kv_head, b):
        o = cuda.threadIdx.x
        while o < group * head_dim:
            g = o // head_dim
            d = o % head_dim
            m_all = minus_inf
            for p in range(num_partials):
                m_all = max(m_all, part_m[p, g])
            total_sum = float32(0.0)
            total = float32(0.0)
            for p in range(num_partials):
                if part_m[p, g] > minus_inf:  # partials that saw no token add nothing
                    w = exp2_approx(part_m[p, g] - m_all)
                    total_sum += w * part_sum[p, g]
                    total += w * part_acc[p, g, d]
            h = kv_head * group + g
            if split:  # this range's state, unnormalised; an empty range writes m = -inf, sums 0
                row = cuda.blockIdx.z * cuda.gridDim.y + b
                out[row, h, d] = total
                if d == 0:
                    out[row, h, head_dim] = m_all
                    out[row, h, head_dim + 1] = total_sum
            else:
                out[b, h, d] = total / total_sum
            o += threads

    return merge_block


@kernel
def decode_attention_fast_merge_kernel(partials, out):
    """out (B, H, HD) f32 = the merge of the ranges' partial states partials (splits * B, H, HD + 2)
    f32 (row z * B + b: HD unnormalised sums, then m in log2 units and the sum of 2^(score - m)).

    Thread ``blockIdx.x * blockDim.x + threadIdx.x`` owns output (b, h, d). It takes the ranges
    ``MERGE_CHUNK`` at a time: the chunk's loads (m, the sum and its dim's sum of each range) are all
    issued before any is used, so a 32-range merge waits on memory twice, not 64 times; then it
    moves its running max to the chunk's, rescaling what it has (only when the max moved), and adds
    the chunk's states in split order (deterministic). Range 0 always holds a token, so the max is
    finite after the first chunk; an empty state (m = -inf, sums 0), like a missing range past
    ``splits``, adds 2^-inf * 0 = 0 exactly: a padded table's extra ranges change no bit.
    """
    batch, num_heads, head_dim = out.shape
    splits = partials.shape[0] // batch
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < batch * num_heads * head_dim:
        b = i // (num_heads * head_dim)
        h = i // head_dim % num_heads
        d = i % head_dim
        chunk_m = cuda.local.array(MERGE_CHUNK, float32)
        chunk_sum = cuda.local.array(MERGE_CHUNK, float32)
        chunk_acc = cuda.local.array(MERGE_CHUNK, float32)
        m_all = float32(-math.inf)
        total_sum = float32(0.0)
        total = float32(0.0)
        for z0 in range(0, splits, MERGE_CHUNK):
            for j in range(MERGE_CHUNK):  # the chunk's loads, all in flight at once
                chunk_m[j] = float32(-math.inf)
                chunk_sum[j] = float32(0.0)
                chunk_acc[j] = float32(0.0)
                if z0 + j < splits:
                    row = (z0 + j) * batch + b
                    chunk_m[j] = partials[row, h, head_dim]
                    chunk_sum[j] = partials[row, h, head_dim + 1]
                    chunk_acc[j] = partials[row, h, d]
            m_new = m_all
            for j in range(MERGE_CHUNK):
                m_new = max(m_new, chunk_m[j])
            if m_new > m_all:  # 0 on the first chunk (m_all = -inf, nothing added yet)
                alpha = exp2_approx(m_all - m_new)
                total_sum *= alpha
                total *= alpha
                m_all = m_new
            for j in range(MERGE_CHUNK):
                w = exp2_approx(chunk_m[j] - m_all)
                total_sum += w * chunk_sum[j]
                total += w * chunk_acc[j]
        out[b, h, d] = total / total_sum


def launched_kernel(group: int, head_dim: int, num_kv_heads: int, split: bool = False):
    """The build the launcher runs for these heads: the module's warps and prefetch, the register
    cap for groups up to 4 (larger groups need more registers than the cap and get no cap)."""
    registers = MAX_REGISTERS if group <= 4 else None
    return decode_attention_fast_kernel_for(group, head_dim, num_kv_heads, NUM_WARPS, split, PREFETCH, registers)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def pick_split(num_blocks: int, width: int, min_pages: int) -> tuple[int, int]:
    """(splits, pages_per_split) for ``num_blocks = B * KVH`` blocks over a block table ``width``
    pages wide, ranges of at least ``min_pages`` pages (a step for every warp of a block; module
    docstring: the rule). (1, width) means no split. Shapes only."""
    if num_blocks >= BLOCKS_PER_SM * num_sms():
        return 1, width
    pages = min_pages * _pow2_at_least(-(-num_blocks // SPLIT_REF_BLOCKS))
    max_splits = 1 << (max(1, min(MAX_SPLITS, MAX_SPLIT_BLOCKS // num_blocks)).bit_length() - 1)  # a power of two
    pages = max(pages, _pow2_at_least(-(-width // max_splits)))
    splits = -(-width // pages)
    return (1, width) if splits == 1 else (splits, pages)


def min_split_pages(head_dim: int) -> int:
    """The shortest range for this kernel: a step for every warp (``NUM_WARPS`` pages at HD 64)."""
    return max(1, NUM_WARPS * step_tokens(head_dim)[1] // PAGE_SIZE)


def split_workspace_floats(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Floats of scratch any split launch for these heads needs at most: ``MAX_SPLIT_BLOCKS``
    blocks' partial states of ``group x (HD + 2)`` floats."""
    return MAX_SPLIT_BLOCKS * (num_heads // num_kv_heads) * (head_dim + 2)


def decode_attention_fast(q, k_cache, v_cache, block_tables, context_lens, scale: float, out, workspace=None) -> None:
    """Paged attention of one query token per sequence over its cached K/V (``decode_attention``'s
    contract: q (B, H, HD) f32; k_cache, v_cache (num_pages, PAGE_SIZE, KVH, HD) bf16; block_tables
    (B, max_pages) int32; context_lens (B,) int32, each in 1 .. max_pages * PAGE_SIZE; out (B, H, HD)
    f32). A grid that leaves the GPU idle is split over the context (``pick_split``: shapes only, so
    the launch can be recorded in a CUDA graph). ``workspace``: (>= split_workspace_floats(H, KVH,
    HD),) f32 device scratch for the ranges' partial states; without one a split launch allocates it.
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
        raise KernelError(f"decode_attention_fast: {num_heads} query heads not a multiple of {num_kv_heads} kv heads")
    if batch == 0:
        return
    group = num_heads // num_kv_heads
    splits, pages_per_split = pick_split(batch * num_kv_heads, block_tables.shape[1], min_split_pages(head_dim))
    attention = launched_kernel(group, head_dim, num_kv_heads, splits > 1)
    # the kernel reads the caches 16 bytes at a time through their bits, flattened
    args = (q, flat_bits(k_cache), flat_bits(v_cache), block_tables, context_lens, np.float32(scale * LOG2E),
            np.int32(pages_per_split))  # fmt: skip
    threads = NUM_WARPS * WARP_SIZE
    if splits == 1:
        launch(attention, (num_kv_heads, batch), threads, *args, out)
        return
    launch_split_merge(attention, (num_kv_heads, batch, splits), threads, args, out, workspace)


def launch_split_merge(attention, grid, threads: int, args, out, workspace) -> None:
    """Run a split build of an attention kernel over ``grid = (KVH, B, splits)`` with ``args`` (all
    but the output) into partials carved from ``workspace`` (allocated if None), then the merge into
    ``out`` (B, H, HD)."""
    splits = grid[2]
    batch, num_heads, head_dim = out.shape
    shape = (splits * batch, num_heads, head_dim + 2)
    if workspace is None:
        partials = cuda.device_array(shape, np.float32)
    elif math.prod(shape) > workspace.shape[0]:  # (pick_split keeps it within MAX_SPLIT_BLOCKS)
        raise KernelError(f"decode attention: a {splits}-way split of {batch} x {num_heads} heads exceeds the workspace")
    else:
        partials = leading_block(workspace, shape)  # a view kept per shape (kept_views: host time)
    launch(attention, grid, threads, *args, partials)
    outputs = batch * num_heads * head_dim
    launch(decode_attention_fast_merge_kernel, (-(-outputs // MERGE_THREADS),), MERGE_THREADS, partials, out)
