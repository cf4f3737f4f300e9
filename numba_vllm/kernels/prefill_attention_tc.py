"""Causal prefill attention over the paged KV cache on the tensor cores (FlashAttention-2's shape).

The same contract as ``prefill_attention.py`` (the readable CUDA-core version; its docstring defines
the inputs): a ragged batch of prompts or prompt chunks, sequence ``s`` with ``n`` new tokens at
positions ``start_pos[s] ..``, each attending to its sequence's cached positions ``0 .. p`` found
through ``block_tables[s]`` (a cached prefix and the new tokens alike). Here ``S = Q K^T`` and
``O += P V`` run as ``mma.sync`` m16n8k16 (bf16 inputs, fp32 accumulation; ``mma.py`` has the
instructions and their fragment layouts), and the softmax stays in registers.

Numerics: q is rounded to bf16 as it is loaded (K and V are bf16 already), so the scores are exact
products of the rounded values summed in fp32; they are scaled by ``scale * log2(e)`` in fp32 and
exponentiated with ``exp2``. The probabilities P are rounded to bf16 for the P V product, while the
row sums add them unrounded in fp32 (as FlashAttention-2 does): each weight of the output is off by
up to 2^-8 relative (bf16 keeps 8 significant bits), a few 1e-3 on outputs of size 1. P is taken
against a running max that may trail a row's true max by up to ``RESCALE_LOG2`` (scaled, log2 units),
so P <= 2^8: the rounding stays relative, the sums far from fp32's range; the bound is the same.

Thread mapping. A block of ``NUM_WARPS`` = 4 warps owns a tile of ``block_rows`` query rows of one
kv head of one sequence; grid ``(KVH, S, row tiles)``, the tile with the latest positions (the most
keys) scheduled first. A *query row* is one (new token, query head) pair of the kv head's group,
token-major (row ``r``: token ``r // group``, head ``r % group``), so the group's heads fill the
M dimension of the mma and every K/V tile is loaded once for the whole group (GQA).

Tiling (``default_tiling``; the kernel is compiled per tiling, its sizes constants in the code):
``warp_m_tiles`` 16-row mma tiles per warp (block_rows = 4 warps x 16 x warp_m_tiles), key tiles of
``block_keys`` (whole 16-token pages), and ``q_shared``: Q's fragments in registers or in shared
memory. Head dim 64 runs (2, 64, True): 128 query rows (32 tokens of a 4-head group) per block.

- Warp ``w`` owns ``warp_m_tiles`` x 16 consecutive rows of the tile. Its lanes hold, for the whole
  kernel: the fp32 accumulators of O (16 x head_dim per mma tile) and per row the running max ``m``
  and the lane's share of the running sum ``l``; with ``q_shared`` False also the A fragments of Q
  (16 rows x head_dim per mma tile, loaded from global memory and rounded to bf16 once), else Q
  rounded to bf16 sits in shared memory and each 16-dim step's A fragments are reloaded with one
  ``ldmatrix.x4`` (32 registers fewer: room for 64-key tiles). By the fragment layout (``g = lane >>
  2``, ``t = lane & 3``) a lane holds rows ``g`` and ``g + 8`` of each mma tile, columns ``2t, 2t + 1``
  of each 8-wide column tile: the four lanes of a quad share a row.
- The block walks the keys ``0 .. position of its last row`` in key tiles. Per key tile, each warp:

  1. ``S = Q K^T`` (16 x block_keys per mma tile) on the tensor cores: K's rows are keys with the
     head dims contiguous, which is the B operand's layout (``ldmatrix.x4``: two 8-key tiles of one
     16-dim step);
  2. online softmax on S's fragments: the causal mask, row max of the unscaled scores over the
     lane's values then over the quad (two ``shfl_xor``), ``P = exp2(S * c - m * c)`` with ``c =
     scale * log2(e)`` (one FFMA and one ``ex2.approx`` each). The running max m moves only when the
     tile's max exceeds it by more than ``RESCALE_LOG2`` once scaled (FlashAttention-4's lazy
     rescaling); then l and O are multiplied by ``alpha = exp2((m_old - m_new) * c)``. O (64 products
     a lane) is rescaled only if some row of the warp moved (one ``vote.any``): with scores that
     rarely jump by 2^8 that is the first tile and seldom another. The mask (a compare and a select
     per score) is needed only on the tiles that reach past the warp's first position, one or two
     per warp: the tile's work is a device function called with ``masked`` a constant, so the other
     tiles run a copy with no mask code at all (a branch around the mask alone is if-converted by
     ptxas into predicated selects on every tile);
  3. ``O += P V``: the C fragments of S are, pair by pair, the A fragments of P (rows g, g + 8, keys
     2t, 2t + 1 and 2t + 8, 2t + 9 of a 16-key step), so P goes from accumulators to operands with
     one ``cvt.rn.bf16x2`` per pair and no data movement; V's rows are keys (k of this product)
     with dims (n) contiguous, so its B fragments come from ``ldmatrix.x4.trans``.

  A warp whose rows all come before the key tile (the causal triangle) skips its compute.
- At the end the quad adds its four shares of l (two ``shfl_xor``) and writes ``O / l``.

Shared memory: K and V tiles, ``(2, block_keys, head_dim / 2)`` uint32 each (bf16 pairs), double
buffered (head_dim 64, 64 keys: 2 x 2 x 64 x 128 bytes = 32 KB), plus with ``q_shared`` the Q tile
``(block_rows, head_dim / 2)`` (16 KB): 48 KB, all of the static limit. K/V rows are staged with
``cp.async`` 16 bytes at a time straight from the paged cache (no registers, no conversion). Warp
``w`` stages rows ``w * block_keys / 4 ..`` of a key tile, which lie in one page (a key tile is
whole pages, a warp's share at most one): lane ``l`` copies chunk ``l % (head_dim / 8)`` of rows
``l // (head_dim / 8) + j * copy_rows``. So a thread loads one page id per key tile, and its copies
are one cache offset plus compile-time offsets (the caches are passed flat and ``num_kv_heads`` is
a constant of the build). Copies for key tile i + 1 are issued right after the barrier that opens
tile i, so they land while tile i is computed; each thread waits for its own copies
(``cp.async.wait_all``) before the next barrier: one barrier per key tile. The page id
(``block_tables[s, pos // 16]``) is loaded one tile earlier still, so issuing a copy never waits for
a global load. Rows past the context (the tail of the last page) are stored as zeros, never read: a
NaN there would poison ``P V`` even with P = 0; only the last key tile checks rows one by one.

Integer arithmetic: numba computes in 64 bits; index values that fit are cut to ``int32`` (and
compared with ``int32`` values), so the compiler works on 32-bit registers in the loop.

Swizzle: ldmatrix reads, per 8 lanes, the same 16-byte chunk of 8 consecutive rows; with 128-byte
rows stored plainly those 8 chunks sit in the same 4 banks (8-way conflict). Chunk ``c`` of row
``r`` is stored at chunk ``c ^ ((r >> shift) & mask)`` (for 128-byte or longer rows ``c ^ (r & 7)``;
shorter rows share a 128-byte bank line and use a coarser row index), so the 8 rows of every
ldmatrix phase, and the copies, cover all 32 banks.

Registers (ptxas 13.5, sm_90; ``tests/test_kernel_report.py`` checks the default has no spills): head dim 64,
(2, 64, True): ~250 (64 O and 64 S accumulators a lane), so 2 blocks (8 warps) per SM; asked for
more blocks (``MIN_BLOCKS_HD64``), (2, 32, True) fits 168, 3 blocks, and (1, 64, True) 128, 4 blocks
(16 warps), each with a few bytes spilled; (1, 64, False): 168, 3 blocks. Rows past a sequence's new
tokens compute a copy of its last row and are not written.

Instructions (SASS, head dim 64, (2, 64, True), per warp and key tile of 128 ``mma``): on a tile with
no mask and no moved max, ~650 (~5 per ``mma``: 40 ``ldmatrix``; 64 each of max, FFMA, ``ex2``, add
for the softmax; ~60 to stage the next tile, one page id included); 64 more when O is rescaled. The
previous version issued ~1,200 on every tile (~9.5 per ``mma``): 64-bit index arithmetic, ~45
instructions per 16-byte copy (64-bit strides from the array descriptors), four page ids a thread,
the mask's compare and select on every tile, O always rescaled.

Speed (H200, Llama 3.2 1B's heads, ``benchmarks/attn_tc_gpu.py``, torch's flash attention in the
same run): 1 x 2048 tokens 79.9 us (torch 59.9: 1.33x), 8 x 512 84.0 us (40.8: 2.06x; the (2, 32,
False) tiling 74.1, 1.82x), 1 x 16384 3.61 ms (2.50: 1.45x, 305 TFLOP/s), a 2048-token chunk after
14,000 cached 0.85 ms (0.87: 0.98x). The previous version: 106 / 86 / 5,060 / 1,230 us. A variant
that ran the tiles past a warp's first with no max at all (P against the running max, the tile
computed again if a partial row sum passed 2^8) issued ~565 instructions a tile and was faster at
16384 (3.39 ms) and after the cached prefix (0.80 ms) but slower on short prompts (1 x 2048 108 us,
8 x 512 109 us), so it was left out. Short prompts stay furthest from torch: a 512-token prompt gives
a block 1-8 key tiles, so the first tile and the diagonal ones (the exact softmax, the masks, the
pipeline's fill) are most of its work.

What torch runs there (Nsight Compute, one call each, L2 flushed): cuDNN's Hopper flash kernel, a
persistent grid of 132 blocks of 384 threads (a producer and two consumer warpgroups on
``wgmma``, 64 x 128 x 64 tiles, 134 KB of shared memory, 168 registers). 8 x 512: 38.2 us against
this kernel's 66.1 (1,024 blocks in 3.9 waves, 245 registers, 2 blocks of 4 warps per SM, issue
slots 30% busy); 1 x 2048: 57.9 against 75.2 (36% busy). The tensor cores' share of the work per
instruction issued is what ``wgmma`` changes (a 64 x 128 x 16 product per instruction against
``mma.sync``'s 16 x 8 x 16, and no ldmatrix): the 1.25x bar calls for that kernel, with P fed from
registers to the ``P V`` wgmma and V read through a transposed (MN-major) descriptor.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, int64, uint32, uint64

from numba_vllm.kernels._launch import KernelError, launch
from numba_vllm.kernels.jit import device_function, kernel
from numba_vllm.kernels.kept_views import flat_bits
from numba_vllm.kernels.mma import (
    MMA_K,
    MMA_M,
    MMA_N,
    WARP_LANES,
    cp_async_16,
    cp_async_wait_all,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    mma_bf16_16816,
    pack_bf16x2,
    store_shared_u32x4,
)
from numba_vllm.kernels.prefill_attention import check_prefill_args
from numba_vllm.kernels.reductions import FULL_MASK
from numba_vllm.kernels.vector_load import BF16_PER_VECTOR, SHARED_ALIGN
from numba_vllm.model.config import PAGE_SIZE

NUM_WARPS = 4
THREADS = NUM_WARPS * WARP_LANES
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)  # multiples of the mma's k (16); K/V tiles within 48 KB
MAX_GROUP = 16
LOG2_E = 1.4426950408889634
# Blocks an SM is asked to hold (ptxas then budgets 65536 / (128 x blocks) registers a thread) for the
# head-dim-64 tilings that fit more blocks than ptxas would give unasked (ptxas 13.5, sm_90): (2, 32,
# True) in 168 registers, 3 blocks (4 bytes spilled); (1, 64, True) in 128, 4 blocks (28 bytes
# spilled, two reloads a key tile outside the mask's copy). The launcher's default spills nothing.
MIN_BLOCKS_HD64 = {(2, 32, True): 3, (1, 64, True): 4}
RESCALE_LOG2 = 8.0  # a row's running max moves when a tile's max exceeds it by 2^8 (after scaling): P <= 256


@device_function
def row_tile(cu_seqlens, start_pos, group, block_rows, s, tile):
    """The rows of row tile ``tile`` of sequence ``s`` (a grid runs them in reverse: the latest rows,
    with the most keys, first). Returns the sequence's first token, its rows (new tokens x group),
    the tile's first row (past them: nothing to do), its cached start and its context length."""
    first_token = cu_seqlens[s]
    num_new = cu_seqlens[s + 1] - first_token
    start = start_pos[s]
    return first_token, num_new * group, tile * block_rows, start, int32(start + num_new)


def default_tiling(head_dim: int) -> tuple[int, int, bool]:
    """(warp_m_tiles, block_keys, q_shared) for a head dim: the largest tiles whose accumulators (O:
    16 x head_dim, S: 16 x block_keys per mma tile) fit in registers with no spills (ptxas, sm_90).

    Head dim 64 (H200, Llama 3.2 1B's shapes, measured before the inner loop lost its 64-bit
    arithmetic and per-tile mask; ``benchmarks/attn_tc_gpu.py`` times every tiling): 32-row warp
    tiles with 64-key tiles and Q in shared memory (254 registers) ran as fast as with 32-key tiles
    and Q in registers on 2048-token prompts and 5% faster on 16384 (fewer barriers and rescales per
    key); 16-row warp tiles were slower. Head dim 128 is not measured: 16-row warp tiles, 32 keys.
    """
    if head_dim <= 32:
        return 2, 64, False  # (a 64-key tile is one staging pass of the block's threads at head dim 16)
    return (2, 64, True) if head_dim == 64 else (1, 32, False)


def block_rows_for(warp_m_tiles: int) -> int:
    """Query rows per block."""
    return NUM_WARPS * warp_m_tiles * MMA_M


@functools.cache
def prefill_attention_tc_kernel_for(group: int, head_dim: int, warp_m_tiles: int, block_keys: int, q_shared: bool,
                                    num_kv_heads: int):
    """The kernel compiled for ``group`` query heads per kv head, ``head_dim``, a warp tile of
    ``warp_m_tiles`` x 16 rows, key tiles of ``block_keys``, Q's fragments kept in registers
    (``q_shared`` False) or in shared memory, loaded with ``ldmatrix`` at each use (True: frees
    registers for a larger tile), and ``num_kv_heads`` kv heads in the cache. Its sizes are constants
    in the code (the cache's strides too: a thread's copies of one key tile are one address plus
    constant offsets)."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise KernelError(f"prefill_attention_tc: head_dim {head_dim} not supported (one of {SUPPORTED_HEAD_DIMS})")
    if not 1 <= group <= MAX_GROUP:
        raise KernelError(f"prefill_attention_tc: {group} query heads per kv head, at most {MAX_GROUP}")
    block_rows = block_rows_for(warp_m_tiles)
    warp_rows = warp_m_tiles * MMA_M
    d_steps = head_dim // MMA_K  # k steps of Q K^T (head_dim 64: 4)
    d_tiles = head_dim // MMA_N  # 8-wide column tiles of O (8)
    key_tiles = block_keys // MMA_N  # 8-wide column tiles of S (8)
    key_steps = block_keys // MMA_K  # k steps of P V (4)
    row_words = head_dim // 2  # uint32 words (bf16 pairs) per staged K/V row
    row_chunks = head_dim // BF16_PER_VECTOR  # 16-byte chunks per row
    rows_per_pass = THREADS // row_chunks  # rows the block's threads stage at once (Q)
    warp_stage_rows = block_keys // NUM_WARPS  # K/V rows each warp stages per key tile, all in one page
    copy_rows = WARP_LANES // row_chunks  # rows a warp stages with one 16-byte copy per lane
    stage_passes = warp_stage_rows // copy_rows  # chunks per thread per tensor per key tile
    # Swizzle: rows sharing a 128-byte bank line (short rows) count as one row.
    line_rows = max(1, 8 // row_chunks)
    swizzle_shift = line_rows.bit_length() - 1
    swizzle_mask = min(row_chunks, 8) - 1
    assert block_keys % PAGE_SIZE == 0 and block_rows % rows_per_pass == 0
    assert PAGE_SIZE % warp_stage_rows == 0 and warp_stage_rows % copy_rows == 0
    assert rows_per_pass % (line_rows * (swizzle_mask + 1)) == 0  # a thread's Q rows share one swizzle
    q_passes = block_rows // rows_per_pass  # 16-byte chunks of Q per thread, staging Q in shared memory
    q_rows = block_rows if q_shared else 1  # (arrays of the unused path are minimal)
    q_frag_tiles = 1 if q_shared else warp_m_tiles
    minus_inf = float32(-math.inf)
    rescale_log2 = float32(RESCALE_LOG2)
    min_blocks = MIN_BLOCKS_HD64.get((warp_m_tiles, block_keys, q_shared), 1) if head_dim == 64 else 1
    page_shift = uint32(PAGE_SIZE.bit_length() - 1)  # pos >> page_shift: the page of position pos
    token_elems = num_kv_heads * head_dim  # cache elements per token (all kv heads)
    page_elems = PAGE_SIZE * token_elems

    @device_function
    def _chunk_word(row, chunk):
        """Word offset, in its staged row, of 16-byte chunk ``chunk`` of row ``row``."""
        return (chunk ^ ((row >> swizzle_shift) & swizzle_mask)) * 4

    @device_function
    def _stage_row(tid, j):
        """Row of the key tile that thread ``tid`` stages with its copy j: warp w stages rows
        w * warp_stage_rows .. (one page), ``copy_rows`` rows per copy, ``row_chunks`` lanes a row."""
        return (tid // WARP_LANES) * warp_stage_rows + (tid % WARP_LANES) // row_chunks + j * copy_rows

    @device_function
    def _page_of(table, key0, last_pos, tid):
        """The page holding this thread's staging rows of the key tile at key0 (past the context: the
        last page, whose rows are not copied), from the sequence's row of the block table. Loaded a tile
        ahead of its copies: a copy cannot start before its page id arrives."""
        return table[uint32(min(int32(key0 + _stage_row(tid, 0)), last_pos)) >> page_shift]

    @device_function
    def _stage_kv(k_flat, v_flat, ks, vs, buf, page, lane_src, key0, context_len, tid):
        """Start copying the K and V rows of keys key0 .. key0 + block_keys - 1 (this thread's in page
        ``page``) into buffer ``buf`` (zeros past the context); they have landed after
        ``cp_async_wait_all``. lane_src: the element offset, in its page, of this thread's copy 0 (copy j
        is j * copy_rows tokens further)."""
        src0 = int64(page) * page_elems + lane_src  # K and V have one layout: one offset
        if int32(key0 + block_keys) <= context_len:  # the whole tile is in the context (all but the last)
            for j in range(stage_passes):
                row = _stage_row(tid, j)
                word = _chunk_word(row, tid % row_chunks)
                src = uint64(src0 + j * copy_rows * token_elems)
                cp_async_16(ks, (buf, row, word), k_flat, src)
                cp_async_16(vs, (buf, row, word), v_flat, src)
        else:
            for j in range(stage_passes):
                row = _stage_row(tid, j)
                word = _chunk_word(row, tid % row_chunks)
                if int32(key0 + row) < context_len:
                    src = uint64(src0 + j * copy_rows * token_elems)
                    cp_async_16(ks, (buf, row, word), k_flat, src)
                    cp_async_16(vs, (buf, row, word), v_flat, src)
                else:
                    store_shared_u32x4(ks, (buf, row, word), uint32(0), uint32(0), uint32(0), uint32(0))
                    store_shared_u32x4(vs, (buf, row, word), uint32(0), uint32(0), uint32(0), uint32(0))

    @device_function
    def _mask(acc_s, row_pos, key0, t):
        """S = -inf at the keys past each row's position (later tokens, or past the context). Lane (g, t)
        holds S[g + 8h, 8j + 2t + e] of mma tile i in acc_s[i, j, 2h + e]."""
        for i in range(warp_m_tiles):
            for h in range(2):
                last_key = int32(row_pos[i, h] - key0 - 2 * t)  # this lane's keys 8j + e past it are masked
                for j in range(key_tiles):
                    for e in range(2):
                        if int32(j * MMA_N + e) > last_key:
                            acc_s[i, j, 2 * h + e] = minus_inf

    @device_function
    def _softmax(acc_s, acc_o, row_max, row_sum, alpha, scale_log2):
        """Online softmax of the warp's rows (two per mma tile per lane): S -> P = exp2((S - m) * scale_log2)
        in place, m and l updated, O rescaled. m is a running max of the unscaled scores (scale > 0, so
        each P is one fused multiply-add and one ``ex2``) that moves only when a tile's max exceeds it
        by more than 2^RESCALE_LOG2 once scaled: a smaller excess leaves P <= 2^RESCALE_LOG2, harmless
        in fp32 and bf16 (whose rounding is relative), and most key tiles after the first few then
        leave O alone. O is rescaled when some row of the warp moved its m (a ``vote.any``)."""
        moved = False
        for i in range(warp_m_tiles):
            for h in range(2):
                tile_max = minus_inf
                for j in range(key_tiles):
                    tile_max = max(tile_max, max(acc_s[i, j, 2 * h], acc_s[i, j, 2 * h + 1]))
                tile_max = max(tile_max, cuda.shfl_xor_sync(FULL_MASK, tile_max, 1))  # the quad shares the row
                tile_max = max(tile_max, cuda.shfl_xor_sync(FULL_MASK, tile_max, 2))
                # True on the first tile (m = -inf; key 0 is in it, seen by every row: tile_max is finite)
                move = (tile_max - row_max[i, h]) * scale_log2 > rescale_log2
                m_new = tile_max if move else row_max[i, h]
                alpha[i, h] = math.exp2((row_max[i, h] - m_new) * scale_log2)  # exactly 1 if m stays; 0 on tile 0
                moved = moved or move
                row_max[i, h] = m_new
                row_sum[i, h] *= alpha[i, h]  # this lane's share (its keys) of l
        if cuda.any_sync(FULL_MASK, moved):
            for i in range(warp_m_tiles):
                for j in range(d_tiles):
                    acc_o[i, j, 0] *= alpha[i, 0]
                    acc_o[i, j, 1] *= alpha[i, 0]
                    acc_o[i, j, 2] *= alpha[i, 1]
                    acc_o[i, j, 3] *= alpha[i, 1]
        for i in range(warp_m_tiles):
            for h in range(2):
                m_scaled = row_max[i, h] * scale_log2
                tile_sum = float32(0.0)
                for j in range(key_tiles):
                    for e in range(2):
                        p = math.exp2(acc_s[i, j, 2 * h + e] * scale_log2 - m_scaled)
                        acc_s[i, j, 2 * h + e] = p
                        tile_sum += p
                row_sum[i, h] += tile_sum

    @device_function
    def _store_rows(out, acc_o, row_sum, i, warp_row0, num_rows, first_token, kv_head, g, t):
        """Write mma tile i's rows of O / l (the rows that exist)."""
        for h in range(2):
            total = row_sum[i, h]
            total += cuda.shfl_xor_sync(FULL_MASK, total, 1)  # the quad's four shares of l
            total += cuda.shfl_xor_sync(FULL_MASK, total, 2)
            row = warp_row0 + i * MMA_M + h * 8 + g
            if row < num_rows:
                token = first_token + row // group
                head = kv_head * group + row % group
                inv = float32(1.0) / total
                for j in range(d_tiles):
                    out[token, head, j * MMA_N + 2 * t] = acc_o[i, j, 2 * h] * inv
                    out[token, head, j * MMA_N + 2 * t + 1] = acc_o[i, j, 2 * h + 1] * inv

    @device_function
    def _mma_pair(acc, i, j, a, b0, b1, b2, b3):
        """acc[i, j] += A B0 and acc[i, j + 1] += A B1 on the tensor cores: the A fragment of warp
        tile i (a[i, 0..3]) times the two 16 x 8 B fragments one ldmatrix.x4 gave ((b0, b1): B0,
        (b2, b3): B1). S += Q K^T with a = Q's fragments, O += P V with a = P's."""
        acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3] = mma_bf16_16816(
            a[i, 0], a[i, 1], a[i, 2], a[i, 3], b0, b1, acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3]
        )
        k = j + 1
        acc[i, k, 0], acc[i, k, 1], acc[i, k, 2], acc[i, k, 3] = mma_bf16_16816(
            a[i, 0], a[i, 1], a[i, 2], a[i, 3], b2, b3, acc[i, k, 0], acc[i, k, 1], acc[i, k, 2], acc[i, k, 3]
        )

    @device_function
    def _attend(ks, vs, qs, qf, qa, acc_s, acc_o, pf, row_max, row_sum, row_pos, alpha, buf, key0, masked, scale_log2, t,
                q_row, q_half, k_row, k_half, v_row, v_half):
        """One warp's work on the key tile at key0 (in buffer ``buf``): S = Q K^T, the causal mask if
        ``masked``, the online softmax, O += P V. Called with ``masked`` a constant, so the tiles that
        need no mask (all but the last one or two of a warp) run a copy with no mask code at all."""
        # 1. S = Q K^T
        for i in range(warp_m_tiles):
            for j in range(key_tiles):
                for r in range(4):
                    acc_s[i, j, r] = float32(0.0)
        for kk in range(d_steps):
            for i in range(warp_m_tiles):
                if q_shared:
                    row = q_row + i * MMA_M
                    qa[i, 0], qa[i, 1], qa[i, 2], qa[i, 3] = ldmatrix_x4(qs, (row, _chunk_word(row, 2 * kk + q_half)))
                else:
                    for r in range(4):
                        qa[i, r] = qf[i, kk, r]
            word = _chunk_word(k_row, 2 * kk + k_half)  # the same for rows k_row + 16 jj
            for jj in range(key_tiles // 2):
                b0, b1, b2, b3 = ldmatrix_x4(ks, (buf, k_row + jj * MMA_K, word))
                for i in range(warp_m_tiles):
                    _mma_pair(acc_s, i, 2 * jj, qa, b0, b1, b2, b3)

        # 2. Online softmax
        if masked:
            _mask(acc_s, row_pos, key0, t)
        _softmax(acc_s, acc_o, row_max, row_sum, alpha, scale_log2)

        # 3. O += P V, one 16-key step at a time.
        for kk in range(key_steps):
            for i in range(warp_m_tiles):  # C fragments of S's tiles 2kk, 2kk + 1 = A fragment of P
                pf[i, 0] = pack_bf16x2(acc_s[i, 2 * kk, 0], acc_s[i, 2 * kk, 1])
                pf[i, 1] = pack_bf16x2(acc_s[i, 2 * kk, 2], acc_s[i, 2 * kk, 3])
                pf[i, 2] = pack_bf16x2(acc_s[i, 2 * kk + 1, 0], acc_s[i, 2 * kk + 1, 1])
                pf[i, 3] = pack_bf16x2(acc_s[i, 2 * kk + 1, 2], acc_s[i, 2 * kk + 1, 3])
            for dd in range(d_tiles // 2):
                word = _chunk_word(v_row, 2 * dd + v_half)
                b0, b1, b2, b3 = ldmatrix_x4_trans(vs, (buf, v_row + kk * MMA_K, word))
                for i in range(warp_m_tiles):
                    _mma_pair(acc_o, i, 2 * dd, pf, b0, b1, b2, b3)

    @kernel(fastmath=True, launch_bounds=(THREADS, min_blocks))
    def prefill_attention_tc_kernel(q, k_flat, v_flat, block_tables, cu_seqlens, start_pos, scale_log2, out):
        """q, out: (T, H, HD) f32; k_flat, v_flat: the caches (P, PAGE_SIZE, KVH, HD) as flat uint16 (bf16
        bits); block_tables: (S, max_pages) int32; cu_seqlens: (S + 1,) int32; start_pos: (S,) int32;
        scale_log2: scale * log2(e)."""
        kv_head = cuda.blockIdx.x
        s = cuda.blockIdx.y
        tile = cuda.gridDim.z - 1 - cuda.blockIdx.z  # row tiles in reverse: the latest rows first
        first_token, num_rows, first_row, start, context_len = row_tile(cu_seqlens, start_pos, group, block_rows, s, tile)
        if first_row >= num_rows:
            return  # this sequence has fewer rows than the longest one: the whole block leaves
        last_pos = int32(context_len - 1)
        table = block_tables[uint32(s)]  # (max_pages,) this sequence's page ids
        tid = cuda.threadIdx.x
        lane = tid % WARP_LANES
        warp = tid // WARP_LANES
        g = lane >> 2
        t = lane & 3

        ks = cuda.shared.array((2, block_keys, row_words), uint32, SHARED_ALIGN)  # K tiles, bf16 pairs, swizzled
        vs = cuda.shared.array((2, block_keys, row_words), uint32, SHARED_ALIGN)  # V tiles
        qs = cuda.shared.array((q_rows, row_words), uint32, SHARED_ALIGN)  # q_shared: Q rows, bf16 pairs, swizzled
        qf = cuda.local.array((q_frag_tiles, d_steps, 4), uint32)  # else: A fragments of Q (bf16 pairs)
        qa = cuda.local.array((warp_m_tiles, 4), uint32)  # A fragments of Q for one 16-dim step
        acc_s = cuda.local.array((warp_m_tiles, key_tiles, 4), float32)  # S, then P, of one key tile
        acc_o = cuda.local.array((warp_m_tiles, d_tiles, 4), float32)  # O (unnormalised)
        pf = cuda.local.array((warp_m_tiles, 4), uint32)  # A fragments of P for one 16-key step
        row_max = cuda.local.array((warp_m_tiles, 2), float32)  # m of rows g, g + 8 of each mma tile
        row_sum = cuda.local.array((warp_m_tiles, 2), float32)  # this lane's share of l
        row_pos = cuda.local.array((warp_m_tiles, 2), int32)  # position of each of those rows
        alpha = cuda.local.array((warp_m_tiles, 2), float32)  # their rescale factors on one key tile

        last_row = min(first_row + block_rows, num_rows) - 1
        num_keys = start + last_row // group + 1  # keys 0 .. position of the block's last row
        num_key_tiles = int32((num_keys + block_keys - 1) // block_keys)
        in_page = _stage_row(tid, 0) % PAGE_SIZE  # this thread's first staging row, in its page
        lane_src = int32(in_page * token_elems + kv_head * head_dim + (tid % row_chunks) * BF16_PER_VECTOR)
        page = _page_of(table, 0, last_pos, tid)
        _stage_kv(k_flat, v_flat, ks, vs, 0, page, lane_src, 0, context_len, tid)  # lands while Q loads
        page = _page_of(table, block_keys, last_pos, tid)  # of the next key tile this thread stages

        warp_row0 = first_row + warp * warp_rows
        warp_active = warp_row0 < num_rows  # else all its rows are padding: it only stages
        warp_first_pos = int32(start + min(warp_row0, num_rows - 1) // group)
        warp_last_pos = int32(start + (min(warp_row0 + warp_rows, num_rows) - 1) // group)
        for i in range(warp_m_tiles):
            for h in range(2):
                row = min(warp_row0 + i * MMA_M + h * 8 + g, num_rows - 1)  # padding repeats the last row
                token = first_token + row // group
                head = kv_head * group + row % group
                row_pos[i, h] = start + row // group
                row_max[i, h] = minus_inf
                row_sum[i, h] = float32(0.0)
                if not q_shared:
                    for kk in range(d_steps):
                        for half in range(2):  # a0/a1: dims 2t, 2t + 1 of the step; a2/a3: 8 further
                            d = kk * MMA_K + half * 8 + 2 * t
                            qf[i, kk, 2 * half + h] = pack_bf16x2(q[token, head, d], q[token, head, d + 1])
            for j in range(d_tiles):
                for r in range(4):
                    acc_o[i, j, r] = float32(0.0)
        if q_shared:  # the block's Q rows, 16 bytes (8 dims) a store; the loop's first barrier publishes them
            q_row0 = tid // row_chunks
            q_chunk = tid % row_chunks
            q_word = _chunk_word(q_row0, q_chunk)
            for j in range(q_passes):
                r = q_row0 + j * rows_per_pass
                row = min(first_row + r, num_rows - 1)
                token = first_token + row // group
                head = kv_head * group + row % group
                d = q_chunk * BF16_PER_VECTOR
                store_shared_u32x4(
                    qs, (r, q_word),
                    pack_bf16x2(q[token, head, d], q[token, head, d + 1]),
                    pack_bf16x2(q[token, head, d + 2], q[token, head, d + 3]),
                    pack_bf16x2(q[token, head, d + 4], q[token, head, d + 5]),
                    pack_bf16x2(q[token, head, d + 6], q[token, head, d + 7]),
                )  # fmt: skip

        # ldmatrix rows of this lane. K (non-transposed, B of Q K^T): matrices (keys 0-7, dims 0-7),
        # (keys 0-7, dims 8-15), (keys 8-15, dims 0-7), (keys 8-15, dims 8-15) of a 16 x 16 block give
        # b0, b1 of two 8-key tiles. V (transposed, B of P V): matrices (keys 0-7, dims 0-7), (keys 8-15,
        # dims 0-7), (keys 0-7, dims 8-15), (keys 8-15, dims 8-15) give b0, b1 of two 8-dim tiles.
        q_row = warp * warp_rows + (lane & 15)  # (A operand: rows lane & 15, dims 8 (lane >> 4) on)
        q_half = lane >> 4
        k_row = (lane & 7) + ((lane >> 4) << 3)
        k_half = (lane >> 3) & 1
        v_row = (lane & 7) + (((lane >> 3) & 1) << 3)
        v_half = lane >> 4

        for kt in range(num_key_tiles):
            buf = kt & 1
            key0 = int32(kt * block_keys)
            cp_async_wait_all()  # this thread's copies of key tile kt have landed
            # Wait until all of tile kt is in buffer `buf`. This also guarantees that every warp is done
            # with tile kt - 1, in the other buffer, where tile kt + 1 goes right below.
            cuda.syncthreads()
            if kt + 1 < num_key_tiles:
                _stage_kv(k_flat, v_flat, ks, vs, 1 - buf, page, lane_src, key0 + block_keys, context_len, tid)
                page = _page_of(table, key0 + 2 * block_keys, last_pos, tid)  # used next time
            if warp_active and key0 <= warp_last_pos:
                if int32(key0 + (block_keys - 1)) > warp_first_pos:  # the tile reaches past the warp's first position
                    _attend(ks, vs, qs, qf, qa, acc_s, acc_o, pf, row_max, row_sum, row_pos, alpha, buf, key0, True,
                            scale_log2, t, q_row, q_half, k_row, k_half, v_row, v_half)
                else:
                    _attend(ks, vs, qs, qf, qa, acc_s, acc_o, pf, row_max, row_sum, row_pos, alpha, buf, key0, False,
                            scale_log2, t, q_row, q_half, k_row, k_half, v_row, v_half)

        if warp_active:
            for i in range(warp_m_tiles):
                _store_rows(out, acc_o, row_sum, i, warp_row0, num_rows, first_token, kv_head, g, t)

    return prefill_attention_tc_kernel


def prefill_attention_tc(q, k_cache, v_cache, block_tables, cu_seqlens, start_pos, scale: float, out,
                         max_new_tokens: int | None = None, tiling: tuple[int, int, bool] | None = None) -> None:
    """Causal attention of a ragged batch of new tokens over their sequences' cached K/V, on the
    tensor cores. The arguments are ``prefill_attention``'s (q: (T, H, HD) f32; k_cache, v_cache:
    (num_pages, PAGE_SIZE, KVH, HD) bf16; block_tables: (S, max_pages) int32; cu_seqlens: (S + 1,)
    int32; start_pos: (S,) int32; out: (T, H, HD) f32; max_new_tokens: the longest sequence's new
    tokens, read from cu_seqlens when None); ``tiling`` (warp_m_tiles, block_keys, q_shared) forces a tiling
    (tests, benchmarks), else ``default_tiling(head_dim)``."""
    shape = check_prefill_args("prefill_attention_tc", q, k_cache, v_cache, block_tables, cu_seqlens, start_pos, out,
                               max_new_tokens)  # fmt: skip
    if shape is None:
        return
    group, head_dim, num_kv_heads, num_seqs, max_new_tokens = shape
    warp_m_tiles, block_keys, q_shared = tiling or default_tiling(head_dim)
    kernel_ = prefill_attention_tc_kernel_for(group, head_dim, warp_m_tiles, block_keys, q_shared, num_kv_heads)
    num_row_tiles = -(-max_new_tokens * group // block_rows_for(warp_m_tiles))
    # the kernel reads the caches 16 bytes at a time through their bits, flattened
    launch(kernel_, (num_kv_heads, num_seqs, num_row_tiles), THREADS, q, flat_bits(k_cache), flat_bits(v_cache),
           block_tables, cu_seqlens, start_pos, np.float32(scale * LOG2_E), out)  # fmt: skip
