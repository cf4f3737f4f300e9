"""Causal prefill attention over the paged KV cache on Hopper's ``wgmma`` (FlashAttention-3's shape).

The contract of ``prefill_attention.py`` (the readable CUDA-core version; its docstring defines the
inputs) and the numerics of ``prefill_attention_tc.py`` (the ``mma.sync`` version, for any GPU from
sm_80; its docstring explains the online softmax, the lazy rescale and the bounds): q is rounded to
bf16, S = Q K^T and O += P V accumulate in fp32, P is rounded to bf16 for the product while the row
sums add it unrounded. What changes is how the products run. ``mma.sync`` multiplies 16 x 8 x 16 per
warp instruction with both operands in registers, fed by ``ldmatrix``; ``wgmma`` (``wgmma.py``)
multiplies 64 x N x 16 per warpgroup instruction (N = 128 keys for S), reading K and V straight
from shared memory, so the instructions a warp issues per product drop ~16-fold and the softmax has
the issue slots to itself.

Block: ``consumers`` warpgroups (64 query rows each: ``block_rows`` = 128 with two) and one producer
warp; grid ``(KVH, S, row tiles)`` as ``prefill_attention_tc``'s (the tile with the latest rows
first). A query row is a (new token, query head) pair of the kv head's group, token-major, so the
group's heads share every K/V tile (GQA).

- Producer (one warp, lane p copying page p of each tile): per key tile of ``block_keys`` keys
  (whole 16-token pages), each lane reads its page id ``block_tables[s, key // 16]`` (one load a
  tile for the warp, issued before the wait below), waits until a stage of the ring is free (its
  *empty* mbarrier: one arrival per consumer warpgroup), then copies its page of K and V with the
  Tensor Memory Accelerator: one ``tma_load_2d(16)`` box (16 tokens x 64 dims, 2 KB) per tensor and
  64-dim panel, from the cache seen as a 2-D matrix (num_pages * 16 rows, KVH * HD columns: a
  page's tokens of one kv head are 16 consecutive rows, the head's dims ``kv_head * HD ..``), into
  the 128-byte-swizzled layout, completion counted on the stage's *full* mbarrier (lane 0 tells it
  the bytes to expect first). Pages past the block's last key are not copied: no table entry past
  the sequence is read. (A single thread issuing every page in turn, each copy waiting for its
  table load, kept the tensor cores waiting: 2,945 against 3,537 us at 16,384 tokens.)
- Consumers: warpgroup ``c`` rounds its 64 rows of q to bf16 into shared memory once (16-byte loads,
  all issued before the first store; K-major, the 128-byte swizzle: the A operand of S), then per key
  tile waits on the stage's full mbarrier and

  1. ``S = Q K^T``: ``head_dim / 16`` wgmma m64n{block_keys}k16, A = Q, B = K as staged (a row per
     key, dims contiguous: K-major), S in 64 fp32 registers a thread (``block_keys`` = 128);
  2. the causal mask (only on tiles reaching past the warpgroup's first position: ``_attend`` is
     compiled twice, ``masked`` a constant) and the online softmax in registers: row max over the
     thread's values then over the quad (two ``shfl_xor``; thread ``(warp w, g, q)`` holds rows
     ``16w + g`` and ``16w + g + 8``, columns ``8j + 2q, 8j + 2q + 1``: ``wgmma.py``'s table), P =
     exp2(S c - m c), the running max moved only by more than 2^8 (then l and O rescaled);
  3. ``O += P V``: ``block_keys / 16`` wgmma m64n{head_dim}k16 with A from registers: the
     accumulator layout of S is the register layout of A, so P's fp32 pairs are rounded into bf16
     pairs in place (``pack_bf16x2``, no data movement), and B = V read through an MN-major
     descriptor (``smem_descriptor_mn``): V is staged exactly as K (a row per key), and a row per
     k with n contiguous is what a transposed B is. No ``ldmatrix``, no transpose;
  4. releases the stage (one arrival on its empty mbarrier), so the producer refills it while the
     next stage's copies, issued earlier, are already landing.

  The V rows of the block's last tile past its valid keys (stale slots of the last page past the
  context, and pages not copied, holding whatever the stage held before) are zeroed before its
  P V (a NaN there would poison O even times P = 0); K's are masked like any key past the row.
- At the end, the quad adds its shares of l and writes ``O / l`` (rows past the sequence's new
  tokens compute a copy of the last row and are not written).

Shared memory (dynamic, from a 1024-byte boundary): Q (block_rows x head_dim bf16: 16 KB at 128 x
64), ``stages`` x (K tile, V tile) (block_keys x head_dim each: 16 KB at 128 x 64), then the 2 x
``stages`` mbarriers: 80 KB for two stages at head dim 64. A head dim of 128 is two 64-dim panels
per tile (Q and K: a k-step past 64 dims starts in the second panel; V: the descriptor's leading
byte offset is the panel stride).

Tilings (``Tiling``; the launcher's by head dim and context length: ``default_tiling``):

- ``overlap``: FlashAttention-3's overlap inside a warpgroup. Per key tile, S = Q K^T is issued,
  then the previous tile's P V (its P kept in ``pa``), and the softmax starts as soon as S's group has
  completed (``wgmma.wait_group 1``), while the tensor cores still add the previous P V; then the
  wait for it, O's rescale, and this tile's P rounded into ``pa``. The exp2 of one tile and the
  products of the other share the SM's time instead of alternating. A stage stays held until its
  P V has run, a tile later (three stages keep the producer ahead). ``_attend_overlapped`` is
  compiled with ``has_previous`` a constant: no branch around a wgmma, which would make ptxas
  serialise them.
- ``producer_registers``: a block of three warpgroups gets 168 registers a thread (an SM shares its
  64K registers in quarters of warps: 9 warps count as 12), which the overlapped order spills on
  128-key tiles (76 bytes: S, O and the P in flight, 128 values a thread, all live across the
  softmax). A producer warpgroup
  (instead of a warp) that lowers itself to 24 with ``setmaxnreg`` raises the two consumers to 240.
- ``blocks_per_sm``: the launch bound (two or three blocks of one consumer warpgroup share an SM: the
  warpgroups of different blocks do not wait for each other, and one's fixed steps run beside the
  others' products).
- ``pingpong`` (with ``overlap``, two consumers): FlashAttention-3's warpgroup ping-pong. The two
  warpgroups take turns to issue their products (hardware barriers ``TURN_BARRIER + c``: a
  warpgroup waits for its turn with ``bar.sync``, issues S and the previous P V, and hands the turn
  over with ``bar.arrive``), so one's softmax runs while the tensor cores do the other's products.
  Every key tile is a turn of each warpgroup, work or not, so the turns stay paired.
- ``persistent``: a grid of one SM's worth of blocks, each taking work items (kv head, sequence, row
  tile) in the order the 3-D grid would run them, the stage ring and its mbarrier phases running on
  from one item to the next (the producer copies the next item's first tiles while the consumers
  finish the current one).

Measured (H200, CUPTI kernel time with the L2 flushed, torch's cuDNN kernel in the same run; head dim
64, GQA 4; docs/benchmarks.md): blocks of two consumer warpgroups (128 x 128-key tiles, one block an
SM) took 67.3 us at 8 x 512 tokens (torch 37.5: 1.79x), 67.8 at 1 x 2048 (57.0), 53.6 at 32 x 128
(21.1), 2,880 at 1 x 16,384 (2,335) and 674 for 2,048 tokens after 14,000 cached (864). What those
short prompts wait on is each block's fixed steps: Q's loads and rounding, the first copies, the
epilogue (without Q's loads and O's stores, 8 x 512 took 58.4 us), which one block an SM runs with
nothing beside them. One consumer a block, three blocks an SM (64-key tiles) take 50.1 (1.34x),
60.8, 35.0, 2,838 and 699; two blocks an SM of 128-key tiles 60.4, 64.2, 46.0, 2,735 and 646: the
launcher runs the first below ``LONG_CONTEXT`` keys, the second above (at 4,096 keys 206 against 209
us, at 2,048 after 6,000 cached 335 against 315). Neither ping-pong nor the persistent grid nor the
overlapped order was faster than the tilings they were tried on (2x128 tiles: 70.2, 69.3, 2,929 and
703 with ping-pong; 86.0, 76.3, 3,060, 719 persistent, against 70.8, 71.9, 2,904, 682), nor were
32- or 48-key tiles (four and three blocks an SM: 48.9 and 51.7 at 8 x 512, 76.9 and 67.0 at 1 x 2048).
The launcher's short-context tiling on a persistent grid (three blocks an SM: 396 blocks taking the
items in turn) is slower too: 8 x 512 63.6 against 53.6 us, 1 x 2,048 83.0 / 71.6, 32 x 128 47.1 /
44.6 (CUDA events, back to back; torch 40.4-41.7, 61.9, 23.6). Nsight Compute on 8 x 512 (the
launcher's tiling 49.1 us, cuDNN's persistent kernel 38.9): both reach a quarter of DRAM's bandwidth
or less; ours issues an instruction every other cycle on each scheduler over 81K active cycles,
cuDNN 0.44 a cycle over 58K: ours ran ~1.7x the instructions, and that count, not the memory, was
what the 1.33x was made of (not Q read as fp32 and O written as fp32: bf16 in and out measured 49.8
against 49.9 us). The SASS (``nvdisasm`` of the sm_90a cubin, per source line) showed where: a third
of the kernel's instructions were 64-bit index arithmetic, numba's ``int64`` with Python's flooring
``//`` and ``%`` (the causal mask 195 instructions a tile where 64 compare and select, the V tail's
zeroing ~270, Q's staging ~380, the work item ~110). With every index at 32 bits (``index_math.div``
and ``mod``, ``int32(...)`` around sums; 3,144 -> 2,072 SASS instructions, 128 -> 116 registers),
ncu counts 17.4M instructions at 8 x 512 instead of 22.4M (cuDNN 13.5M), and ``bench kernels``
(2026-12-04) gives 8 x 512 45.2 us against torch's 37.3 (1.21x; 49.2-49.4 before, same machine),
1 x 2,048 57.6 / 56.9, 1 x 16,384 2,690 / 2,313, 2,048 after 14,000 cached 626 / 856.

Registers (ptxas 13.5, sm_90a; ``bench kernels --static``): the short-context tiling 116 (three blocks
an SM, by shared memory and the launch bound), the long-context one 153, head dim 128's 160,
``OVERLAP_TILING`` 122, ``OVERLAP_WIDE_TILING`` 168 at launch (240 in the consumers), none spilling;
no wgmma serialised (C7515).

The engine runs it on H100/H200 (``EngineConfig.prefill_attention`` "auto"), ``prefill_attention_tc``
elsewhere.

Simulator: wgmma, the TMA and mbarriers are emulated (``wgmma.py``), so the kernel runs as written,
a warpgroup rendezvous per wgmma; every wgmma completes at once there, so the simulator checks the
order of the steps, not the waits (ptxas checks those it can: C7515). Needs sm_90a on a GPU:
``EngineConfig(prefill_attention="wgmma")`` asks for it; other GPUs are refused with a one-line error.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, uint32

from numba_vllm.kernels._launch import KernelError, hopper, launch, num_sms
from numba_vllm.kernels.index_math import div, mod
from numba_vllm.kernels.jit import device_function, kernel
from numba_vllm.kernels.kept_views import kept, page_rows
from numba_vllm.kernels.mma import pack_bf16x2, store_shared_u32x4
from numba_vllm.kernels.prefill_attention import check_prefill_args
from numba_vllm.kernels.prefill_attention_tc import LOG2_E, RESCALE_LOG2, row_tile
from numba_vllm.kernels.reductions import FULL_MASK
from numba_vllm.kernels.vector_load import load_f32x4, store_f32x2, vector_aligned
from numba_vllm.kernels.wgmma import (
    ATOM_BYTES,
    DESC_K_STEP,
    DESC_MN_K_STEP,
    SWIZZLE_ROW_BYTES,
    TILE_K,
    WARPGROUP_THREADS,
    WGMMA_K,
    WGMMA_M,
    fence_mbarrier_init,
    fence_proxy_async,
    mbarrier_arrive,
    mbarrier_arrive_expect_tx,
    mbarrier_init,
    mbarrier_wait,
    named_barrier,
    named_barrier_arrive,
    set_max_registers,
    shared_address,
    smem_descriptor,
    smem_descriptor_mn,
    tensor_map_2d,
    tensormap_prefetch,
    tma_load_2d,
    wgmma_bf16,
    wgmma_bf16_rs,
    wgmma_commit,
    wgmma_fence,
    wgmma_fence_operands,
    wgmma_wait,
    wgmma_wait_operands,
)
from numba_vllm.model.config import PAGE_SIZE
from numba_vllm.sim.warp import simulator_enabled

SUPPORTED_HEAD_DIMS = (64, 128)  # whole 64-dim panels (one 128-byte swizzled row each)
MAX_GROUP = 16
WARP_LANES = 32
PAGE_BYTES = PAGE_SIZE * SWIZZLE_ROW_BYTES  # one TMA box: a page's 16 tokens x 64 dims of one kv head
BARRIER_BYTES = 8
REGISTERS_PER_SM = 65536
CHUNK_BYTES = 16  # one swizzled chunk: 8 bf16
TURN_BARRIER = 3  # ping-pong: warpgroup c waits on hardware barrier 3 + c for its turn (1 + c: its own barrier)
Q_PASSES_AT_ONCE = 4  # Q's 16-byte chunks a thread loads before storing any (4 at head dim 64: all of them)
CHAINS = 4  # a row's max and sum over a tile run as this many independent chains (few warps hide little latency)


@dataclass(frozen=True)
class Tiling:
    """Consumer warpgroups (64 query rows each), keys per K/V tile, K/V tiles in flight, and the blocks
    an SM is asked to hold (ptxas then budgets 65536 / (threads x blocks) registers a thread)."""

    consumers: int
    block_keys: int  # whole pages, at most 256 (one wgmma's N)
    stages: int
    blocks_per_sm: int = 1
    overlap: bool = False  # a tile's softmax beside the previous tile's P V on the tensor cores (FlashAttention-3)
    producer_registers: int = 0  # 0: a producer warp; else a producer warpgroup lowered to this many (setmaxnreg)
    pingpong: bool = False  # (overlap, two consumers) the warpgroups take turns to issue their products
    persistent: bool = False  # a grid of an SM's worth of blocks, each running work items in turn

    @property
    def block_rows(self) -> int:
        return WGMMA_M * self.consumers

    @property
    def threads(self) -> int:  # the consumers and one producer warp (or warpgroup)
        return WARPGROUP_THREADS * self.consumers + (WARPGROUP_THREADS if self.producer_registers else WARP_LANES)

    @property
    def launch_registers(self) -> int:
        """Registers a thread starts with: what the launch bound leaves it of the 64K (ptxas allocates
        in multiples of 8, at most 255: 80 for three blocks of 256 threads, 168 for one of 384)."""
        return min(255, REGISTERS_PER_SM // (self.threads * self.blocks_per_sm)) // 8 * 8

    @property
    def consumer_registers(self) -> int:
        """With a producer warpgroup: the registers a consumer thread raises itself to, all that the
        producer's lowering frees of the block's own registers (a multiple of 8, at most 256).
        ``setmaxnreg.inc`` takes registers from the block's pool alone, never from other blocks' or
        the SM's spare ones, and waits until they are there: asking for more hangs the block."""
        pool = self.launch_registers * self.threads - WARPGROUP_THREADS * self.producer_registers
        return min(256, pool // (WARPGROUP_THREADS * self.consumers) // 8 * 8)

    def shared_bytes(self, head_dim: int) -> int:
        """Q, the stages, the mbarriers, and the slack to align the start to 1024 bytes."""
        q_bytes = self.block_rows * head_dim * 2
        stage_bytes = 2 * self.block_keys * head_dim * 2
        return q_bytes + self.stages * stage_bytes + 2 * self.stages * BARRIER_BYTES + ATOM_BYTES


# The launcher's tilings (``default_tiling``), by head dim. Head dim 64 (Llama 3.2 1B): blocks of one consumer
# warpgroup (64 query rows), several an SM, so that one block's fixed steps (Q's loads, the first copies, the
# epilogue) run beside the others' products. Contexts shorter than LONG_CONTEXT keys: 64-key tiles (S and O
# 32 fp32 registers a thread each, 128 registers in all), four stages (72 KB), three blocks an SM; longer
# ones: 128-key tiles (S 64 registers: 168 in all), two stages, two blocks an SM, whose longer tiles halve
# the steps per key. Head dim 128: two consumers, 64-key tiles (S 32 registers beside O's 64), both lengths.
SHORT_CONTEXT_TILINGS = {64: Tiling(consumers=1, block_keys=64, stages=4, blocks_per_sm=3),
                         128: Tiling(consumers=2, block_keys=64, stages=2)}
LONG_CONTEXT_TILINGS = {64: Tiling(consumers=1, block_keys=128, stages=2, blocks_per_sm=2),
                        128: Tiling(consumers=2, block_keys=64, stages=2)}
LONG_CONTEXT = 6144  # keys of the longest sequence's context (new tokens and cached prefix) from which LONG_CONTEXT_TILINGS run

# The overlapped softmax (``Tiling.overlap``) at head dim 64: 64-key tiles, three stages (a stage stays
# held until its P V has run, one tile later). Not the default until measured.
OVERLAP_TILING = Tiling(consumers=2, block_keys=64, stages=3, overlap=True)
# The same with 128-key tiles: a producer warpgroup lowered to 24 registers raises the consumers to 240.
OVERLAP_WIDE_TILING = Tiling(consumers=2, block_keys=128, stages=3, overlap=True, producer_registers=24)
# The wide overlapped order with the warpgroups' ping-pong turns; and the default tiles on a persistent grid
# (its producer a warpgroup handing registers over: the item loop spills 60 bytes at 168). Neither is faster.
PINGPONG_TILING = Tiling(consumers=2, block_keys=128, stages=3, overlap=True, producer_registers=24, pingpong=True)
PERSISTENT_TILING = Tiling(consumers=2, block_keys=128, stages=2, producer_registers=24, persistent=True)


def default_tiling(head_dim: int, max_context: int = 0) -> Tiling:
    """The launcher's tiling for a head dim and the longest context of the batch (keys: cached prefix and
    new tokens)."""
    return (LONG_CONTEXT_TILINGS if max_context >= LONG_CONTEXT else SHORT_CONTEXT_TILINGS)[head_dim]


@functools.cache
def prefill_attention_wgmma_kernel_for(group: int, head_dim: int, tiling: Tiling):
    """The kernel compiled for ``group`` query heads per kv head, ``head_dim`` and a tiling (its sizes
    are constants in the code)."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise KernelError(f"prefill_attention_wgmma: head_dim {head_dim} not supported (one of {SUPPORTED_HEAD_DIMS})")
    if not 1 <= group <= MAX_GROUP:
        raise KernelError(f"prefill_attention_wgmma: {group} query heads per kv head, at most {MAX_GROUP}")
    consumers, block_keys, stages, overlap = tiling.consumers, tiling.block_keys, tiling.stages, tiling.overlap
    pingpong, persistent = tiling.pingpong, tiling.persistent
    assert block_keys % PAGE_SIZE == 0 and block_keys <= 256 and stages >= 2
    assert not pingpong or (overlap and consumers == 2), "ping-pong turns are the overlapped order's, between two warpgroups"
    block_rows = tiling.block_rows
    threads = tiling.threads
    panels = head_dim // TILE_K  # 64-dim panels of a staged row
    row_chunks = head_dim // 8  # 16-byte chunks of a row of q
    q_passes = WGMMA_M * row_chunks // WARPGROUP_THREADS  # chunks of Q each consumer thread stages
    q_chunk_values = 8 * Q_PASSES_AT_ONCE  # (a multiple of it: head dims of whole 64-dim panels)
    q_panel_bytes = block_rows * SWIZZLE_ROW_BYTES  # one 64-dim panel of the Q tile
    q_bytes = panels * q_panel_bytes
    kv_panel_bytes = block_keys * SWIZZLE_ROW_BYTES  # one 64-dim panel of a K or V tile
    kv_bytes = panels * kv_panel_bytes
    stage_bytes = 2 * kv_bytes  # K tile, then V tile
    barrier_offset = q_bytes + stages * stage_bytes
    pages_per_tile = block_keys // PAGE_SIZE
    d_steps = head_dim // WGMMA_K  # k-steps of S = Q K^T
    panel_steps = TILE_K // WGMMA_K  # k-steps within one 64-dim panel
    key_steps = block_keys // WGMMA_K  # k-steps of O += P V
    p_words = 4 * key_steps  # P's bf16 pairs a thread: four A registers per k-step
    s_count = block_keys // 2  # S accumulators a thread
    o_count = head_dim // 2  # O accumulators a thread
    key_blocks = block_keys // 8  # 8-column blocks of S
    dim_blocks = head_dim // 8  # 8-column blocks of O
    consumer_threads = consumers * WARPGROUP_THREADS
    minus_inf = float32(-math.inf)
    rescale_log2 = float32(RESCALE_LOG2)
    mma_s = wgmma_bf16(block_keys)
    fence_s = wgmma_fence(block_keys)
    wait_s = wgmma_wait(block_keys, 0)
    mma_o = wgmma_bf16_rs(head_dim, True)
    fence_o = wgmma_fence_operands(head_dim, p_words)
    wait_s_but_one = wgmma_wait(block_keys, 1)
    wait_o = wgmma_wait_operands(head_dim, p_words, 0)
    load_page = tma_load_2d(PAGE_SIZE)
    set_registers = tiling.producer_registers > 0  # a producer warpgroup hands its registers to the consumers
    if set_registers:
        lower_registers = set_max_registers(tiling.producer_registers, False)
        raise_registers = set_max_registers(tiling.consumer_registers, True)

    @device_function
    def _work_item(item, num_kv_heads, row_tiles, cu_seqlens, start_pos):
        """(kv head, sequence, first token, rows, first row, cached start, context length, keys) of work
        item ``item``: the block's own grid position, or (persistent) item = (row tiles - 1 - tile) x (kv
        heads x sequences) + sequence x kv heads + kv head, the order a grid (KVH, S, row tiles) runs in.
        Keys: 0 .. the position of the item's last row; 0 if its sequence has fewer rows (nothing to do)."""
        if persistent:
            per_tile = int32(num_kv_heads * (cu_seqlens.shape[0] - 1))
            tile = int32(row_tiles - 1 - div(item, per_tile))
            s = div(mod(item, per_tile), num_kv_heads)
            kv_head = mod(item, num_kv_heads)
        else:
            tile = int32(cuda.gridDim.z - 1 - cuda.blockIdx.z)  # row tiles in reverse: the latest rows first
            s = int32(cuda.blockIdx.y)
            kv_head = int32(cuda.blockIdx.x)
        first_token, num_rows, first_row, start, context_len = row_tile(cu_seqlens, start_pos, group, block_rows, s, tile)
        num_keys = int32(0)
        if first_row < num_rows:
            num_keys = int32(start + div(min(first_row + block_rows, num_rows) - 1, group) + 1)
        return kv_head, s, first_token, num_rows, first_row, start, context_len, num_keys

    @device_function
    def _v_descriptor(tile0, stage):
        """The MN-major descriptor of the V tile in ``stage`` (the B of P V)."""
        return smem_descriptor_mn(tile0 + q_bytes + stage * stage_bytes + kv_bytes, kv_panel_bytes)

    @device_function
    def _take_turn(wg):
        """Ping-pong: wait until the other warpgroup has issued its products (its ``_pass_turn``)."""
        named_barrier(TURN_BARRIER + wg, 2 * WARPGROUP_THREADS)

    @device_function
    def _pass_turn(wg):
        """Ping-pong: this warpgroup's products are issued; the other one may issue its own."""
        named_barrier_arrive(TURN_BARRIER + 1 - wg, 2 * WARPGROUP_THREADS)

    @device_function
    def _mask(acc_s, row_pos, key0, qd):
        """-inf for the keys past each row's position (causal), before the row max."""
        for h in range(2):
            last_key = int32(row_pos[h] - key0 - 2 * qd)  # this thread's keys 8j + e past it are masked
            for j in range(key_blocks):
                for e in range(2):
                    if int32(8 * j + e) > last_key:
                        acc_s[4 * j + 2 * h + e] = minus_inf

    @device_function
    def _softmax(acc_s, row_max, row_sum, alpha, scale_log2):
        """S -> P in place (P = exp2(S c - m c)), l and m updated (``prefill_attention_tc._softmax``'s rule,
        on the wgmma layout: acc[4j + 2h + e] is row h). Returns whether some row of the warp moved its
        m: then O must be multiplied by ``alpha`` (``_rescale``) before this tile's P V is added."""
        moved = False
        chains = cuda.local.array(CHAINS, float32)  # partial maxima, then sums: independent dependency chains
        for h in range(2):
            for c in range(CHAINS):
                chains[c] = minus_inf
            for j in range(key_blocks):
                for e in range(2):
                    chains[(2 * j + e) % CHAINS] = max(chains[(2 * j + e) % CHAINS], acc_s[4 * j + 2 * h + e])
            tile_max = max(max(chains[0], chains[1]), max(chains[2], chains[3]))
            tile_max = max(tile_max, cuda.shfl_xor_sync(FULL_MASK, tile_max, 1))  # the quad shares the row
            tile_max = max(tile_max, cuda.shfl_xor_sync(FULL_MASK, tile_max, 2))
            move = (tile_max - row_max[h]) * scale_log2 > rescale_log2  # True on the first tile (m = -inf)
            m_new = tile_max if move else row_max[h]
            alpha[h] = math.exp2((row_max[h] - m_new) * scale_log2)  # exactly 1 if m stays; 0 on tile 0
            moved = moved or move
            row_max[h] = m_new
            row_sum[h] *= alpha[h]
        for h in range(2):
            m_scaled = row_max[h] * scale_log2
            for c in range(CHAINS):
                chains[c] = float32(0.0)
            for j in range(key_blocks):
                for e in range(2):
                    p = math.exp2(acc_s[4 * j + 2 * h + e] * scale_log2 - m_scaled)
                    acc_s[4 * j + 2 * h + e] = p
                    chains[(2 * j + e) % CHAINS] += p
            row_sum[h] += (chains[0] + chains[1]) + (chains[2] + chains[3])
        return cuda.any_sync(FULL_MASK, moved)

    @device_function
    def _rescale(acc_o, alpha):
        """O's rows times their alpha (rows 16w + g: h = 0, + 8: h = 1)."""
        for j in range(dim_blocks):
            acc_o[4 * j] *= alpha[0]
            acc_o[4 * j + 1] *= alpha[0]
            acc_o[4 * j + 2] *= alpha[1]
            acc_o[4 * j + 3] *= alpha[1]

    @device_function
    def _pack_p(acc_s, pa):
        """P's fp32 pairs rounded into bf16 pairs: S's columns 16kk .. 16kk + 15 are the A registers of
        the P V k-step kk (the accumulator layout is the register layout of A)."""
        for kk in range(key_steps):
            pa[4 * kk] = pack_bf16x2(acc_s[8 * kk], acc_s[8 * kk + 1])  # row g, keys 2q, 2q + 1
            pa[4 * kk + 1] = pack_bf16x2(acc_s[8 * kk + 2], acc_s[8 * kk + 3])  # row g + 8
            pa[4 * kk + 2] = pack_bf16x2(acc_s[8 * kk + 4], acc_s[8 * kk + 5])  # row g, keys 8 + 2q, ..
            pa[4 * kk + 3] = pack_bf16x2(acc_s[8 * kk + 6], acc_s[8 * kk + 7])  # row g + 8

    @device_function
    def _zero_v_tail(smem, v_word0, first, tw, wg):
        """Zero the V rows ``first`` .. the tile's end (stale slots of the last page past the context,
        and pages not copied: they hold whatever the stage held before) in the stage whose V tile
        starts at word ``v_word0``, every panel, and make the zeros visible to this warpgroup's wgmma
        (the async proxy, every warp). The other warpgroup may write the same zeros."""
        for panel in range(panels):
            panel_word = int32(v_word0 + panel * kv_panel_bytes // 4)
            # chunk i: row i // 8, 16-byte chunk i % 8 (whole rows are zeroed: the swizzle does not matter)
            for i in range(int32(first * 8 + tw), int32(block_keys * 8), int32(WARPGROUP_THREADS)):
                store_shared_u32x4(smem, int32(panel_word + i * (CHUNK_BYTES // 4)), uint32(0), uint32(0), uint32(0),
                                   uint32(0))  # fmt: skip
        fence_proxy_async()
        named_barrier(1 + wg, WARPGROUP_THREADS)

    @device_function
    def _issue_s(smem, acc_s, desc_q, desc_k):
        """S = Q K^T: the wgmma of one key tile, committed as one group (not waited for)."""
        for i in range(s_count):
            acc_s[i] = float32(0.0)
        fence_s(acc_s)
        for kk in range(d_steps):  # (a k-step past 64 dims starts in the next panel of Q and of K)
            panel, step = kk // panel_steps, kk % panel_steps
            mma_s(acc_s, smem, desc_q + (panel * q_panel_bytes >> 4) + step * DESC_K_STEP,
                  desc_k + (panel * kv_panel_bytes >> 4) + step * DESC_K_STEP)  # fmt: skip
        wgmma_commit()

    @device_function
    def _issue_pv(smem, acc_o, pa, desc_v):
        """O += P V: the wgmma of one key tile, P from ``pa``, committed as one group (not waited for)."""
        fence_o(acc_o, pa)
        for kk in range(key_steps):
            mma_o(acc_o, pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3], smem, desc_v + kk * DESC_MN_K_STEP)
        wgmma_commit()

    @device_function
    def _attend(smem, acc_s, acc_o, pa, row_max, row_sum, row_pos, alpha, desc_q, desc_k, desc_v, v_word0, key0,
                valid_end, masked, scale_log2, qd, tw, wg):
        """One warpgroup's work on the key tile at key0, in order: S = Q K^T, the causal mask if
        ``masked``, the online softmax, O += P V. Called with ``masked`` a constant (two copies)."""
        _issue_s(smem, acc_s, desc_q, desc_k)
        wait_s(acc_s)
        if masked:
            _mask(acc_s, row_pos, key0, qd)
        if _softmax(acc_s, row_max, row_sum, alpha, scale_log2):
            _rescale(acc_o, alpha)
        _pack_p(acc_s, pa)
        if key0 + block_keys > valid_end:  # the block's last tile: rows past the copied keys of the context
            _zero_v_tail(smem, v_word0, valid_end - key0, tw, wg)
        _issue_pv(smem, acc_o, pa, desc_v)
        wait_o(acc_o, pa)

    @device_function
    def _attend_overlapped(smem, acc_s, acc_o, pa, row_max, row_sum, row_pos, alpha, desc_q, desc_k, v_word0, key0,
                           valid_end, masked, scale_log2, qd, tw, wg, has_previous, desc_v_previous):
        """The key tile at key0 with the previous tile's P V in flight beside its softmax: issue S = Q K^T
        and (``has_previous``) the previous tile's O += P V; once S is done (the older group), the mask
        and the softmax run while the tensor cores add P V; then wait for it, rescale O, and round this
        tile's P into ``pa``. Leaves this tile's P V to the next call (or ``_finish_pv``). Called with
        ``masked`` and ``has_previous`` constants (four copies, no branch around a wgmma)."""
        if pingpong:
            _take_turn(wg)
        _issue_s(smem, acc_s, desc_q, desc_k)
        if has_previous:
            _issue_pv(smem, acc_o, pa, desc_v_previous)
        if pingpong:
            _pass_turn(wg)  # the other warpgroup's products run while this one's softmax does
        if has_previous:
            wait_s_but_one(acc_s)  # S's group has completed; the P V after it may still run
        else:
            wait_s(acc_s)
        if masked:
            _mask(acc_s, row_pos, key0, qd)
        moved = _softmax(acc_s, row_max, row_sum, alpha, scale_log2)
        if has_previous:
            wait_o(acc_o, pa)  # the previous P V has completed: O and pa are free
        if moved:
            _rescale(acc_o, alpha)
        _pack_p(acc_s, pa)
        if key0 + block_keys > valid_end:  # the block's last tile: rows past the copied keys of the context
            _zero_v_tail(smem, v_word0, valid_end - key0, tw, wg)

    @device_function
    def _finish_pv(smem, acc_o, pa, desc_v, empty_barrier, tw, wg, turn):
        """The pending tile's O += P V (issued in this warpgroup's ping-pong turn if ``turn``, a constant),
        waited for; then its stage is released."""
        if turn:
            _take_turn(wg)
        _issue_pv(smem, acc_o, pa, desc_v)
        if turn:
            _pass_turn(wg)
        wait_o(acc_o, pa)
        if tw == 0:
            mbarrier_arrive(empty_barrier)

    @kernel(fastmath=True, launch_bounds=(threads, tiling.blocks_per_sm))
    def prefill_attention_wgmma_kernel(q, k_map, v_map, k_rows, v_rows, block_tables, cu_seqlens, start_pos, scale_log2,
                                       out, row_tiles):  # fmt: skip
        """q, out: (T, H, HD) f32; k_map, v_map (16,) uint64: tensor maps of k_rows, v_rows, the caches
        as (num_pages * PAGE_SIZE, KVH * HD) uint16 (bf16 bits; boxes of 16 x 64); block_tables: (S,
        max_pages) int32; cu_seqlens: (S + 1,) int32; start_pos: (S,) int32; scale_log2: scale * log2(e);
        row_tiles: row tiles of the longest sequence (the grid's z without ``persistent``)."""
        smem = cuda.shared.array(0, uint32)  # from a 1024-byte boundary: Q, stages x (K, V), mbarriers
        tid = int32(cuda.threadIdx.x)
        wg = div(tid, WARPGROUP_THREADS)
        base = shared_address(smem, 0)
        pad = (ATOM_BYTES - (base & (ATOM_BYTES - 1))) & (ATOM_BYTES - 1)  # bytes up to an aligned address
        tile0 = base + pad  # shared address of the Q tile; stage i at tile0 + q_bytes + i * stage_bytes
        full = tile0 + barrier_offset  # full[i] at full + 8 i: the stage's copies have landed
        empty = full + stages * BARRIER_BYTES  # empty[i]: every consumer warpgroup is done with the stage
        if tid == 0:
            tensormap_prefetch(k_map)  # the TMA fetches both descriptors while the barriers are set up
            tensormap_prefetch(v_map)
            for i in range(stages):
                mbarrier_init(full + i * BARRIER_BYTES, 1)
                mbarrier_init(empty + i * BARRIER_BYTES, consumers)
            fence_mbarrier_init()
        cuda.syncthreads()
        # Work items (kv head, sequence, row tile), latest row tiles first: one a block, or (persistent)
        # every gridDim.x-th from blockIdx.x, the stage ring running on from one item to the next.
        num_kv_heads = k_rows.shape[1] // head_dim
        num_items = int32(num_kv_heads * (cu_seqlens.shape[0] - 1) * row_tiles) if persistent else int32(1)
        first_item = int32(cuda.blockIdx.x) if persistent else int32(0)
        item_step = int32(cuda.gridDim.x) if persistent else int32(1)

        if wg == consumers:  # the producer warp (or warpgroup, whose first warp copies)
            if set_registers:
                lower_registers()  # (the whole warpgroup) its registers go to the consumers
            if tid < consumer_threads + WARP_LANES:  # its first warp: lane p copies page p of each tile
                p = int32(tid - consumer_threads)
                it = int32(0)  # key tiles copied so far (all items): stage it % stages
                for item in range(first_item, num_items, item_step):
                    kv_head, s, first_token, num_rows, first_row, start, context_len, num_keys = _work_item(
                        item, num_kv_heads, row_tiles, cu_seqlens, start_pos)
                    column = int32(kv_head * head_dim)
                    for kt in range(div(num_keys + block_keys - 1, block_keys)):
                        i = mod(it, stages)
                        first_page = int32(kt * pages_per_tile)
                        pages = min(pages_per_tile, int32(div(num_keys + PAGE_SIZE - 1, PAGE_SIZE) - first_page))  # holding keys
                        # the lane's table entry, read while the stage may still be in use (one load a tile, not a
                        # page: a page's copy waits for its entry)
                        row = block_tables[s, first_page + p] * PAGE_SIZE if p < pages else 0
                        if it >= stages:  # wait for the consumers' release of the stage's previous use
                            mbarrier_wait(empty + i * BARRIER_BYTES, (div(it, stages) + 1) & 1)
                        it = int32(it + 1)
                        barrier = full + i * BARRIER_BYTES
                        if p == 0:
                            mbarrier_arrive_expect_tx(barrier, pages * 2 * panels * PAGE_BYTES)
                        cuda.syncwarp()  # (the bytes are expected before any copy can complete them)
                        if p < pages:
                            for panel in range(panels):
                                dst = tile0 + q_bytes + i * stage_bytes + panel * kv_panel_bytes + p * PAGE_BYTES
                                load_page(smem, dst, k_map, k_rows, column + panel * TILE_K, row, barrier)
                                load_page(smem, dst + kv_bytes, v_map, v_rows, column + panel * TILE_K, row, barrier)
            return

        if set_registers:
            raise_registers()  # (waits until the producer has lowered its own)
        tw = mod(tid, WARPGROUP_THREADS)
        lane = mod(tid, WARP_LANES)
        warp = div(tw, WARP_LANES)
        g = int32(lane >> 2)
        qd = int32(lane & 3)
        acc_s = cuda.local.array(s_count, float32)  # S, then P, of one key tile (64 x block_keys)
        acc_o = cuda.local.array(o_count, float32)  # O, unnormalised (64 x head_dim)
        pa = cuda.local.array(p_words, uint32)  # P rounded to bf16 pairs: A of the P V wgmma
        row_max = cuda.local.array(2, float32)  # m of rows 16 warp + g (h = 0) and + 8 (h = 1)
        row_sum = cuda.local.array(2, float32)  # this thread's share of their l
        row_pos = cuda.local.array(2, int32)  # their positions
        alpha = cuda.local.array(2, float32)  # their rescale factors on one key tile
        q_chunks = cuda.local.array(q_chunk_values, float32)  # the thread's share of Q on its way to shared memory
        desc_q = smem_descriptor(tile0 + wg * WGMMA_M * SWIZZLE_ROW_BYTES)
        if pingpong and wg == 1:
            named_barrier_arrive(TURN_BARRIER, 2 * WARPGROUP_THREADS)  # warpgroup 0 takes the first turn
        # (*) A stage is released by one thread once the warpgroup is done with it; its next use can then
        # complete the full mbarrier's next phase. A thread that had not yet waited for the skipped use
        # would then wait on the parity of a phase two ahead (the parity of one still to come): it hangs.
        it = int32(0)  # key tiles consumed so far (all items): stage it % stages, phase it // stages
        for item in range(first_item, num_items, item_step):
            kv_head, s, first_token, num_rows, first_row, start, context_len, num_keys = _work_item(
                item, num_kv_heads, row_tiles, cu_seqlens, start_pos)
            if num_keys == 0:
                continue  # this sequence has fewer rows than the longest one (the producer copies nothing)
            # Keys whose K/V rows hold values: the context, within the pages copied (whole pages up to num_keys)
            valid_end = min(context_len, int32(div(num_keys + PAGE_SIZE - 1, PAGE_SIZE) * PAGE_SIZE))
            wg_row0 = int32(first_row + wg * WGMMA_M)
            active = wg_row0 < num_rows  # else all its rows are padding: it only releases the stages

            # Q: this warpgroup's 64 rows rounded to bf16, 16 bytes (8 dims) a store, chunk c of row r at
            # chunk c ^ (r % 8) of its 64-dim panel (the 128-byte swizzle).
            if persistent:
                named_barrier(1 + wg, WARPGROUP_THREADS)  # every warp's wgmma on the previous item's Q is done
            for j0 in range(0, q_passes, Q_PASSES_AT_ONCE):  # a group's loads first (16 bytes each): their latencies overlap
                for j in range(Q_PASSES_AT_ONCE):
                    i = int32(tw + (j0 + j) * WARPGROUP_THREADS)
                    row = min(int32(wg_row0 + div(i, row_chunks)), int32(num_rows - 1))  # padding repeats the last row
                    token = int32(first_token + div(row, group))
                    head = int32(kv_head * group + mod(row, group))
                    d = int32(mod(i, row_chunks) * 8)
                    q_chunks[8 * j], q_chunks[8 * j + 1], q_chunks[8 * j + 2], q_chunks[8 * j + 3] = load_f32x4(
                        q, (token, head, d))
                    q_chunks[8 * j + 4], q_chunks[8 * j + 5], q_chunks[8 * j + 6], q_chunks[8 * j + 7] = load_f32x4(
                        q, (token, head, d + 4))
                for j in range(Q_PASSES_AT_ONCE):
                    i = int32(tw + (j0 + j) * WARPGROUP_THREADS)
                    r = div(i, row_chunks)
                    c = mod(i, row_chunks)
                    offset = int32(div(c, 8) * q_panel_bytes + (wg * WGMMA_M + r) * SWIZZLE_ROW_BYTES
                                   + (mod(c, 8) ^ mod(r, 8)) * CHUNK_BYTES)  # fmt: skip
                    v = 8 * j  # the chunk's first value in q_chunks
                    store_shared_u32x4(
                        smem, div(pad + offset, 4),
                        pack_bf16x2(q_chunks[v], q_chunks[v + 1]), pack_bf16x2(q_chunks[v + 2], q_chunks[v + 3]),
                        pack_bf16x2(q_chunks[v + 4], q_chunks[v + 5]), pack_bf16x2(q_chunks[v + 6], q_chunks[v + 7]),
                    )  # fmt: skip
            fence_proxy_async()  # the stores are visible to the wgmma (the async proxy) ...
            named_barrier(1 + wg, WARPGROUP_THREADS)  # ... of every warp of the warpgroup

            for h in range(2):
                row = min(int32(wg_row0 + warp * 16 + h * 8 + g), int32(num_rows - 1))
                row_pos[h] = start + div(row, group)
                row_max[h] = minus_inf
                row_sum[h] = float32(0.0)
            for i in range(o_count):
                acc_o[i] = float32(0.0)
            wg_first_pos = int32(start + div(min(wg_row0, int32(num_rows - 1)), group))
            wg_last_pos = int32(start + div(min(int32(wg_row0 + WGMMA_M), num_rows) - 1, group))

            previous = -1  # overlap: the stage of the tile whose P V is still to add, if any
            for kt in range(div(num_keys + block_keys - 1, block_keys)):
                i = mod(it, stages)
                key0 = int32(kt * block_keys)
                uses = active and key0 <= wg_last_pos
                if uses or tw == 0:  # a tile this warpgroup skips: only the thread that releases it waits (*)
                    mbarrier_wait(full + i * BARRIER_BYTES, div(it, stages) & 1)
                it = int32(it + 1)
                if uses:
                    k_tile = tile0 + q_bytes + i * stage_bytes
                    desc_k = smem_descriptor(k_tile)
                    v_word0 = div(pad + q_bytes + i * stage_bytes + kv_bytes, 4)
                    masked = int32(key0 + (block_keys - 1)) > wg_first_pos  # the tile reaches past the first row's position
                    if overlap:
                        desc_v_previous = _v_descriptor(tile0, max(previous, 0))  # (unused on the first tile)
                        if previous < 0 and masked:
                            _attend_overlapped(smem, acc_s, acc_o, pa, row_max, row_sum, row_pos, alpha, desc_q, desc_k,
                                               v_word0, key0, valid_end, True, scale_log2, qd, tw, wg, False, desc_v_previous)
                        elif previous < 0:
                            _attend_overlapped(smem, acc_s, acc_o, pa, row_max, row_sum, row_pos, alpha, desc_q, desc_k,
                                               v_word0, key0, valid_end, False, scale_log2, qd, tw, wg, False, desc_v_previous)
                        elif masked:
                            _attend_overlapped(smem, acc_s, acc_o, pa, row_max, row_sum, row_pos, alpha, desc_q, desc_k,
                                               v_word0, key0, valid_end, True, scale_log2, qd, tw, wg, True, desc_v_previous)
                        else:
                            _attend_overlapped(smem, acc_s, acc_o, pa, row_max, row_sum, row_pos, alpha, desc_q, desc_k,
                                               v_word0, key0, valid_end, False, scale_log2, qd, tw, wg, True, desc_v_previous)
                        if previous >= 0 and tw == 0:  # the previous tile's P V has completed
                            mbarrier_arrive(empty + previous * BARRIER_BYTES)
                        previous = i  # this stage is released once its P V has run
                        continue
                    desc_v = _v_descriptor(tile0, i)
                    if masked:
                        _attend(smem, acc_s, acc_o, pa, row_max, row_sum, row_pos, alpha, desc_q, desc_k, desc_v, v_word0,
                                key0, valid_end, True, scale_log2, qd, tw, wg)  # fmt: skip
                    else:
                        _attend(smem, acc_s, acc_o, pa, row_max, row_sum, row_pos, alpha, desc_q, desc_k, desc_v, v_word0,
                                key0, valid_end, False, scale_log2, qd, tw, wg)  # fmt: skip
                elif overlap and previous >= 0:  # past this warpgroup's rows: add the pending P V first (its turn)
                    _finish_pv(smem, acc_o, pa, _v_descriptor(tile0, previous), empty + previous * BARRIER_BYTES, tw, wg,
                               pingpong)  # fmt: skip
                    previous = -1
                elif pingpong:  # nothing to issue: pass the turn on
                    _take_turn(wg)
                    _pass_turn(wg)
                if tw == 0:
                    mbarrier_arrive(empty + i * BARRIER_BYTES)
            if overlap and previous >= 0:  # (no turn: the other warpgroup may have none left in this item)
                _finish_pv(smem, acc_o, pa, _v_descriptor(tile0, previous), empty + previous * BARRIER_BYTES, tw, wg,
                           False)  # fmt: skip

            if active:
                for h in range(2):
                    total = row_sum[h]
                    total += cuda.shfl_xor_sync(FULL_MASK, total, 1)  # the quad's four shares of l
                    total += cuda.shfl_xor_sync(FULL_MASK, total, 2)
                    row = int32(wg_row0 + warp * 16 + h * 8 + g)
                    if row < num_rows:
                        token = int32(first_token + div(row, group))
                        head = int32(kv_head * group + mod(row, group))
                        inv = float32(1.0) / total
                        for j in range(dim_blocks):
                            store_f32x2(out, (token, head, 8 * j + 2 * qd), acc_o[4 * j + 2 * h] * inv,
                                        acc_o[4 * j + 2 * h + 1] * inv)  # fmt: skip
        if pingpong and wg == 0:
            named_barrier(TURN_BARRIER, 2 * WARPGROUP_THREADS)  # warpgroup 1's last pass: every arrival met

    return prefill_attention_wgmma_kernel


def check_wgmma_attention(head_dim: int) -> None:
    """Raise KernelError (one line) unless this kernel can run here: an H100 or H200 (or the
    simulator), a head dim of whole 64-dim panels. The model checks it when it is built."""
    if not simulator_enabled() and not hopper():
        raise KernelError("prefill_attention 'wgmma' needs an H100 or H200 (sm_90a); other GPUs run 'tensor_cores'")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise KernelError(f"prefill_attention 'wgmma': head_dim {head_dim} not supported (one of {SUPPORTED_HEAD_DIMS}); "
                          "use 'tensor_cores'")  # fmt: skip


def _tensor_map(cache):
    """The tensor map of a cache's ``page_rows``, in boxes of 16 x 64."""
    rows = page_rows(cache)
    return tensor_map_2d(rows, rows.shape[0], PAGE_SIZE)


def cache_operands(k_cache, v_cache):
    """(k_rows, v_rows, k_map, v_map) of a layer's caches, made once per cache array and kept while it
    lives (``kept_views``): the views and their tensor-map lookups cost more host time than the
    launch itself."""
    return (page_rows(k_cache), page_rows(v_cache), kept(k_cache, "tensor_map", _tensor_map),
            kept(v_cache, "tensor_map", _tensor_map))


def prefill_attention_wgmma(q, k_cache, v_cache, block_tables, cu_seqlens, start_pos, scale: float, out,
                            max_new_tokens: int | None = None, tiling: Tiling | None = None) -> None:
    """Causal attention of a ragged batch of new tokens over their sequences' cached K/V, on Hopper's
    wgmma. The arguments are ``prefill_attention``'s (q: (T, H, HD) f32; k_cache, v_cache: (num_pages,
    PAGE_SIZE, KVH, HD) bf16; block_tables: (S, max_pages) int32; cu_seqlens: (S + 1,) int32;
    start_pos: (S,) int32; out: (T, H, HD) f32; max_new_tokens: the longest sequence's new tokens,
    read from cu_seqlens when None); ``tiling`` forces one (tests, benchmarks), else
    ``default_tiling(head_dim, context)``, the context bounded by the block table's width (the longest
    sequence's pages)."""
    shape = check_prefill_args("prefill_attention_wgmma", q, k_cache, v_cache, block_tables, cu_seqlens, start_pos, out,
                               max_new_tokens)  # fmt: skip
    if shape is None:
        return
    group, head_dim, num_kv_heads, num_seqs, max_new_tokens = shape
    check_wgmma_attention(head_dim)
    if not (vector_aligned(q) and vector_aligned(out)):
        raise KernelError("prefill_attention_wgmma: q and out must start 16-byte aligned (whole rows of a device array)")
    tiling = tiling or default_tiling(head_dim, block_tables.shape[1] * PAGE_SIZE)
    kernel_ = prefill_attention_wgmma_kernel_for(group, head_dim, tiling)
    k_rows, v_rows, k_map, v_map = cache_operands(k_cache, v_cache)
    num_row_tiles = -(-max_new_tokens * group // tiling.block_rows)
    grid = (num_kv_heads, num_seqs, num_row_tiles)
    if tiling.persistent:
        grid = (min(num_kv_heads * num_seqs * num_row_tiles, num_sms() * tiling.blocks_per_sm), 1, 1)
    launch(kernel_, grid, tiling.threads, q, k_map, v_map, k_rows, v_rows, block_tables, cu_seqlens, start_pos,
           np.float32(scale * LOG2_E), out, np.int32(num_row_tiles), shared_bytes=tiling.shared_bytes(head_dim))
