"""Paged decode attention on the tensor cores (``mma.sync`` m16n8k16, bf16 in, fp32 accumulate).

It computes what ``decode_attention`` (the readable reference) and ``decode_attention_fast`` (the
same on CUDA cores) compute, with q and the probabilities P rounded to bf16 for the two products,
as FlashAttention-style kernels do:

    out[b, h] = sum_j softmax_j(scale * q[b, h] . K[j]) * V[j],   j = 0 .. context_lens[b] - 1

Why. With a GQA group of 4, every 4 bytes of K and V cost 8 fused multiply-adds on CUDA cores, plus
the shuffles that add a token's partial dot products: ``decode_attention_fast`` spends ~600
instructions per 4 KiB a warp reads and is issue-bound below the memory's bandwidth. On the tensor
cores a page of 16 tokens costs 16 ``mma`` instructions for both products, no shuffles, and the K
words go into the ``mma`` as loaded: a warp's work per page drops to about a hundred instructions,
so the kernel waits on memory only.

Mapping (``g = lane >> 2``, ``t = lane & 3``, the fragment layout of ``kernels/mma.py``). A block
per (kv head, sequence[, range of pages]), ``NUM_WARPS`` warps (in a full unsplit grid as many as
let the whole grid run in one wave: ``full_grid_warps``); warp ``w`` of ``W`` takes steps ``w, w +
W, ...`` of ``PAGES_PER_STEP`` pages (one in a full grid: ``FULL_GRID_*``). A full grid too large
for blocks of two warps runs a block per sequence instead, warp ``w`` taking every page of kv head
``w`` (``head_warp_blocks``): the same warps, each a (kv head, sequence) as before, but a page's
rows of all kv heads read from one SM at about the same time; its warps request page 0's rows
before the context length has arrived (every context has a page 0). The loads are
software-pipelined: the next step's K rows are requested as soon as this step's S is computed and
its V rows once this step's ``P V`` is, each into the registers just consumed, so a warp keeps a
step's rows in flight while it computes, with no more registers than one step's.

- ``S = Q K^T`` per page: M = the group's query heads (rows ``g < group``; rows 8..15 and
  ``group..7`` are zero padding), N = 8 tokens (two n tiles a page), K = the head dim in chunks of
  16. The dot product does not care in which order it visits the dims, so they are permuted to suit
  the loads: lane ``(g, t)`` holds, of token ``8j + g``, the ``HD / 4`` contiguous dims starting at
  ``t * HD / 4`` (two 16-byte loads at HD 64; the four lanes of a ``g`` read one whole 128-byte row),
  and chunk ``c`` takes its words ``2c`` (as ``b0``) and ``2c + 1`` (``b1``). Q's A fragment uses the
  same permutation: ``a0``/``a2`` of chunk ``c`` are q's dims ``t * HD / 4 + 4c + (0, 1)`` / ``(2, 3)``.
- Softmax in base 2 on the S fragment: lane ``(g, t)`` holds head ``g``'s scores of tokens ``2t,
  2t + 1`` of each n tile; a page's max per head is the max over the quad (two ``shfl_xor``). The
  running max moves lazily (by more than ``RESCALE_THRESHOLD``, as in ``decode_attention_fast``);
  sums of P are kept per lane (unrounded) and added over the quad at the end.
- ``O += P V`` per page: M = heads, K = the page's 16 tokens, N = 8 dims per n tile (HD / 8 tiles).
  The S fragment of the two token tiles *is* P's A fragment (rows g, columns 2t, 2t + 1 and 8 + 2t,
  9 + 2t), packed to bf16. V's B fragment wants two tokens' values of one dim in a register, while a
  row holds consecutive dims of one token, so the lane loads the rows of tokens ``2t, 2t + 1, 8 + 2t,
  9 + 2t`` (dims ``g * HD / 8 ..``, one 16-byte load each at HD 64) and pairs their halves with two
  integer ops per register. N is permuted too: n tile ``u``'s column ``n`` is dim ``n * HD / 8 + u``.
- Tokens past the context: on a page that reaches past it (the last, warp-uniform) the K and V words
  of those tokens are zeroed before any ``mma`` and their scores set to ``-inf``.

Combination, split over the context and the merge kernel are ``decode_attention_fast``'s: the warps'
states meet in shared memory; a split block writes its state (``sum p * V``, ``m`` in log2 units,
``sum p``) to the partials, which ``decode_attention_fast_merge_kernel`` merges; the ranges come from
``decode_attention_fast.pick_split`` (shapes only: CUDA graphs, and bit-identical results when the
table is padded to the next power of two).

Measured on an H200 (``benchmarks/decode_attention_gpu.py --sweep``: Llama 3.2 1B heads, L2 flushed
before each call, CUDA events around the call with the host's launches hidden behind a sleeping
kernel, median of 20; us; torch: ``scaled_dot_product_attention`` on contiguous bf16 K/V, which
runs cuDNN's flash kernels; the events add ~3-4 us to every call against ``bench kernels``'
profiler times, which weighs on the small cases)::

    batch x context   decode_attention   decode_attention_fast   this kernel   torch
    1 x 256                 12.9                 10.8                10.1         8.0
    1 x 1,024               17.5                 12.1                11.2        10.1
    1 x 16,384              50.4                 26.4                24.7        20.7   (32 ranges)
    4 x 4,096               40.5                 25.1                21.9        20.1
    32 x 4,096             220.8                 94.3                81.4        76.5   (3.3 TB/s)
    64 x 1,024              69.1                 53.2                47.1        45.6   (full grid)
    256 x 512              139.6                 97.3                85.3        76.9   (full grid)

(The table predates the pipelined loads and the full grids' warps.) ``bench kernels`` (CUPTI kernel
time, 2026-12-04, with the loads streamed past L1 where it pays: below), this kernel against torch:
64 x 1,024 40.5 / 42.4 us (3.3 TB/s of K/V), 1 x 16,384 17.9 / 16.9, 1 x 1,024 6.9 / 5.8, 256 x 512
76.3 / 74.3, 32 x 4,096 76.7 / 72.8 (3.5 TB/s). The day before: 19.3 / 16.8, 6.9 / 5.7, 43.5 / 42.0,
76.6 / 73.7, 76.7 / 72.9.
Before, with a step's loads issued together and four warps in every block: 20.0 / 17.0, 6.8 / 5.8,
44.3 / 42.4, 82.4 / 73.7, 78.3 / 72.9. In one run (the builds side by side, CUPTI, median of 20)
the pipelined loads alone gave 64 x 1,024 43.7 against 44.2 us, 32 x 4,096 77.2 /
78.3, 16 x 2,048 32.7 / 33.4, 256 x 512 82.1 / 82.1; the warps that fit one wave gave 256 x 512
(2,048 blocks of one warp) 76.7 against 82.1 and 128 x 1,024 (1,024 blocks of two) 76.3 against
78.3, while 64 x 1,024 stays at four warps (two: 48.8 us, half the warp slots idle).

- Batch 1 at 16,384 tokens was 1.5x torch until the merge kernel loaded its ranges' states 16 at a
  time: Nsight Compute timed the split kernel at 14.4 us and the merge at 22.9 us, its threads each
  waiting on 64 loads one after another (cuDNN: 12.3 + 4.1 us). ``MAX_SPLITS`` 32 gives it 32
  ranges of 32 pages (256 blocks, 4 steps a warp).
- Before the loads were pipelined, a warp issued a whole step's loads and then waited; an L2
  prefetch of its next step (``prefetch.global.L2``) cost 2-6% on the large grids (64 x 1,024 46.5 us
  with it, 44.3 without; 256 x 512 84.3 / 82.4), two or three steps ahead more.
- Tried and not kept: a ring of 2-4 pages per warp in dynamic shared memory, filled by ``cp.async``
  (the same 16-byte chunks, read back with ``ld.shared.v4``: no registers held while loads fly,
  128 registers, 4 blocks per SM). Slower everywhere (3 pages: 64 x 1,024 59.6 us, 256 x 512
  103.5, 32 x 4,096 105.2, 1 x 16,384 29.5), with the K loads laid out as whole 32-byte sectors too.
- Also measured and not kept (2026-12-03, pipelined loads, CUPTI): each lane's two K loads covering
  whole 32-byte sectors (dims ``32i + 8t ..``) instead of half of each, the ``L2::256B`` load hint,
  table entries loaded before the context length is known: within 1% at every shape. Nor is the
  cache layout the gap to torch: the same bytes with one kv head (each page's 16 rows contiguous,
  512 x 1,024 with H 4) took 42.8 against 43.5 us, and pages in order instead of shuffled 43.0.
- K and V rows streamed past L1 (``load_u32x4_stream``: ``ld.global.nc.L1::no_allocate``, read once,
  never kept) in blocks of four warps at HD 64: H200, CUPTI, L2 flushed, median of 40 in two rounds
  (2026-12-04), us, loaded as before / streamed (torch): 64 x 1,024 (full grid) 43.7 / 40.5 (41.7),
  16 x 2,048 (unsplit, one block an SM) 32.9 / 27.6 (28.6), 4 x 4,096 (split) 17.7 / 16.0 (16.4),
  1 x 16,384 (split) 19.3 / 17.8 (16.8), 1 x 1,024 7.0 / 6.9 (5.7), but 32 x 4,096 (unsplit, two
  blocks an SM) 75.0 / 76.0 (72.2). The full grids of one- and two-warp blocks were slower streamed
  and load as before: 256 x 512 75.8 / 77.0 (73.0), 128 x 1,024 74.8 / 75.3 (72.6). Streaming K
  alone or V alone gained nothing (64 x 1,024: 44.0, 43.7), nor did the 256-byte L2 fetch hint on
  top (41.1). Why some grids lose is not settled (the full grids have the same warps an SM and the
  same bytes in flight either way).
- Against cuDNN at 64 x 1,024 (Nsight Compute, one call, L2 flushed): this kernel 43.3 us, 66% of
  DRAM bandwidth, 25% theoretical occupancy (128 registers, 4 blocks of 4 warps), issue slots 23%
  busy; cuDNN 36.2 us, 79% of DRAM, the same occupancy (120 registers, 45 KB of shared memory).
- Against cuDNN at 256 x 512 (Nsight Compute, one call, L2 flushed, 2026-12-04): this kernel 69.5
  us, 3.93 TB/s (82% of DRAM; one wave of 2,048 one-warp blocks, 16 warps an SM at 126 registers,
  L1 hit rate 35%), cuDNN 67.1 us, 4.06 TB/s (84%; 2,048 blocks of four warps in four waves, the
  same 16 warps an SM at 120 registers, 45 KB of shared memory, L1 hit rate 0). Both warps wait
  mostly on their loads (9.8 and 6.2 of 13.7 and 13.0 cycles between issues). This grid in
  four-warp blocks with the streamed loads (which took 64 x 1,024's four-warp blocks from 43.7 to
  40.5 us) still loses: 84.9 against 80.4 us for the one-warp blocks (torch 77.5;
  ``benchmarks/decode_attention_gpu.py --variants tc_w4``, CUDA events, 2026-12-04). A block per
  sequence with a warp per kv head (``head_warp_blocks``; 256 blocks of 8 warps, 125 registers, two
  blocks an SM) took 78.6, 78.1 and 78.1 us in three runs against 80.0, 80.0 and 79.7 (torch 77.0,
  76.6, 76.8; events): the launcher's since (``bench kernels``, CUPTI: 75.0 against torch's 73.7 us,
  1.02x); the same with a barrier every step to keep the 8 warps in lockstep 81.7 and 80.5. Nor is
  the loop's integer work the gap: its SASS is ~250 instructions a page a warp in the steady state
  (16 ``HMMA``, 8 16-byte loads, the softmax of 4 scores), with no 64-bit index arithmetic worth
  removing, and the warps issue once every ~14 cycles.
- 256 x 512 (2026-12-04, evening; CUPTI, L2 flushed, median of 40, alternated rounds on one H200).
  The blocks of a warp per kv head requesting page 0's rows (and page 1's table entry) before the
  context length arrives, instead of after it (a table entry, then the rows: one trip to memory
  fewer before the first bytes flow; the loop takes its first step unchecked so that the compiler
  does not sink the loads below the test): 73.4-73.6 against 73.8-74.2 us in four rounds, torch
  72.9-73.1; at 256 x 500 73.5-73.7 against 74.0-74.1 (torch 71.7-72.0). The same cache with each
  sequence's pages in order instead of shuffled: 73.4 against 74.1 us (torch 72.9): scattered pages
  cost ~1% here. Tried and slower (CUDA events, ``benchmarks/decode_attention_gpu.py``, against
  77.3-77.4 us for these blocks, torch 76.2-76.7): the block staging whole pages (K and V of all 8
  kv heads, 16 KB each, one 2-D TMA copy apiece) in a ring of shared memory, its warps reading
  their rows with ``ld.shared.v4`` and the last warp done with a stage refilling it (116
  registers, no spills): 82.2 / 82.0 / 83.7 us with 2 / 3 / 4 pages in flight a block (4: one
  block an SM); and an L2 prefetch of the rows 1 / 2 / 4 steps past the next step's, a lane a row
  (``prefetch.global.L2``): 82.7 / 85.9 / 119.7 us (64 x 1,024 in four-warp blocks: 45.8 / 47.0
  / 52.4 against 44.0). Each warp has one page's rows in flight already and the memory answers in
  ~2 us under this load, so more bytes in flight queue rather than flow.
- 256 x 512, where the last percent goes (2026-12-04, night; CUPTI, ``docs/benchmarks.md``): a
  read-only kernel with this grid and these loads takes 71.8-72.8 us (torch 72.8-73.6, this kernel
  73.9-74.5), so the work adds ~2 us; a flat read of the same bytes 68.2. The warps all start within
  0.2 us and end between 65.5 and 74.6 (median 70.2): the spread is the memory's. Bulk L2 prefetches
  of a warp's remaining pages near its end (or once part of the grid has finished) were slower
  (74.9-81.8). Pages laid out head-major (a warp's 16 rows one contiguous 2 KB) gave 73.3 against
  73.7, and 38.7 against 39.9 at 64 x 1,024: the layout is the engine's, not changed.

Head dims 64 and 128, groups up to 8 (the M rows of one mma); other shapes run
``decode_attention_fast``. Numerics: q and P in bf16 (8 significant bits): each weight is off by a
relative 2^-8 at most, the bound ``tests/test_decode_attention_tc.py`` checks (the same as
``prefill_attention_tc``'s).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, uint32

from numba_vllm.kernels import decode_attention_fast as fast
from numba_vllm.kernels._launch import KernelError, check_array, launch, num_sms
from numba_vllm.kernels.approx_math import exp2_approx
from numba_vllm.kernels.jit import device_function, kernel
from numba_vllm.kernels.kept_views import flat_bits
from numba_vllm.kernels.mma import mma_bf16_16816, pack_bf16x2
from numba_vllm.kernels.reductions import FULL_MASK, WARP_SIZE
from numba_vllm.kernels.vector_load import load_u32x4, load_u32x4_stream
from numba_vllm.loading.bf16 import BF16
from numba_vllm.model.config import PAGE_SIZE

NUM_WARPS = 4  # warps per block
PAGES_PER_STEP = 2  # pages a warp computes a step at HD 64 (8 KiB in flight per warp); HD 128: half
MAX_REGISTERS = 168  # per thread at HD 64: 3 blocks of 4 warps per multiprocessor (65536 / 384 = 170); HD 128: no cap
# A grid of 3+ blocks per multiprocessor that is not split runs a page a step at 128 registers instead
# (4 blocks, 16 warps per SM): H200, Llama 3.2 1B heads, 64 x 1,024 tokens 49.4 us against 55.4, 256 x
# 512 87.3 against 89.0; smaller grids keep two pages a step (32 x 4,096 unsplit: 83.3 against 91.3).
FULL_GRID_BLOCKS_PER_SM = 3
FULL_GRID_PAGES_PER_STEP, FULL_GRID_MAX_REGISTERS = 1, 128
FULL_GRID_WARP_SLOTS = 16  # warps per multiprocessor at 128 registers (65536 / (128 * 32))
FULL_GRID_HEAD_WARPS = True  # full grids of one-warp blocks run as a block per sequence, a warp per kv head
MAX_GROUP = 8  # query heads per kv head: the rows 0..7 of an mma's M
SUPPORTED_HEAD_DIMS = (64, 128)  # a lane's share of a K row and of a V row are whole 16-byte loads
RESCALE_THRESHOLD = fast.RESCALE_THRESHOLD


def supported(group: int, head_dim: int) -> bool:
    """Whether the tensor-core kernel serves these heads (else the launcher runs decode_attention_fast)."""
    return head_dim in SUPPORTED_HEAD_DIMS and 1 <= group <= MAX_GROUP


@functools.cache
def decode_attention_tc_kernel_for(group: int, head_dim: int, num_kv_heads: int, num_warps: int = NUM_WARPS,
                                   split: bool = False, pages_per_step: int = PAGES_PER_STEP,
                                   max_registers: int | None = MAX_REGISTERS, stream: bool = False,
                                   head_warps: bool = False):  # fmt: skip
    """The kernel for ``group`` query heads per kv head, ``head_dim``, ``num_kv_heads`` (compile-time:
    a step's addresses are one base plus constant offsets), blocks of ``num_warps`` warps taking
    ``pages_per_step`` pages a step; ``split``: write the partial state of a page range;
    ``max_registers``: the cap (None: none); ``stream``: K and V rows loaded without allocating
    them in L1 (``load_u32x4_stream``); ``head_warps`` (unsplit): a block per sequence, whose warp w
    takes every step of kv head w (``num_warps`` = ``num_kv_heads``) and writes its heads' output."""
    if not supported(group, head_dim):
        raise KernelError(f"decode_attention_tc: group {group}, head_dim {head_dim} not supported")
    chunks = head_dim // 16  # k chunks of S = Q K^T
    k_words = head_dim // 8  # words of a K row a lane holds (HD / 4 dims)
    v_words = head_dim // 16  # words of a V row a lane holds (HD / 8 dims)
    dim_tiles = head_dim // 8  # n tiles of O = P V
    token_stride = num_kv_heads * head_dim  # elements from one token's row to the next in a page
    page_stride = PAGE_SIZE * token_stride
    step_tokens = pages_per_step * PAGE_SIZE
    # per-lane register arrays need literal sizes
    q_frag_len, o_len, s_len = 2 * chunks, 2 * dim_tiles, 4 * pages_per_step
    kw_len, vw_len = pages_per_step * 2 * k_words, pages_per_step * 4 * v_words
    threads = num_warps * WARP_SIZE
    step_stride = 1 if head_warps else num_warps  # a warp's steps: si, si + step_stride, ...
    minus_inf = float32(-math.inf)
    merge_block = fast.block_merge_for(num_warps, group, head_dim, threads, split)
    low_half = uint32(0xFFFF)
    high_half = uint32(0xFFFF0000)
    load16 = load_u32x4_stream if stream else load_u32x4

    @device_function
    def fill_pages(pages, block_tables, b, start, last_page, step, num_steps):
        """pages[p]: the page id of page p of step ``step`` (clamped to the context's last page; 0
        past the last step)."""
        for p in range(pages_per_step):
            pages[p] = 0
            if step < num_steps:
                pages[p] = block_tables[b, min(start // PAGE_SIZE + step * pages_per_step + p, last_page)]

    @device_function
    def load_k(k_cache, kw, pages, g, k_lane):
        """Issue the loads of the lane's K words of ``pages`` (tokens 8j + g): kw (page, n tile, word)."""
        for p in range(pages_per_step):
            base = pages[p] * page_stride
            for j in range(2):
                row = base + (8 * j + g) * token_stride + k_lane
                for i in range(k_words // 4):
                    words = load16(k_cache, row + 8 * i)
                    for e in range(4):
                        kw[(p * 2 + j) * k_words + 4 * i + e] = words[e]

    @device_function
    def load_v(v_cache, vw, pages, t, v_lane):
        """Issue the loads of the lane's V words of ``pages`` (tokens 2t, 2t+1, 8+2t, 9+2t): vw (page,
        token r, word)."""
        for p in range(pages_per_step):
            base = pages[p] * page_stride
            for r in range(4):
                row = base + (8 * (r // 2) + 2 * t + r % 2) * token_stride + v_lane
                for i in range(v_words // 4):
                    words = load16(v_cache, row + 8 * i)
                    for e in range(4):
                        vw[(p * 4 + r) * v_words + 4 * i + e] = words[e]

    @device_function
    def step_scores(q_frag, kw, s, first, end, g, t, scale_log2, tail):
        """S = Q K^T of the step whose first token is ``first``: s (page, n tile, pair) gets head g's
        scores of tokens 8j + 2t, 8j + 2t + 1 of each page in log2 units (-inf past ``end``, the
        K words of those tokens zeroed first if ``tail``); returns the lane's max of them."""
        if tail:  # unwritten slots may hold any bits: zero them before any mma
            for p in range(pages_per_step):
                for j in range(2):
                    if first + p * PAGE_SIZE + 8 * j + g >= end:
                        for w in range(k_words):
                            kw[(p * 2 + j) * k_words + w] = uint32(0)
        m_step = minus_inf
        for p in range(pages_per_step):
            page_first = first + p * PAGE_SIZE
            for j in range(2):
                s0 = s1 = s2 = s3 = float32(0.0)
                for c in range(chunks):
                    kb = (p * 2 + j) * k_words + 2 * c
                    s0, s1, s2, s3 = mma_bf16_16816(q_frag[2 * c], uint32(0), q_frag[2 * c + 1], uint32(0),
                                                    kw[kb], kw[kb + 1], s0, s1, s2, s3)  # fmt: skip
                pos = page_first + 8 * j + 2 * t
                s[(p * 2 + j) * 2] = s0 * scale_log2 if pos < end else minus_inf
                s[(p * 2 + j) * 2 + 1] = s1 * scale_log2 if pos + 1 < end else minus_inf
                m_step = max(m_step, max(s[(p * 2 + j) * 2], s[(p * 2 + j) * 2 + 1]))
        return m_step

    @device_function
    def step_accumulate(o, s, vw, m, sum_exp, m_step, first, end, t, tail):
        """The online softmax and O += P V of the step ``step_scores`` scored (``m_step``: the lane's
        max); returns the new (m, sum_exp)."""
        m_step = max(m_step, cuda.shfl_xor_sync(FULL_MASK, m_step, 1))  # over the quad: head g's step max
        m_step = max(m_step, cuda.shfl_xor_sync(FULL_MASK, m_step, 2))
        if m_step > m + RESCALE_THRESHOLD:  # quad-uniform; true on the first step (m = -inf)
            alpha = exp2_approx(m - m_step)  # 0 on the first step
            sum_exp *= alpha
            for i in range(o_len):
                o[i] *= alpha
            m = m_step
        if tail:
            for p in range(pages_per_step):
                for r in range(4):
                    if first + p * PAGE_SIZE + 8 * (r // 2) + 2 * t + r % 2 >= end:
                        for w in range(v_words):
                            vw[(p * 4 + r) * v_words + w] = uint32(0)
        # O += P V, a page at a time: P's A fragment is the S fragment, in bf16.
        for p in range(pages_per_step):
            a = cuda.local.array(2, uint32)  # P rows g: tokens (2t, 2t + 1), (8 + 2t, 9 + 2t)
            for j in range(2):
                p0 = exp2_approx(s[(p * 2 + j) * 2] - m)  # 0 for a masked token (-inf)
                p1 = exp2_approx(s[(p * 2 + j) * 2 + 1] - m)
                sum_exp += p0 + p1
                a[j] = pack_bf16x2(p0, p1)
            for u in range(dim_tiles):  # n tile u: dims n * HD / 8 + u
                w = u // 2
                v0 = vw[(p * 4) * v_words + w]  # token 2t
                v1 = vw[(p * 4 + 1) * v_words + w]  # token 2t + 1
                v2 = vw[(p * 4 + 2) * v_words + w]  # token 8 + 2t
                v3 = vw[(p * 4 + 3) * v_words + w]  # token 9 + 2t
                if u % 2 == 0:  # the low halves: dim 2w of the lane's share
                    b0 = (v0 & low_half) | (v1 << uint32(16))
                    b1 = (v2 & low_half) | (v3 << uint32(16))
                else:  # the high halves: dim 2w + 1
                    b0 = (v0 >> uint32(16)) | (v1 & high_half)
                    b1 = (v2 >> uint32(16)) | (v3 & high_half)
                d0, d1, _, _ = mma_bf16_16816(a[0], uint32(0), a[1], uint32(0), b0, b1, o[2 * u], o[2 * u + 1],
                                              float32(0.0), float32(0.0))  # fmt: skip
                o[2 * u] = d0
                o[2 * u + 1] = d1
        return m, sum_exp

    @device_function
    def load_q(q, q_frag, b, kv_head, g, t):
        """Q's A fragment (rows g < group), in bf16, with K's dim permutation: q_frag (chunk, a0 | a2)."""
        for c in range(chunks):
            q_frag[2 * c] = uint32(0)
            q_frag[2 * c + 1] = uint32(0)
            if g < group:
                d = t * (head_dim // 4) + 4 * c
                h = kv_head * group + g
                q_frag[2 * c] = pack_bf16x2(q[b, h, d], q[b, h, d + 1])
                q_frag[2 * c + 1] = pack_bf16x2(q[b, h, d + 2], q[b, h, d + 3])

    @device_function
    def store_heads(out, o, sum_exp, b, kv_head, g, t):
        """A warp holding a kv head's whole state writes its heads' O / l (columns 2t, 2t + 1 of n
        tile u: dims (2t) * HD / 8 + u, ...); ``sum_exp``: head g's sum over the quad."""
        if g < group:
            inv = float32(1.0) / sum_exp
            h = kv_head * group + g
            for u in range(dim_tiles):
                out[b, h, 2 * t * (head_dim // 8) + u] = o[2 * u] * inv
                out[b, h, (2 * t + 1) * (head_dim // 8) + u] = o[2 * u + 1] * inv

    @kernel(max_registers=max_registers)
    def decode_attention_tc_kernel(q, k_cache, v_cache, block_tables, context_lens, scale_log2, pages_per_split, out):
        """q: (B, H, HD) f32; k_cache, v_cache: (P * PAGE_SIZE * KVH * HD,) uint16, the bf16 pools'
        bits flattened; block_tables: (B, max_pages) int32; context_lens: (B,) int32; scale_log2:
        f32, the softmax scale times log2(e); pages_per_split: int32 (split only); out: (B, H, HD)
        f32, or with ``split`` the partial states (splits * B, H, HD + 2) f32."""
        warp = cuda.threadIdx.x // WARP_SIZE
        if head_warps:
            kv_head = warp
            b = cuda.blockIdx.x
        else:
            kv_head = cuda.blockIdx.x
            b = cuda.blockIdx.y
        lane = cuda.threadIdx.x % WARP_SIZE
        g = lane >> 2  # the lane's head (S, O rows), K token within an n tile, V dims
        t = lane & 3  # the lane's K dims, its tokens' pairs in S and V
        context_len = context_lens[b]
        if split:  # the tokens of pages [z * pages_per_split, (z + 1) * pages_per_split) in the context
            start = cuda.blockIdx.z * pages_per_split * PAGE_SIZE
            end = min(context_len, start + pages_per_split * PAGE_SIZE)
        else:
            start = 0
            end = context_len
        last_page = (end - 1) // PAGE_SIZE
        num_steps = (end - start + step_tokens - 1) // step_tokens  # <= 0 for an empty split
        head_offset = kv_head * head_dim
        k_lane = head_offset + t * (head_dim // 4)  # the lane's first K element in a token row
        v_lane = head_offset + g * (head_dim // 8)  # the lane's first V element in a token row

        q_frag = cuda.local.array(q_frag_len, uint32)  # (chunk, a0 | a2)
        load_q(q, q_frag, b, kv_head, g, t)
        # (dim tile, c0 | c1): O row g. Rows 8..15 of P are zero, so O's rows g + 8 (c2, c3) stay zero:
        # they go into each mma as constant zeros and come out unused, holding no registers.
        o = cuda.local.array(o_len, float32)
        for i in range(o_len):
            o[i] = float32(0.0)
        m = minus_inf  # running max of head g's scores (log2 units), lazily raised; the same in the quad
        sum_exp = float32(0.0)  # this lane's share of head g's sum of 2^(score - m)
        kw = cuda.local.array(kw_len, uint32)  # (page, n tile, word): tokens 8j + g
        vw = cuda.local.array(vw_len, uint32)  # (page, token r, word): tokens 2t, 2t+1, 8+2t, 9+2t
        pages = cuda.local.array(pages_per_step, np.int64)  # the page ids of the next loads' step
        s = cuda.local.array(s_len, float32)  # (page, n tile, pair): head g's scores

        # Software-pipelined: step si's K and V are in flight from the previous iteration; the next
        # step's K loads go out once S is computed (kw is free), its V loads once P V is (vw is free),
        # so a warp has a page's rows on their way while it computes.
        si = 0 if head_warps else warp
        if head_warps:  # every context has a page 0 (context_lens >= 1): its rows are requested before the
            # context length has arrived, and page 1's entry (used only if the context has one) with them
            pages[0] = block_tables[b, 0]
            load_k(k_cache, kw, pages, g, k_lane)
            load_v(v_cache, vw, pages, t, v_lane)
            pages[0] = block_tables[b, min(1, block_tables.shape[1] - 1)]
        else:
            fill_pages(pages, block_tables, b, start, last_page, si, num_steps)
            if si < num_steps:
                load_k(k_cache, kw, pages, g, k_lane)
                load_v(v_cache, vw, pages, t, v_lane)
            fill_pages(pages, block_tables, b, start, last_page, si + step_stride, num_steps)
        while head_warps or si < num_steps:  # warp-uniform: every lane takes part in every mma (head_warps: below)
            nxt = si + step_stride
            first = start + si * step_tokens
            tail = first + step_tokens > end  # warp-uniform: the step reaches past the context
            m_step = step_scores(q_frag, kw, s, first, end, g, t, scale_log2, tail)
            if nxt < num_steps:  # the next step's K, into the words S is done with
                load_k(k_cache, kw, pages, g, k_lane)
            m, sum_exp = step_accumulate(o, s, vw, m, sum_exp, m_step, first, end, t, tail)
            if nxt < num_steps:  # the next step's V, into the words P V is done with
                load_v(v_cache, vw, pages, t, v_lane)
            fill_pages(pages, block_tables, b, start, last_page, nxt + step_stride, num_steps)
            si = nxt
            if head_warps and si >= num_steps:  # (a loop that takes its first step unchecked: the loads
                break  # above are issued before the context length is known, not sunk below its test)

        sum_exp += cuda.shfl_xor_sync(FULL_MASK, sum_exp, 1)
        sum_exp += cuda.shfl_xor_sync(FULL_MASK, sum_exp, 2)
        if head_warps:  # the warp's state is its kv head's whole result: O / l, from its registers
            store_heads(out, o, sum_exp, b, kv_head, g, t)
            return
        # The warps' states meet in shared memory: per (warp, head) m and the sum, per dim sum p * V.
        part_m = cuda.shared.array((num_warps, group), float32)
        part_sum = cuda.shared.array((num_warps, group), float32)
        part_acc = cuda.shared.array((num_warps, group, head_dim), float32)
        if g < group:
            if t == 0:
                part_m[warp, g] = m
                part_sum[warp, g] = sum_exp
            for u in range(dim_tiles):  # columns 2t, 2t + 1 of n tile u: dims (2t) * HD / 8 + u, ...
                part_acc[warp, g, 2 * t * (head_dim // 8) + u] = o[2 * u]
                part_acc[warp, g, (2 * t + 1) * (head_dim // 8) + u] = o[2 * u + 1]
        cuda.syncthreads()

        merge_block(out, part_m, part_sum, part_acc, kv_head, b)  # the warps' states: one per warp

    return decode_attention_tc_kernel


def pages_per_step(head_dim: int) -> int:
    """Pages a warp takes per step: ``PAGES_PER_STEP`` at HD 64, fewer for wider rows (the same bytes)."""
    return max(1, PAGES_PER_STEP * 64 // head_dim)


def full_grid_warps(num_blocks: int) -> int:
    """Warps per block of a full unsplit grid of ``num_blocks`` blocks: the most, up to ``NUM_WARPS``,
    with which every block fits on the GPU at once (``FULL_GRID_WARP_SLOTS`` warps per SM), else one.
    A grid of one wave pays for starting and draining its warps once; fewer warps a block give each
    warp more steps, and one warp a block lets up to 16 blocks share an SM (docstring: 256 x 512)."""
    warps = NUM_WARPS
    while warps > 1 and num_blocks * warps > FULL_GRID_WARP_SLOTS * num_sms():
        warps //= 2
    return warps


def head_warp_blocks(num_kv_heads: int, num_warps: int) -> bool:
    """Whether a full grid of ``num_warps``-warp blocks (one a (kv head, sequence)) runs instead as a
    block per sequence with a warp per kv head (``head_warps``): for one-warp blocks, when whole
    blocks fill an SM's warp slots (the kv heads divide ``FULL_GRID_WARP_SLOTS``). A sequence's pages
    hold all its kv heads' rows (16 KB a page at 8 x 64 dims); its warps on one SM read each page at
    about the same time instead of eight blocks drifting apart over the GPU (module docstring)."""
    return FULL_GRID_HEAD_WARPS and num_warps == 1 and FULL_GRID_WARP_SLOTS % num_kv_heads == 0


def launched_kernel(group: int, head_dim: int, num_kv_heads: int, split: bool = False, full_grid: bool = False,
                    num_warps: int = NUM_WARPS):  # fmt: skip
    """The build the launcher runs for these heads (the module's warps, pages per step, cap);
    ``full_grid``: an unsplit grid of ``FULL_GRID_BLOCKS_PER_SM`` blocks per SM or more (HD 64 only),
    in blocks of ``num_warps`` warps (``full_grid_warps``; one-warp blocks as ``head_warp_blocks``
    says). At HD 64, blocks of ``NUM_WARPS`` warps stream their K and V rows past L1, smaller blocks
    do not (module docstring: measured; HD 128: not measured, loaded as before)."""
    full = full_grid and not split and head_dim <= 64
    stream = head_dim <= 64 and (num_warps if full else NUM_WARPS) == NUM_WARPS
    if full and head_warp_blocks(num_kv_heads, num_warps):
        return decode_attention_tc_kernel_for(group, head_dim, num_kv_heads, num_kv_heads, False,
                                              FULL_GRID_PAGES_PER_STEP, FULL_GRID_MAX_REGISTERS, False, True)  # fmt: skip
    if full:
        return decode_attention_tc_kernel_for(group, head_dim, num_kv_heads, num_warps, False, FULL_GRID_PAGES_PER_STEP,
                                              FULL_GRID_MAX_REGISTERS, stream)  # fmt: skip
    registers = MAX_REGISTERS if head_dim <= 64 else None  # HD 128 needs ~210 (2 blocks per SM)
    return decode_attention_tc_kernel_for(group, head_dim, num_kv_heads, NUM_WARPS, split, pages_per_step(head_dim),
                                          registers, stream)  # fmt: skip


def decode_attention_tc(q, k_cache, v_cache, block_tables, context_lens, scale: float, out, workspace=None) -> None:
    """Paged attention of one query token per sequence over its cached K/V, on the tensor cores
    (``decode_attention``'s contract: q (B, H, HD) f32; k_cache, v_cache (num_pages, PAGE_SIZE, KVH,
    HD) bf16; block_tables (B, max_pages) int32; context_lens (B,) int32, each in 1 .. max_pages *
    PAGE_SIZE; out (B, H, HD) f32). Heads it does not serve (``supported``) run
    ``decode_attention_fast``. ``workspace``: (>= decode_attention_fast.split_workspace_floats(H,
    KVH, HD),) f32 device scratch for split launches; without one a split launch allocates it.
    """
    check_array("q", q, "float32", ndim=3)
    batch, num_heads, head_dim = q.shape
    check_array("k_cache", k_cache, BF16, (None, PAGE_SIZE, None, head_dim))
    num_kv_heads = k_cache.shape[2]
    if num_kv_heads == 0 or num_heads % num_kv_heads or not supported(num_heads // num_kv_heads, head_dim):
        fast.decode_attention_fast(q, k_cache, v_cache, block_tables, context_lens, scale, out, workspace)
        return
    check_array("v_cache", v_cache, BF16, tuple(k_cache.shape))
    check_array("block_tables", block_tables, "int32", (batch, None))
    check_array("context_lens", context_lens, "int32", (batch,))
    check_array("out", out, "float32", (batch, num_heads, head_dim))
    if batch == 0:
        return
    group = num_heads // num_kv_heads
    num_blocks = batch * num_kv_heads
    splits, pages_per_split = fast.pick_split(num_blocks, block_tables.shape[1], NUM_WARPS * pages_per_step(head_dim))
    full_grid = splits == 1 and head_dim <= 64 and num_blocks >= FULL_GRID_BLOCKS_PER_SM * num_sms()
    warps = full_grid_warps(num_blocks) if full_grid else NUM_WARPS
    attention = launched_kernel(group, head_dim, num_kv_heads, splits > 1, full_grid, warps)
    # the kernel reads the caches 16 bytes at a time through their bits, flattened
    args = (q, flat_bits(k_cache), flat_bits(v_cache), block_tables, context_lens, np.float32(scale * fast.LOG2E),
            np.int32(pages_per_split))  # fmt: skip
    if full_grid and head_warp_blocks(num_kv_heads, warps):
        launch(attention, (batch,), num_kv_heads * WARP_SIZE, *args, out)
        return
    threads = warps * WARP_SIZE
    if splits == 1:
        launch(attention, (num_kv_heads, batch), threads, *args, out)
        return
    fast.launch_split_merge(attention, (num_kv_heads, batch, splits), threads, args, out, workspace)
