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
``group`` up to ``MAX_GROUP``. The kernel is compiled per (group, HD, warps, split) by
``decode_attention_kernel_for``, because the per-lane register arrays need compile-time sizes
(a run-time size would put them in slow local memory).

Tokens past the context (the unused tail of the last page) are masked before they touch the
softmax, so garbage or NaN there never reaches the output; pages past the context are never read.

Split context (flash-decoding), for small batches. A grid of ``B * KVH`` blocks under
``SMALL_GRID_BLOCKS`` leaves most multiprocessors idle (batch 1 of Llama 3.2 1B: 8 blocks for 132
SMs, each walking the whole context with its warps). Then each sequence's block-table row is cut
into ``splits`` ranges of ``pages_per_split`` contiguous pages: grid ``(KVH, B, splits)``, block
``(kv head, b, z)`` walks the tokens of pages ``[z * pages_per_split, (z + 1) * pages_per_split)``
that lie in the context exactly as above (same warps, steps and lane mapping: the same kernel,
compiled with ``split``, which only changes the token range and what is written) and merges its
lanes the same way. Instead of ``out`` it writes its partial softmax state per query head: the max
``m``, the sum of ``exp(score - m)`` and the unnormalised ``sum exp(score - m) * V``, to a row of
``partials`` ``(splits * B, H, HD + 2)`` f32 (row ``z * B + b``; the last two columns are ``m``
and the sum). A split that starts past the context has no token: its state is empty (``m = -inf``,
sums 0). ``decode_attention_merge_kernel`` then merges the ``splits`` states of each ``(b, h)`` in
split order (rescale to the common max, add: deterministic) and writes ``out[b, h] = acc / sum``;
a thread per ``(b, h, d)``.

The split grid depends only on shapes, never on ``context_lens``: a CUDA graph records a launch's
grid once and replays it with each step's new context lengths (``engine/cuda_graph.py``). So
``pick_splits`` chooses ``splits`` from ``B * KVH`` and the block-table width ``W`` (pages) alone:
no split for ``W < SPLIT_MIN_WIDTH`` (64) or ``B * KVH >= SMALL_GRID_BLOCKS``, else ranges of
``PAGES_PER_SPLIT`` (16) pages (``W / MAX_SPLITS`` past 1024 pages), ``splits = ceil(W / pages)``.
The kernel recomputes ``pages_per_split = ceil(W / splits)`` from the table's shape and ``gridDim.z``
(the same number when W is a power of two, as the engine makes it), so its signature is the
unsplit one. Pages past a shorter context make empty splits, which add exact zeros in the merge:
a table padded wider (a CUDA graph's power-of-two width) gives bit-identical results.
Measured on an H200 (Llama 3.2 1B heads, batch 1, us per layer, split + merge): 140 tokens (16
pages) 8.0 unsplit, 9.3-11 split; 300 tokens 10.2 vs 9.6-11.7 (a wash); 1000 tokens 20.4 vs 11.9
(16 pages a split); 3000 tokens 50.1 vs 14.6 (16 pages) and 19.2 (8) or 107 (1): a split pays for
its merge launch and idle warps only when each range is long.

Workspace: ``partials`` is a view of one device array the model allocates with its other buffers
(``split_workspace_floats``): ``MAX_SPLITS x SMALL_GRID_BLOCKS`` blocks of ``group x (HD + 2)``
floats (18 MB for Llama 3.2 1B). Its address never changes, so recorded graphs keep pointing at it.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from numba_vllm.kernels._launch import KernelError, check_array, launch
from numba_vllm.kernels.jit import kernel
from numba_vllm.kernels.reductions import FULL_MASK, WARP_SIZE
from numba_vllm.kernels.vector_load import BF16_PER_VECTOR, bf16x2_to_f32, load_u32x4
from numba_vllm.loading.bf16 import BF16
from numba_vllm.model.config import PAGE_SIZE

NUM_WARPS = 4  # warps per block: a block per (kv head, sequence); 64 seqs x 8 kv heads = 512 blocks
SMALL_GRID_WARPS = 8  # warps per block when there are few blocks (small batches), if group <= 4
SMALL_GRID_BLOCKS = 264  # "few": fewer than two blocks per multiprocessor of an H200 (132)
SPLIT_MIN_WIDTH = 64  # split only block tables this wide or wider (contexts past 512 tokens) ...
PAGES_PER_SPLIT = 16  # ... into ranges of this many pages (256 tokens) ...
MAX_SPLITS = 64  # ... or, past 1024 pages, into this many ranges
MERGE_THREADS = 128  # threads per block of the merge kernel, one per (b, h, d) output
MAX_REGISTERS = 128  # per thread when group <= 4: 4 blocks of 4 warps fit a multiprocessor
VEC = BF16_PER_VECTOR  # bf16 values per lane per 16-byte load
MAX_LOADS_PER_STEP = 4  # K loads per lane per step: more unrolled code no longer fits registers
MAX_GROUP = 8  # query heads per kv head: bounds registers (2 * 8 * group per lane) and shared memory
SUPPORTED_HEAD_DIMS = (8, 16, 32, 64, 128, 256)


@functools.cache
def decode_attention_kernel_for(group: int, head_dim: int, num_warps: int = NUM_WARPS, split: bool = False):
    """The decode attention kernel for ``group`` query heads per kv head, ``head_dim``, and
    blocks of ``num_warps`` warps; with ``split``, the split-context variant that writes partial
    softmax states instead of ``out`` (the same code: ``split`` is a compile-time constant)."""
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
        """q: (B, H, HD) f32; k_cache, v_cache: (P, PAGE_SIZE, KVH, HD) uint16 (bf16 bits);
        block_tables: (B, max_pages) int32; context_lens: (B,) int32; scale: f32;
        out: (B, H, HD) f32, or with ``split`` the partial states (splits * B, H, HD + 2) f32."""
        kv_head = cuda.blockIdx.x
        b = cuda.blockIdx.y
        warp = cuda.threadIdx.x // WARP_SIZE
        lane = cuda.threadIdx.x % WARP_SIZE
        token_slot = lane // lanes_per_token  # which token of a warp load this lane reads
        d0 = (lane % lanes_per_token) * VEC  # first of the lane's 8 dims
        context_len = context_lens[b]
        # The block's tokens [start, end): the whole context, or (split) those of pages
        # [z * pages_per_split, (z + 1) * pages_per_split) in the context, none for a split past it.
        if split:  # a compile-time constant: the unsplit kernel has no division here
            pages_per_split = (block_tables.shape[1] + cuda.gridDim.z - 1) // cuda.gridDim.z
            start = cuda.blockIdx.z * pages_per_split * PAGE_SIZE
            end = min(context_len, start + pages_per_split * PAGE_SIZE)
        else:
            start = 0
            end = context_len
        last_page = (end - 1) // PAGE_SIZE  # the block's last page slot
        num_steps = (end - start + step - 1) // step  # <= 0 for an empty split

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
        # a page past the block's tokens (HD 8) is replaced by its last one: those tokens are masked.
        si = warp
        page_slot = (start + si * step + token_slot) // PAGE_SIZE
        next_page = block_tables[b, min(page_slot, last_page)] if si < num_steps else 0
        while si < num_steps:
            page = next_page
            if si + num_warps < num_steps:  # fetch the next step's page id now, use it then
                page_slot = (start + (si + num_warps) * step + token_slot) // PAGE_SIZE
                next_page = block_tables[b, min(page_slot, last_page)]
            first = start + si * step

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
                if pos >= end:  # an unwritten slot may hold any bits (NaN, inf): mask before the arithmetic
                    k0 = k1 = k2 = k3 = k4 = k5 = k6 = k7 = float32(0.0)
                for g in range(group):
                    j = g * VEC
                    s = (q_reg[j] * k0 + q_reg[j + 1] * k1 + q_reg[j + 2] * k2 + q_reg[j + 3] * k3
                         + q_reg[j + 4] * k4 + q_reg[j + 5] * k5 + q_reg[j + 6] * k6 + q_reg[j + 7] * k7)
                    offset = 1
                    while offset < lanes_per_token:
                        s += cuda.shfl_xor_sync(FULL_MASK, s, offset)
                        offset *= 2
                    scores[i * group + g] = s if pos < end else minus_inf

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
                if pos < end:
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
            h = kv_head * group + g
            if split:  # this split's state, unnormalised; an empty split writes m = -inf, sums 0
                row = cuda.blockIdx.z * cuda.gridDim.y + b
                out[row, h, d] = total
                if d == 0:
                    out[row, h, head_dim] = m_all
                    out[row, h, head_dim + 1] = total_sum
            else:
                out[b, h, d] = total / total_sum
            o += threads

    return decode_attention_kernel


def pick_splits(num_blocks: int, width: int) -> int:
    """Into how many page ranges to split each sequence's context: ``num_blocks = B * KVH`` blocks
    of a block table ``width`` pages wide. 1 (no split) for a grid of ``SMALL_GRID_BLOCKS`` or more,
    or a table narrower than ``SPLIT_MIN_WIDTH``; else ranges of ``PAGES_PER_SPLIT`` pages (more
    when that would make over ``MAX_SPLITS``). Shapes only: a CUDA graph replays the grid."""
    if num_blocks >= SMALL_GRID_BLOCKS or width < SPLIT_MIN_WIDTH:
        return 1
    pages_per_split = max(PAGES_PER_SPLIT, -(-width // MAX_SPLITS))
    return -(-width // pages_per_split)


def split_workspace_floats(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Floats of scratch any split launch for these heads needs at most: MAX_SPLITS x
    (SMALL_GRID_BLOCKS - 1) blocks of ``group x (HD + 2)`` floats (rounded up to SMALL_GRID_BLOCKS)."""
    return MAX_SPLITS * SMALL_GRID_BLOCKS * (num_heads // num_kv_heads) * (head_dim + 2)


@kernel
def decode_attention_merge_kernel(partials, out):
    """out (B, H, HD) f32 = the merge of the splits' partial states partials (splits * B, H, HD + 2)
    f32 (row z * B + b: HD unnormalised sums, then m and the sum of exp(score - m)).

    Thread ``blockIdx.x * blockDim.x + threadIdx.x`` owns output (b, h, d): it rescales the states of
    the splits to their common max and adds them, in split order (deterministic). Split 0 always
    holds a token, so the max is finite, and an empty state (m = -inf, sums 0: a split past the
    context) adds exp(-inf) * 0 = 0.
    """
    batch, num_heads, head_dim = out.shape
    splits = partials.shape[0] // batch
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < batch * num_heads * head_dim:
        b = i // (num_heads * head_dim)
        h = i // head_dim % num_heads
        d = i % head_dim
        m_all = float32(-math.inf)
        for z in range(splits):
            m_all = max(m_all, partials[z * batch + b, h, head_dim])
        total_sum = float32(0.0)
        total = float32(0.0)
        for z in range(splits):
            w = math.exp(partials[z * batch + b, h, head_dim] - m_all)
            total_sum += w * partials[z * batch + b, h, head_dim + 1]
            total += w * partials[z * batch + b, h, d]
        out[b, h, d] = total / total_sum


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float, out, workspace=None) -> None:
    """Paged attention of one query token per sequence over its cached K/V.

    q: (B, H, HD) f32; k_cache, v_cache: (num_pages, PAGE_SIZE, KVH, HD) bf16;
    block_tables: (B, max_pages) int32; context_lens: (B,) int32, each in 1 .. max_pages * PAGE_SIZE
    (cached tokens, the current one included); scale: usually 1 / sqrt(HD); out: (B, H, HD) f32.
    A small grid (``B * KVH`` blocks) is split over the context (``pick_splits``; the grid depends
    on the shapes only, so the launch can be recorded in a CUDA graph and replayed). `workspace`:
    (>= split_workspace_floats(H, KVH, HD),) f32 device scratch for the split's partial states (the
    model's); without one a split launch allocates its own.
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
    num_blocks = batch * num_kv_heads
    # Few blocks (a small batch) leave most multiprocessors idle: give each block more warps,
    # so more of a sequence's pages are in flight at once (shared memory grows with the warps).
    few = num_blocks < SMALL_GRID_BLOCKS and group <= 4
    num_warps = SMALL_GRID_WARPS if few else NUM_WARPS
    splits = pick_splits(num_blocks, block_tables.shape[1])
    # The kernel reads the caches 16 bytes at a time through their raw uint16 bits.
    kv = (k_cache.view(np.uint16), v_cache.view(np.uint16), block_tables, context_lens, np.float32(scale))
    threads = num_warps * WARP_SIZE
    if splits == 1:
        launch(decode_attention_kernel_for(group, head_dim, num_warps, False), (num_kv_heads, batch), threads, q, *kv, out)
        return
    size = splits * batch * num_heads * (head_dim + 2)
    if workspace is None:
        workspace = cuda.device_array(size, np.float32)
    if size > workspace.shape[0]:  # pick_splits keeps it within: not a case that happens
        raise KernelError(f"decode_attention: a {splits}-way split of {batch} x {num_heads} heads exceeds the workspace")
    partials = workspace[:size].reshape(splits * batch, num_heads, head_dim + 2)
    split_kernel = decode_attention_kernel_for(group, head_dim, num_warps, True)
    launch(split_kernel, (num_kv_heads, batch, splits), threads, q, *kv, partials)
    outputs = batch * num_heads * head_dim
    launch(decode_attention_merge_kernel, (-(-outputs // MERGE_THREADS),), MERGE_THREADS, partials, out)
