"""Hopper tensor-core matrix product: out (M, N) f32 = x (M, K) @ w (N, K) bf16 .T (or out += ...).

The contract of ``gemm_tc.py`` (same arguments, same rounding: x is rounded to bf16, products are
accumulated in fp32), computed with ``wgmma.mma_async`` (``wgmma.py``): a warpgroup of 128 threads
multiplies a 64 x 16 slice of x by a 16 x ``block_n`` slice of w.T per instruction, both read from
shared memory, the accumulators in registers. Needs sm_90a (an H100 or H200); ``linear`` sends
other GPUs to ``gemm_tc``.

Data flow:

- x is rounded to bf16 once per call by ``_x_to_bf16_kernel`` into a fixed workspace, so both
  operands go from global to shared memory by the Tensor Memory Accelerator (TMA), in the 128-byte
  swizzled layout wgmma reads, with no pass through registers. Past ``X_WORKSPACE_VALUES`` values
  the product is done in row chunks that fit. Or the kernel that makes x writes its bf16 copy there
  itself (``rms_norm`` and ``silu_and_mul`` with a uint16 output, into the view
  ``bf16_x_destination`` returns: (M, K) row-major from the workspace's start, no padding, all M
  rows at once) and the call says where (``x_copy=`` that buffer): no conversion launch, and no
  second pass over the f32 x. ``matmul.linear`` decides which.
- SwiGLU in the epilogue (``gemm_wgmma_silu_mul``, the gate/up product of a Llama MLP, w = [gate;
  up]): a block's w slice is two TMA boxes, ``block_n / 2`` gate rows and the same rows of up, so
  its accumulators hold matching gate and up columns; the epilogue writes bf16(silu(g) * u) into a
  second buffer (``act_bf16``) that the down product then reads as its x (``x_copy``). The (M, 2F)
  f32 product is never written nor read back. On an H200, one Llama 3.2 1B MLP (norm, gate/up,
  SwiGLU, down; CUDA events around the calls) took 471 us instead of 672 at M = 2,048 and 164
  instead of 261 at M = 256; batch-32 decode steps 1.56 ms instead of 1.63.
- A block is ``consumers`` warpgroups that compute (64 rows of the ``block_m x block_n`` output
  tile each, ``block_m = 64 * consumers``) and one more, the producer, whose four warps take turns
  (lane 0 of warp w issues the copies of K steps w, w + 4, ...: ``COPIERS``): per K step of
  ``BLOCK_K`` = 64 values, one TMA box of x (block_m x 64) and one of w (block_n x 64) into a stage
  of the pipeline (``stages`` of them in dynamic shared memory, over 48 KB: the launch opts in, see
  ``_launch.launch``), from a 1024-byte aligned address. The tensor
  maps (``_tensor_map``: CUtensorMaps in global memory, made once per matrix and cached) describe
  the matrices; boxes past M, N or K are filled with zeros by the TMA.
- Synchronisation, with no block-wide barrier in the main loop: each stage has a *full* mbarrier
  (the producer's arrival plus the bytes of its two copies) and an *empty* one (one arrival per
  consumer warpgroup). The producer waits until a stage is empty before refilling it, so it runs
  up to ``stages`` K steps ahead of the tensor cores. A consumer waits until a stage is full, issues
  its 4 wgmma (k = 16 each) and commits them; once the wgmma of the previous step have completed
  (``wgmma.wait_group 1``: the current step's stay in flight) it releases the previous step's stage.
  A tiling with ``k_group`` 2 (TALL) takes two stages a wait and commits their 8 wgmma as one group:
  half the waits, commits and releases per K. K is then counted in groups of two slices (a split's
  parts are whole groups; the last group may reach past K, where the TMA copies zeros). Not in a K
  split over a cluster, which was slower so (``slices_a_wait``).
- Persistent grid: at most as many blocks as fit on the GPU at once; block b takes output tiles b,
  b + gridDim.x, ... The producer and the consumers count K steps over all of the block's tiles
  (stage = step % stages, parity from step // stages), so the producer loads the next tile's first
  stages while the consumers finish the current tile and store it: the tile's epilogue and the
  next tile's pipeline fill overlap, and no block pays a launch and an empty pipeline per tile.
- Epilogue straight from the registers: thread (warp w, g, q) holds columns 8j + 2q, 8j + 2q + 1 of
  rows 16w + g and 16w + g + 8 (``wgmma.py``), and writes each pair as one 8-byte store: a warp's
  store covers 8 rows x 32 bytes, whole sectors. With ``accumulate`` every load of out comes first,
  then every store (a store between two loads would hold the second back by one memory latency:
  the compiler cannot tell that they do not alias). With SwiGLU, the gate column c and the up
  column block_n / 2 + c sit in the same thread, so it writes bf16(silu(g) * u) pairs (one uint32)
  with no exchange. Every index into the accumulators must be a constant once the loops unroll
  (else the array goes to local memory): the epilogue's loops are kept small enough for the
  compiler to unroll them (``swiglu`` uses an approximate reciprocal for this; the tests assemble
  every tiling and fail on local memory).

Grids and splits (``pick_plan``): the tile size is the largest of LARGE (128 x 256), SMALL (64 x 128)
and TINY (64 x 64) whose grid reaches three quarters of the SMs (128-row tiles only for more than
64 rows); K is split only when few tiles meet a long K (parts of at least 2048); then the pipeline
depth follows the grid: at most one block per SM gets the deeper SMALL_DEEP (6 stages), more
blocks than SMs the shallower TINY_SHALLOW (4 stages, three blocks an SM); decode batches of 257-512
rows on a 2048-row weight take TALL's 128 x 64 tiles, whose K steps feed twice the MMA of a 64 x 64
tile's for 1.5 times the bytes (and 129-512 rows of a K of 4096 split K in a cluster, below). Part z of a K split
takes the slices z * S / parts .. (z + 1) * S / parts of the S slices of K. The parts of a long K
never leave the kernel: every block writes its accumulators to a workspace, as its threads hold
them (coalesced), and counts itself on its output tile's counter (an atomic add after a
``threadfence``); the block that arrives last sums every part in order of z (the same additions
whichever block it is: deterministic), sets the counter back to zero, and runs the epilogue, SwiGLU
included. Consecutive tile numbers walk the M tiles when there are few of them (the blocks that
run together share each w tile: a 128256-row head is read from memory once, not once per M tile),
else the N tiles (w of a layer fits in L2, x streams once).

K split over a cluster (``cluster`` 2 or 4, ``cluster.py``): where TINY tiles would leave half the
SMs idle on a K that is otherwise split at most two ways (M <= 128 on the 2048 x 2048 and 2048 x
8192 weights, M <= 64 on the 3072 x 2048 q/k/v one), and on a K of 4096 or more past 128 rows
(MEDIUM's 128 x 128 or TALL's 128 x 64 tiles at M = 129 .. 512 on the 2048 x 8192 weight),
``pick_plan`` launches clusters of two blocks, one per half of K, that sum their parts through each
other's shared memory. Block r of the cluster owns the
columns 8j of the tile with j // (block_n / 8 / cluster) == r. After its K loop, each consumer
thread writes the accumulators of block r's columns into slot (its own rank) of block r's receive
buffer (16-byte ``st.shared::cluster`` stores, the layout its threads hold them in), arrives on
block r's ``parts_in`` mbarrier (release, cluster scope), and waits on its own (acquire): then every
part of its columns is in its memory, and it adds them in order of rank (deterministic) and runs the
epilogue on its columns alone. Before the next tile's writes it waits on ``parts_read``, on which
every block arrives once it has read its slots (not after the last tile: a block may have exited).
No global memory, fence or atomic on the way: on an H200 a 64 x 2048 x 2048 product went from 9.6
to 8.2 us (cuBLAS 6.2), 128 rows from 9.6 to 8.5. Four-block clusters and bigger tiles split in a
cluster were tried on the same shapes and were slower or within 3% (a cluster's blocks must share a
GPC, so fewer fit at once: the launch caps the persistent grid at the clusters that run together,
``_launch.max_active_clusters``). LARGE has no room for the receive buffer (block_m x block_n f32);
SwiGLU's epilogue needs gate and up columns a whole tile apart, so it splits through global memory.

Tiles' copies shared in a cluster (``multicast`` = (mc_m, mc_n), ``cluster.tma_load_2d_multicast``):
the blocks of a decode-sized product all stream tiles the others stream too (the M tiles of one N
tile read the same w slices, the N tiles of one M tile the same x slices), and each block's copies
are its own reads of the L2. A cluster of mc_m x mc_n blocks takes mc_m consecutive M tiles of mc_n
consecutive N tiles (the cluster's tile; clusters walk them as blocks walk output tiles); per K
step, each block copies 1 / mc_m of the w slice into the mc_m blocks of its N tile at once, and 1 /
mc_n of the x slice into the mc_n blocks of its M tile: the L2 sends each byte once per cluster,
to several SMs. Each block's *full* mbarrier still expects the whole stage's bytes (its own copies
and the others'), and a block may refill a stage only when the consumers of every block it copies
into have released it: a consumer arrives on the *empty* mbarrier of every block of the cluster,
which expects ``consumers x mc`` arrivals (``mbarrier_arrive_remote``: a CTA-scope release, since
the arrival only says that reads are done; the cluster-scope release of ``mbarrier_arrive_cluster``
costs a fence that stalled every K step by ~0.7 us on an H200, the product 2.5-3.5x). A block
whose tile lies past the matrix still copies its slices (zeros past M, N) and stores nothing. At
the end the copying thread waits until every stage it filled has been released by every block's
consumers before its block may exit: then no arrival on its mbarriers is still to come. cuBLAS's
kernels for these shapes share their tiles the same way (Nsight Compute on an H200: 64 x 64 tiles,
13 stages, three warpgroups, in clusters of 2 x 1 at M = 256; 128 x 64 in 1 x 2 at M = 512 of a
2048 x 2048 weight). Here it does not pay, and ``pick_plan`` does not choose it: on an H200
(``gemm_plans.py --multicast 2x1 1x2``, events behind a sleeping kernel) 256 x 2048 x 2048 took
12.9 us as TINY tiles, 13.3 in clusters of 2 x 1 or 1 x 2 (cuBLAS 9.9); 256 x 2048 x 8192 33.3
and 34.3 (24.0); 512 x 2048 x 2048 17.2 as SMALL tiles, 18.1 and 18.7 shared. A quarter fewer L2
reads changed nothing because the L2 is not what bounds these products: Nsight Compute put its
throughput at 29-41% of peak during them. Each block's K loop is what bounds them (below).

Requirements: K % 8 == 0 and w 16-byte aligned (TMA row strides and addresses), and N even with
out 8-byte aligned (the epilogue stores column pairs); otherwise ``gemm_wgmma`` hands the product
to ``gemm_tc``. Every Llama-family shape meets them. The x workspace is shared by every call:
products run one after another on one stream.

Measured on an H200 (2026-12-02, ``numba-vllm bench kernels --only gemm_wgmma``: CUPTI kernel time,
L2 flushed before each call; the product as the model runs it, x's bf16 copy already written by the
kernel before; torch is cuBLAS bf16 ``matmul`` on bf16 x, in the same run; "before": the same rows
that morning, one tile per block and the epilogue through shared memory):

    M x N x K           plan, M = 64, 128, 256, 512     product (us)              torch (us)              before (us)
    4096 x 8192 x 2048  LARGE                           220 (625 TFLOP/s)         180                     279 (493 TFLOP/s)
    M x 2048 x 2048     TINY/c2 x 2, TINY, SMALL_DEEP   8.2, 8.5, 10.1, 14.8      6.2, 6.4, 6.8, 9.0      10.1, 10.2, 10.5, 16.3
    M x 8192 x 2048     TINY, SMALL_DEEP, SMALL, LARGE  14.2, 17.6, 21.2, 29.3    13.6, 13.7, 16.3, 25.4  15.5, 19.6, 25.8, 38.8
    M x 16384 x 2048    SMALL_DEEP, SMALL, LARGE x 2    24.9, 26.2, 32.5, 53.8    23.7, 24.5, 28.2, 46.3  27.0, 30.6, 42.4, 73.7
    M x 2048 x 8192     TINY/4, TINY/2, TINY, SMALL/2   18.2, 22.3, 30.4, 37.2    15.9, 18.9, 21.2, 32.3  19.7, 23.2, 29.9, 40.3
    M x 128256 x 2048   SMALL, LARGE x 3                146, 162, 224, 401        151, 150, 198, 376      161, 192, 290, 504

The plans in this table are that day's; since then (2026-12-03, docs/benchmarks.md) 512 x 2048 x
2048 runs on TALL tiles (13.1 us), 256 x 2048 x 8192 on TALL split in a cluster (25.6 us), and the
four copiers took 256 x 2048 x 2048 to 9.8 us.

The plan came from a sweep of every tiling (the five of ``TILE_CONFIGS`` and a 128 x 128 one)
and split (1-8) at M = 32 .. 2048 on these weights (``benchmarks/gemm_plans.py``,
docs/benchmarks.md): it picks the fastest within 2% everywhere; rerun with the persistent grid at
M = 32 .. 512, it still does among ``TILE_CONFIGS`` (tilings outside them, below, were at most 7%
faster on a few shapes). The
conversion of x, where it runs, comes on top: 2-3 us at K = 2048 and M <= 256, 18 us at M = 4096.
gemm_tc took 2-4x longer on every one of these shapes. What bounds this kernel, from the same runs
and ptxas (CUDA 13.5): LARGE uses 168 registers (its cap: 384 threads, one block an SM), no spills,
194 KB of shared memory; each block loads its own x and w boxes (no cluster multicast: 48 KB per K
step for 4 MFLOP), and the output is f32 (twice cuBLAS's bf16 bytes). On decode shapes, one
block's pipeline is the bound: a 64 x 2048 x K product on 32 TINY blocks (CUDA events behind a
sleeping kernel, same H200) takes 6.7 us at K = 64 (an empty launch: 2.8; cuBLAS 5.1) and 0.19 us
more per 64 of K (cuBLAS 0.15), 0.16 with the weight already in L2, so the memory's bandwidth is
not what limits it. Tried on the 2048 x 2048 weight at M = 64 .. 256 (``gemm_plans.py --extra``,
events behind a sleep): 12 stages of TINY instead of 8 (no faster), 64 x 32 tiles (twice the blocks:
at most 7% faster), and two accumulator sets a thread, the odd k16 slices of every step in the
second (two wgmma chains in flight: within 2%). So neither the chain of wgmma nor the bytes in
flight past 8 stages bound it; what is left is each step's round trip (the consumer's release, the
producer's wait and TMA issue, the copy's latency) and the fixed cost before the first step. A K
split through global memory fills more SMs but pays a serial chain of its own (parts written,
fence, atomic count, the last block's loads: ~3 us), so on K = 2048 it does not win; summed in a
cluster (above) it does, where half the SMs would idle. At M = 256 and 512 on the 2048 x 2048
weight every SM already has a tile, and no tiling or split, in a cluster or not, came within 1.4x
of cuBLAS (``gemm_plans.py --clusters --extra 2x128x4``: 128 x 128 tiles split 2 ways in a cluster
6% faster at M = 512, 14% when adding into out, slower at 256; ``pick_plan`` takes them at 512).
Nor did clusters multicasting the shared operand (above). The tensor maps are prefetched as the
kernel starts (``tensormap_prefetch``, in place of an acquire fence before the first copy): 0.1-0.4
us off every product (H200, 2026-12-03, CUPTI, median of 40: 64 x 2048 x 256 4.06 -> 3.84 us, 256 x
2048 x 2048 9.76 -> 9.57, 512 x 2048 x 2048 12.99 -> 12.77, 128 x 8192 x 2048 17.34 -> 16.98;
dropping the fence alone, or touching the maps into L2 after the flush, changed nothing).

Where a decode product's K loop spends its time (H200, 2026-12-03, builds with the copies or the
wgmma switched off, events behind a sleeping kernel; 256 x 2048 x 8192 on TINY tiles, one copying
thread): the product 33.2 us, copies and barriers alone 30.2, wgmma and barriers alone 26.9, the
barriers alone 15.2 (cuBLAS 23.5). The barriers alone cost ~0.08 us a K step, and two consumer
warpgroups taking turns over a tile's K steps (their sums added at the end) left that unchanged
(15.8) while they did cut the wgmma-alone time (25.1 -> 20.9 in that run): the bound was the single
copying thread's chain per step (wait for the empty stage, arrive with the byte count, issue two TMA
copies; ``benchmarks/gemm_bounds.py`` builds and times these reductions). With
the producer's four warps taking turns (``COPIERS``), in one run against one copying thread: 256 x
2048 x 2048 13.9 -> 12.2 us (cuBLAS 9.9), 256 x 2048 x 8192 38.6 -> 30.8 (23.8), 128 x 2048 x 8192
on TINY 38.1 -> 29.8, 512 x 2048 x 2048 on SMALL_DEEP 18.0 -> 16.0 and on MEDIUM in a cluster 16.6
-> 16.1 (12.2); the barriers alone 24.4 -> 16.3 at 256 x 2048 x 8192. (That machine ran the one-
thread build slower than the previous run's, 38.6 against 33.6 us; the four-copier build was faster
than both.) Consumers taking turns stayed slower than one consumer even with four copiers (13.1 and
34.7 us), so they are not kept. Next: launches that overlap the previous kernel's tail
(programmatic dependent launch), and the copies, which now bound the product (copies alone 29.0 us
at 256 x 2048 x 8192 with four copiers).
"""

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, uint32

from numba_vllm.kernels._launch import KernelError, launch, max_active_clusters, num_sms
from numba_vllm.kernels.activation import swiglu
from numba_vllm.kernels.cluster import (
    cluster_address,
    cluster_sync,
    mbarrier_arrive_cluster,
    mbarrier_arrive_remote,
    mbarrier_wait_cluster,
    store_cluster_f32x4,
    tma_load_2d_multicast,
)
from numba_vllm.kernels.gemm_tc import gemm_tc
from numba_vllm.kernels.gemv import check_linear_args, weight_bits
from numba_vllm.kernels.jit import device_function, kernel
from numba_vllm.kernels.mma import pack_bf16x2
from numba_vllm.kernels.reductions import WARP_SIZE
from numba_vllm.kernels.vector_load import load_f32x2, load_shared_f32x4, store_f32x2, vector_aligned
from numba_vllm.kernels.wgmma import (
    ATOM_BYTES,
    DESC_K_STEP,
    SWIZZLE_ROW_BYTES,
    TILE_K,
    WARPGROUP_THREADS,
    WGMMA_K,
    WGMMA_M,
    fence_mbarrier_init,
    mbarrier_arrive,
    mbarrier_arrive_expect_tx,
    mbarrier_init,
    mbarrier_wait,
    named_barrier,
    shared_address,
    smem_descriptor,
    tensor_map_2d,
    tensormap_prefetch,
    tma_load_2d,
    wgmma_bf16,
    wgmma_commit,
    wgmma_fence,
    wgmma_wait,
)

BLOCK_K = TILE_K  # 64 values of K per pipeline stage (one 128-byte swizzled row)
CHUNK_VALUES = 8  # K must be a multiple of this (16-byte TMA row strides)
PAIR_BYTES = 8  # the epilogue's stores: two f32 columns at once
BARRIER_BYTES = 8  # one mbarrier
FLAG_BYTES = 8  # after the mbarriers: the word that tells a split's blocks which of them sums the parts
CONSUMERS_BARRIER = 1  # named barrier of the consumer warpgroups (0 is syncthreads)
COPIERS = WARPGROUP_THREADS // WARP_SIZE  # threads that issue the copies, one per warp of the producer warpgroup, in turn
X_WORKSPACE_VALUES = 32 * 1024 * 1024  # bf16 copy of x of a call without the model's workspace: 64 MB, made once
MIN_SPLIT_TILES = 32  # split K only into parts of at least this many BLOCK_K slices (2048 of K)
MIN_CLUSTER_PART_SLICES = 8  # a split over a cluster keeps parts of at least this many slices (512 of K)
LONG_K_SLICES = 64  # from this many BLOCK_K slices (4096 of K), decode batches past 128 rows split K in a cluster
CONVERT_THREADS = 256
CLUSTER_SPLITS = (1, 2, 4)  # blocks of a cluster that split K between them (1: no cluster)
NO_MULTICAST = (1, 1)
MULTICASTS = (NO_MULTICAST, (2, 1), (1, 2), (4, 1), (1, 4), (2, 2))  # (M tiles sharing w, N tiles sharing x) of a cluster
MIN_SLICE_ROWS = 8  # a multicast slice of a tile: whole 1024-byte swizzle atoms (TMA's alignment)
TILE_COUNTERS = 4096  # output tiles a K-split product may have (one int32 counter each)
SHARED_BYTES_PER_SM = 228 * 1024  # H100/H200: shared memory an SM gives its blocks (1 KB each reserved)


@dataclass(frozen=True)
class TileConfig:
    """One tiling: consumer warpgroups (64 output rows each), columns per block, pipeline stages."""

    consumers: int
    block_n: int  # a multiple of 16, at most 256 (wgmma N, TMA box)
    stages: int
    k_group: int = 1  # BLOCK_K slices a consumer waits for and issues as one wgmma group (stages >= 4 k_group)

    @property
    def block_m(self) -> int:
        return WGMMA_M * self.consumers

    @property
    def threads(self) -> int:  # the consumers and one producer warpgroup
        return WARPGROUP_THREADS * (self.consumers + 1)

    @property
    def stage_bytes(self) -> int:  # x slice and w slice of one K step
        return (self.block_m + self.block_n) * SWIZZLE_ROW_BYTES

    @property
    def barrier_offset(self) -> int:  # the mbarriers follow the stages
        return self.stages * self.stage_bytes

    @property
    def shared_bytes(self) -> int:  # + the full and empty mbarriers, the last-part flag, alignment slack
        return self.barrier_offset + 2 * self.stages * BARRIER_BYTES + FLAG_BYTES + ATOM_BYTES

    def shared_bytes_for(self, cluster: int) -> int:
        """Dynamic shared memory of a block; a K split over a cluster adds two mbarriers and the
        block's share of every part (its accumulators' worth: block_m x block_n f32)."""
        if cluster == 1:
            return self.shared_bytes
        return reduce_buffer_offset(self) + self.block_m * self.block_n * 4 + ATOM_BYTES


# Prefill and large decode batches: 128 x 256, two consumer warpgroups of 64 x 256 (128 accumulators
# a thread), 4 stages: 194 KB, one block per SM.
LARGE = TileConfig(consumers=2, block_n=256, stages=4)
# 64 x 128, one consumer warpgroup, 4 stages: 98 KB, two blocks per SM.
SMALL = TileConfig(consumers=1, block_n=128, stages=4)
# The same tile, 6 stages (146 KB), for a grid of at most one block per SM: more bytes in flight.
SMALL_DEEP = TileConfig(consumers=1, block_n=128, stages=6)
# Skinny products (decode batches on a 2048-row weight): 64 x 64, 8 stages (the bytes in flight of a
# 128-row tile): 130 KB, one block per SM.
TINY = TileConfig(consumers=1, block_n=64, stages=8)
# The same tile, 4 stages (66 KB), for a grid of more blocks than SMs: three share an SM.
TINY_SHALLOW = TileConfig(consumers=1, block_n=64, stages=4)
# 128 x 128, two consumer warpgroups, 4 stages (130 KB; 194 KB with a 2-way cluster's parts): a decode
# batch of 257-512 rows on the 2048 x 8192 weight, its K split between the two blocks of a cluster.
MEDIUM = TileConfig(consumers=2, block_n=128, stages=4)
# 128 x 64, two consumer warpgroups of 64 x 64, 8 stages (194 KB, 226 KB with a 2-way cluster's parts):
# decode batches of 257-512 rows on a 2048-row weight, and 129-256 rows on its K = 8192 split in a
# cluster. Each K step's 24 KB feed twice the MMA of a 64 x 64 tile's 16 KB. Its consumers take two
# stages a wait (8 wgmma a group): half the waits, commits and releases per K (H200: 512 x 2048 x
# 2048 12.74 -> 12.45 us, 384 rows 12.24 -> 11.97; on 4-stage tilings this starves the producer), but
# one stage a wait in a K split over a cluster (``slices_a_wait``).
TALL = TileConfig(consumers=2, block_n=64, stages=8, k_group=2)
TILE_CONFIGS = (LARGE, SMALL, SMALL_DEEP, TINY, TINY_SHALLOW, MEDIUM, TALL)  # every tiling the launcher picks
TILE_SHAPES = (LARGE, SMALL, TINY)  # the tile sizes, largest first, each at the stages its split is chosen for
FILL_FRACTION = 0.75  # a tile size qualifies when its grid gives a tile to this share of the SMs


def blocks_per_sm(config: TileConfig, cluster: int = 1) -> int:
    """How many blocks of `config` fit on one SM by shared memory (what bounds these kernels)."""
    return max(1, SHARED_BYTES_PER_SM // (config.shared_bytes_for(cluster) + 1024))


def slices_a_wait(config: TileConfig, in_cluster: bool = False) -> int:
    """BLOCK_K slices a consumer takes a wait: the tiling's ``k_group``, but one in a K split over a
    cluster (H200, bench kernels: 256 x 2048 x 8192 on TALL/c2 took 27.7 us with two, 25.0 with one)."""
    return 1 if in_cluster else config.k_group


def reduce_buffer_offset(config: TileConfig) -> int:
    """Where, from stage 0, a cluster's parts are received: after the stages' mbarriers, the flag
    and the two mbarriers of the exchange, at a 16-byte boundary."""
    end = config.barrier_offset + 2 * config.stages * BARRIER_BYTES + FLAG_BYTES + 2 * BARRIER_BYTES
    return -(-end // 16) * 16


def gemm_wgmma_kernel_for(config: TileConfig, silu_mul: bool = False, cluster: int = 1, multicast=(1, 1)):
    """The kernel for one tiling, epilogue, cluster split and multicast, made once (``_kernel_for``:
    one cache key however the arguments are written)."""
    return _kernel_for(config, bool(silu_mul), int(cluster), tuple(int(v) for v in multicast))


def multicast_fits(config: TileConfig, multicast, silu_mul: bool = False) -> bool:
    """Whether a cluster of ``multicast`` = (mc_m, mc_n) blocks can share ``config``'s tiles: a
    known shape, no more blocks than 4, and slices of whole swizzle atoms (x's block_m / mc_n rows,
    w's block_n / mc_m, with SwiGLU a half's)."""
    mc_m, mc_n = multicast
    w_rows = config.block_n // 2 if silu_mul else config.block_n
    return (tuple(multicast) in MULTICASTS and config.block_m % (mc_n * MIN_SLICE_ROWS) == 0
            and w_rows % (mc_m * MIN_SLICE_ROWS) == 0)  # fmt: skip


@functools.cache
def _kernel_for(config: TileConfig, silu_mul: bool, cluster: int, multicast: tuple):
    """Compile-time specialisation of the kernel for one tiling (its sizes are constants in it).

    ``silu_mul``: w is [gate; up] (2F, K) and the block's ``block_n`` columns are ``block_n / 2`` gate
    rows and the same up rows (two TMA boxes of ``block_n / 2`` rows fill the stage's w slice, one
    above the other); the epilogue stores bf16(silu(gate) * up), ``block_n / 2`` columns of the (M, F)
    output, as pairs of bf16 in uint32 words.

    ``cluster`` > 1: K is split over the ``cluster`` blocks of a thread-block cluster (launched with
    clusters of (1, 1, cluster), ``gridDim.z == cluster``) and the parts are summed through their
    shared memory (``TileConfig.shared_bytes_for``), not through ``parts`` and ``counters``.

    ``multicast`` = (mc_m, mc_n), not (1, 1): a cluster of mc_m x mc_n blocks (launched as (1, 1,
    mc), ``gridDim.z == mc``, K not split) computes mc_m consecutive M tiles of mc_n consecutive N
    tiles; the block of rank r = rm + mc_m * rn takes M tile rm and N tile rn of them. The mc_m
    blocks of an N tile need the same w slice each step: each copies 1 / mc_m of its rows to all of
    them (``tma_load_2d_multicast``), and likewise x among the mc_n blocks of an M tile."""
    block_m, block_n, stages, threads = config.block_m, config.block_n, config.stages, config.threads
    consumers = config.consumers
    k_group = slices_a_wait(config, cluster > 1)
    assert block_n % 16 == 0 and block_n <= 256 and stages >= 2 and stages >= 4 * k_group
    assert cluster in CLUSTER_SPLITS and not (silu_mul and cluster > 1), (cluster, silu_mul)
    mc_m, mc_n = multicast
    mc = mc_m * mc_n  # blocks of a multicast cluster (1: none)
    assert multicast_fits(config, multicast, silu_mul) and (mc == 1 or cluster == 1), (multicast, cluster)
    acc_count = block_n // 2  # accumulators per consumer thread
    slice_values = acc_count // cluster  # accumulators a thread sends each block of the cluster (4 per 8 columns)
    slice_groups = slice_values // 4  # 16-byte stores of them
    slice_blocks = block_n // 8 // cluster  # 8-column blocks (j) of the tile each block of the cluster stores
    reduce_offset = reduce_buffer_offset(config)  # from stage 0: the cluster's parts (cluster > 1)
    stage_bytes = config.stage_bytes
    x_bytes = block_m * SWIZZLE_ROW_BYTES  # the x slice of a stage; the w slice follows it
    barrier_offset = config.barrier_offset
    consumer_threads = consumers * WARPGROUP_THREADS
    half_n = block_n // 2  # with silu_mul: the tile's gate columns, then as many up columns
    half_bytes = half_n * SWIZZLE_ROW_BYTES
    mma = wgmma_bf16(block_n)
    fence_acc = wgmma_fence(block_n)
    wait_but_one = wgmma_wait(block_n, 1)
    wait_all = wgmma_wait(block_n, 0)
    x_rows = block_m // mc_n  # rows of the x tile a block copies (all of it without multicast)
    w_rows = (half_n if silu_mul else block_n) // mc_m  # rows of the w box (each half with silu_mul) a block copies
    load_x = tma_load_2d(block_m)
    load_w = tma_load_2d(half_n if silu_mul else block_n)
    load_x_shared = tma_load_2d_multicast(x_rows)  # (mc_n > 1)
    load_w_shared = tma_load_2d_multicast(w_rows)  # (mc_m > 1)

    @kernel(launch_bounds=(threads, blocks_per_sm(config, cluster)))
    def gemm_wgmma_kernel(x_map, w_map, x_bits, w_bits, out, parts, counters, accumulate, m_fastest):
        # x_map, w_map (16,) uint64: CUtensorMaps of x_bits and w_bits (boxes x_rows x 64 and w_rows x 64:
        # block_m and block_n, with silu_mul block_n / 2, divided by a multicast's sharing blocks)
        # x_bits (M, K) uint16: bf16 bits; w_bits (N, K) uint16; K % 8 == 0
        # out (M, N) f32; with silu_mul (M, F / 2) uint32: (M, F) bf16 in pairs, N = 2F, F % 4 == 0
        # Output tiles: block b of gridDim.x takes tiles b, b + gridDim.x, ... (persistent: a grid of at
        # most the blocks that fit at once walks every tile); tile t is (t % grid_m, t // grid_m) when
        # m_fastest, else (t // grid_n, t % grid_n) (M tile, N tile). With multicast, the same over
        # the clusters' tiles of mc_m x mc_n output tiles (cluster b of gridDim.x, its block blockIdx.z).
        # K split over blockIdx.z (gridDim.z parts, part z the BLOCK_K slices z * S / parts ..
        # (z + 1) * S / parts of the S of K, never empty): with cluster > 1 the blocks of a cluster, else
        # parts (>= splits * tiles * block_m * block_n,) f32, each block's accumulators as the threads
        # hold them (part z of output tile t from (z * tiles + t) * block_m * block_n); counters
        # (>= tiles,) int32, zero: per output tile, how many of its parts are written (the last block
        # sums them and sets it back to zero). Unsplit or in a cluster: neither is read.
        # accumulate: 1 out +=, 0 out =
        smem = cuda.shared.array(0, uint32)  # stages x (x slice, w slice), from a 1024-byte boundary; mbarriers
        smem_f32 = cuda.shared.array(0, float32)  # the same memory (the cluster's parts)
        num_tokens = x_bits.shape[0]
        num_rows = w_bits.shape[0]
        k_dim = x_bits.shape[1]
        grid_m = (num_tokens + block_m - 1) // block_m
        grid_n = (num_rows + block_n - 1) // block_n  # (silu_mul: F / (block_n / 2) as well)
        cluster_m = (grid_m + mc_m - 1) // mc_m  # the clusters' tiles (without multicast: the output tiles)
        cluster_n = (grid_n + mc_n - 1) // mc_n
        out_tiles = cluster_m * cluster_n
        tid = cuda.threadIdx.x
        group = tid // WARPGROUP_THREADS
        rank = cuda.blockIdx.z  # the part of K (with cluster > 1 or multicast: the block's rank in its cluster)
        rm = rank % mc_m if mc > 1 else 0  # with multicast: the block's M tile and N tile within its cluster's
        rn = rank // mc_m if mc > 1 else 0
        # K in groups of k_group BLOCK_K slices (the last group may reach past K: the TMA fills zeros there)
        k_units = uint32((k_dim + BLOCK_K * k_group - 1) // (BLOCK_K * k_group))
        k_parts = uint32(1 if mc > 1 else cuda.gridDim.z)  # (32-bit divisions: a 64-bit one is a call, whose
        k_part = uint32(0 if mc > 1 else rank)  # stack made LARGE spill)
        first_slice = k_part * k_units // k_parts * k_group
        num_slices = (k_part + 1) * k_units // k_parts * k_group - first_slice  # K steps per tile
        k_first = first_slice * BLOCK_K

        base = shared_address(smem, 0)
        pad = (ATOM_BYTES - (base & (ATOM_BYTES - 1))) & (ATOM_BYTES - 1)  # bytes up to an aligned address
        stage0 = base + pad  # shared address of stage 0
        full = stage0 + barrier_offset  # full[s] at full + 8 s: the stage's copies have landed
        empty = full + stages * BARRIER_BYTES  # empty[s]: every consumer is done with the stage
        flag = (pad + barrier_offset + 2 * stages * BARRIER_BYTES) // 4  # word: is this block a tile's last part
        # With cluster > 1: parts_in (every block's slice of this block's columns has arrived) and
        # parts_read (every block has read what this block sent it), then the parts: slot r (from the
        # block of rank r) holds slice_groups 16-byte groups per consumer thread, group-major.
        parts_in = empty + stages * BARRIER_BYTES + FLAG_BYTES
        parts_read = parts_in + BARRIER_BYTES
        reduce_base = stage0 + reduce_offset
        if tid == 0:
            tensormap_prefetch(x_map)  # the TMA fetches both descriptors while the barriers are set up
            tensormap_prefetch(w_map)
            for s in range(stages):
                mbarrier_init(full + s * BARRIER_BYTES, 1)
                mbarrier_init(empty + s * BARRIER_BYTES, consumers * mc)  # with multicast: every block's consumers
            if cluster > 1:
                mbarrier_init(parts_in, cluster * consumer_threads)
                mbarrier_init(parts_read, cluster * consumer_threads)
            fence_mbarrier_init()
        if cluster > 1 or mc > 1:
            cluster_sync()  # every block's mbarriers are initialised before any other block arrives on them
        else:
            cuda.syncthreads()

        # K steps are counted over all of the block's tiles (stage = step % stages, its use number
        # step // stages sets the parity), so the producer fills the next tile's first stages while the
        # consumers finish the current one and store it.
        if group == consumers:  # the producer warpgroup: lane 0 of each warp issues every COPIERS-th K step's copies
            if tid % WARP_SIZE == 0:
                copier = (tid % WARPGROUP_THREADS) // WARP_SIZE  # this thread's K steps: copier, copier + COPIERS, ...
                x_mask = uint32(0)  # with multicast: the blocks of this M tile, and of this N tile
                for j in range(mc_n):
                    x_mask |= uint32(1) << uint32(rm + mc_m * j)
                w_mask = uint32((1 << mc_m) - 1) << uint32(mc_m * rn)
                x_slice = rn * x_rows  # the rows of the tiles this block copies (to the blocks sharing them)
                w_slice = rm * w_rows
                step = 0
                for t in range(cuda.blockIdx.x, out_tiles, cuda.gridDim.x):
                    m_tile, n_tile = _tile_of(t, cluster_m, cluster_n, m_fastest)
                    m_tile = m_tile * mc_m + rm  # (past the matrix in a cluster's last tile: the TMA fills zeros)
                    n_tile = n_tile * mc_n + rn
                    for kt in range(num_slices):
                        if step % COPIERS != copier:  # another warp's step
                            step += 1
                            continue
                        s = step % stages
                        if step >= stages:  # wait for the consumers' release of the stage's previous use (with
                            # multicast: the consumers of every block that this one copies into)
                            mbarrier_wait(empty + s * BARRIER_BYTES, (step // stages + 1) & 1)
                        barrier = full + s * BARRIER_BYTES
                        mbarrier_arrive_expect_tx(barrier, stage_bytes)  # (the whole stage: its own copies and the others')
                        stage = stage0 + s * stage_bytes
                        k = k_first + kt * BLOCK_K
                        x_dst = stage + x_slice * SWIZZLE_ROW_BYTES
                        if mc_n > 1:
                            load_x_shared(smem, x_dst, x_map, x_bits, k, m_tile * block_m + x_slice, barrier, x_mask)
                        else:
                            load_x(smem, x_dst, x_map, x_bits, k, m_tile * block_m, barrier)
                        w_dst = stage + x_bytes + w_slice * SWIZZLE_ROW_BYTES
                        if silu_mul:  # gate rows, then the same rows of up (N / 2 further down w)
                            gate = n_tile * half_n + w_slice
                            if mc_m > 1:
                                load_w_shared(smem, w_dst, w_map, w_bits, k, gate, barrier, w_mask)
                                load_w_shared(smem, w_dst + half_bytes, w_map, w_bits, k, num_rows // 2 + gate, barrier, w_mask)
                            else:
                                load_w(smem, w_dst, w_map, w_bits, k, gate, barrier)
                                load_w(smem, w_dst + half_bytes, w_map, w_bits, k, num_rows // 2 + gate, barrier)
                        elif mc_m > 1:
                            load_w_shared(smem, w_dst, w_map, w_bits, k, n_tile * block_n + w_slice, barrier, w_mask)
                        else:
                            load_w(smem, w_dst, w_map, w_bits, k, n_tile * block_n, barrier)
                        step += 1
                if mc > 1:  # no exit before every block's consumers have released every stage this block filled:
                    # then no arrival on this block's mbarriers is still to come, and every copy it sent was read
                    for u in range(max(0, step - stages), step):
                        if u % COPIERS == copier:
                            mbarrier_wait(empty + (u % stages) * BARRIER_BYTES, (u // stages) & 1)
            return

        acc = cuda.local.array(acc_count, float32)  # this thread's part of the warpgroup's 64 x block_n
        leader = tid % WARPGROUP_THREADS == 0
        step = 0
        done = 0  # tiles this block has finished
        for t in range(cuda.blockIdx.x, out_tiles, cuda.gridDim.x):
            m_tile, n_tile = _tile_of(t, cluster_m, cluster_n, m_fastest)
            m_tile = m_tile * mc_m + rm
            n_tile = n_tile * mc_n + rn
            for i in range(acc_count):
                acc[i] = float32(0.0)
            kt = 0
            while True:  # at least one step (num_slices >= 1): no path reaches wait_all without a wgmma, which
                # ptxas would count as other code writing the accumulators in a pipeline stage (and serialise)
                for u in range(k_group):  # the group's stages: K steps step .. step + k_group - 1
                    mbarrier_wait(full + ((step + u) % stages) * BARRIER_BYTES, ((step + u) // stages) & 1)
                fence_acc(acc)
                for u in range(k_group):
                    stage = stage0 + ((step + u) % stages) * stage_bytes
                    desc_a = smem_descriptor(stage + group * WGMMA_M * SWIZZLE_ROW_BYTES)
                    desc_b = smem_descriptor(stage + x_bytes)
                    for kk in range(BLOCK_K // WGMMA_K):
                        mma(acc, smem, desc_a + kk * DESC_K_STEP, desc_b + kk * DESC_K_STEP)
                wgmma_commit()
                wait_but_one(acc)  # the previous group's wgmma have completed: release its stages
                if kt > 0 and leader:
                    for u in range(k_group):
                        _release(empty + ((step - k_group + u) % stages) * BARRIER_BYTES, mc)
                step += k_group
                kt += k_group
                if kt >= num_slices:
                    break
            wait_all(acc)
            if leader:  # the tile's last group of stages
                for u in range(k_group):
                    _release(empty + ((step - k_group + u) % stages) * BARRIER_BYTES, mc)

            splits = cuda.gridDim.z if mc == 1 else 1
            if cluster > 1:  # K split over the cluster: block r sums and stores the columns 8j of j // slice_blocks == r
                last_tile = t + cuda.gridDim.x >= out_tiles
                if done > 0:  # every block has read what this one sent for the previous tile
                    mbarrier_wait_cluster(parts_read, (done - 1) & 1)
                slot = reduce_base + (rank * slice_groups * consumer_threads + tid) * 16
                for r in range(cluster):  # block r's columns, into slot `rank` of its memory
                    remote = cluster_address(slot, r)
                    for v in range(slice_groups):
                        i = r * slice_values + 4 * v
                        store_cluster_f32x4(remote + v * consumer_threads * 16, acc[i], acc[i + 1], acc[i + 2], acc[i + 3])
                for r in range(cluster):
                    mbarrier_arrive_cluster(cluster_address(parts_in, r))
                mbarrier_wait_cluster(parts_in, done & 1)
                words = (pad + reduce_offset) // 4 + tid * 4  # this thread's first word in slot 0
                for r in range(cluster):  # (unrolled: acc's indices stay constants)
                    if r == rank:
                        for i in range(slice_values):
                            acc[r * slice_values + i] = float32(0.0)
                        for z in range(cluster):  # in order of rank: the same additions in every run
                            for v in range(slice_groups):
                                word = words + (z * slice_groups + v) * consumer_threads * 4
                                p0, p1, p2, p3 = load_shared_f32x4(smem_f32, word)
                                i = r * slice_values + 4 * v
                                acc[i] += p0
                                acc[i + 1] += p1
                                acc[i + 2] += p2
                                acc[i + 3] += p3
                if not last_tile:  # (after the last, no block may touch another's memory: it may have exited)
                    for r in range(cluster):
                        mbarrier_arrive_cluster(cluster_address(parts_read, r))
            elif splits > 1:  # K split: every part goes to `parts`; the tile's last part to arrive sums them
                part = (cuda.blockIdx.z * out_tiles + t) * acc_count * consumer_threads + tid
                for i in range(acc_count):  # accumulator i of every thread, one after another: coalesced
                    parts[part + i * consumer_threads] = acc[i]
                cuda.threadfence()  # this thread's part is visible to the whole GPU before the count says so
                named_barrier(CONSUMERS_BARRIER, consumer_threads)
                if tid == 0:
                    last = cuda.atomic.add(counters, t, 1) == splits - 1
                    smem[flag] = uint32(1) if last else uint32(0)
                    if last:
                        counters[t] = 0  # every part has arrived: ready for the next launch
                named_barrier(CONSUMERS_BARRIER, consumer_threads)
                if smem[flag] == 0:
                    done += 1
                    continue
                cuda.threadfence()  # the other parts, as their blocks wrote them
                for i in range(acc_count):
                    acc[i] = float32(0.0)
                for z in range(splits):  # in order of z, whichever block is last: deterministic
                    part = (z * out_tiles + t) * acc_count * consumer_threads + tid
                    for i in range(acc_count):  # loads independent of each other: in flight together
                        acc[i] += parts[part + i * consumer_threads]

            # Epilogue, straight from the registers: acc[4j + 2h + e] is D[16w + 8h + g, 8j + 2q + e] of
            # the warpgroup's 64 rows (wgmma.py); a warp's store of one (j, h) covers 8 rows of 32 bytes
            # (whole sectors), and the producer is already filling the next tile's stages.
            lane = tid % WARP_SIZE
            m = m_tile * block_m + group * WGMMA_M + (tid % WARPGROUP_THREADS) // 32 * 16 + (lane >> 2)
            if silu_mul:  # gate column c and up column half_n + c sit in the same thread, half_n / 2 apart
                n = n_tile * half_n + 2 * (lane & 3)  # column of (M, F); its pair is word n / 2 of the row
                for j in range(half_n // 8):
                    for h in range(2):
                        if m + 8 * h < num_tokens and n + 8 * j < num_rows // 2:
                            i = 4 * j + 2 * h
                            g0, g1, u0, u1 = acc[i], acc[i + 1], acc[i + half_n // 2], acc[i + 1 + half_n // 2]
                            out[m + 8 * h, n // 2 + 4 * j] = pack_bf16x2(swiglu(g0, u0), swiglu(g1, u1))
            else:  # two adjacent columns per 8-byte store (N is even and out 8-byte aligned: _run sees to it)
                n = n_tile * block_n + 2 * (lane & 3)
                if accumulate:  # every load first, then every store: the loads are in flight together (a
                    # store between them, which may alias for all the compiler knows, would order each
                    # load after the previous store, one memory latency per pair)
                    for j in range(block_n // 8):
                        for h in range(2):
                            if (cluster == 1 or j // slice_blocks == rank) and m + 8 * h < num_tokens and n + 8 * j < num_rows:
                                o0, o1 = load_f32x2(out, (m + 8 * h, n + 8 * j))
                                acc[4 * j + 2 * h] += o0
                                acc[4 * j + 2 * h + 1] += o1
                for j in range(block_n // 8):
                    for h in range(2):
                        if (cluster == 1 or j // slice_blocks == rank) and m + 8 * h < num_tokens and n + 8 * j < num_rows:
                            store_f32x2(out, (m + 8 * h, n + 8 * j), acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1])
            done += 1

    return gemm_wgmma_kernel


@device_function
def _release(barrier, blocks):
    """A consumer warpgroup is done with a stage: one arrival on its empty mbarrier at ``barrier``;
    with multicast (``blocks`` > 1) on that of every block of the cluster, since each copies into
    this block's stage and must not refill it before this block's consumers are done. The arrival
    says only that the stage's reads are done (the wgmma wait before it): no cluster-scope release."""
    if blocks > 1:
        for r in range(blocks):
            mbarrier_arrive_remote(cluster_address(barrier, r))
    else:
        mbarrier_arrive(barrier)


@device_function
def _tile_of(t, grid_m, grid_n, m_fastest):
    """(M tile, N tile) of output tile ``t``: consecutive tiles walk the M tiles when ``m_fastest``
    (the blocks that run together share each w tile), else the N tiles."""
    if m_fastest:
        return t % grid_m, t // grid_m
    return t // grid_n, t % grid_n


@kernel
def _x_to_bf16_kernel(x, x_pairs):
    """x_pairs[m, j] = bf16(x[m, 2j]) | bf16(x[m, 2j + 1]) << 16, rounded to nearest even.

    x (M, K) f32, K even; x_pairs (M, K / 2) uint32: the rows of the bf16 copy. Grid-stride over
    the pairs; consecutive threads take consecutive pairs of a row (coalesced).
    """
    pairs = x_pairs.shape[1]
    total = x_pairs.shape[0] * pairs
    i = cuda.grid(1)
    while i < total:
        m = i // pairs
        j = i % pairs
        x_pairs[m, j] = pack_bf16x2(x[m, 2 * j], x[m, 2 * j + 1])
        i += cuda.gridsize(1)


@functools.cache
def _default_x_workspace():
    """The bf16 copy of x for calls that bring no workspace (tests, benchmarks): allocated once, so
    its tensor maps are made once too. The model passes its own (`model.llama.buffer_specs`)."""
    return cuda.device_array(X_WORKSPACE_VALUES, np.uint16)


_VIEWS_KEPT = 4096  # cached device-array views (a few per token count and K); forgotten all at once past this
_views: dict[tuple, tuple] = {}  # (kind, id(workspace), shape...) -> (workspace, views...)


def _cached_views(kind: str, workspace, shape: tuple, make):
    """Views of a workspace, made once per shape: making a device-array view costs more host time than
    a small product. Keyed by the workspace's identity (device arrays are not all hashable), which
    the entry keeps alive so the id cannot be reused."""
    key = (kind, id(workspace), *shape)
    entry = _views.get(key)
    if entry is None or entry[0] is not workspace:
        if len(_views) >= _VIEWS_KEPT:
            _views.clear()
        entry = _views[key] = (workspace, *make())
    return entry[1:]


def _x_views(x_workspace, rows: int, k_dim: int):
    """The workspace as x's bf16 copy: (rows, K) uint16 and its (rows, K / 2) uint32 pairs."""

    def make():
        x_bits = x_workspace[: rows * k_dim].reshape(rows, k_dim)
        return x_bits, x_bits.view(np.uint32)

    return _cached_views("x", x_workspace, (rows, k_dim), make)


def x_capacity(x_workspace, k_dim: int) -> int:
    """Rows of x whose bf16 copy fits the workspace."""
    return x_workspace.shape[0] // k_dim


def tile_count(config: TileConfig, num_tokens: int, num_rows: int) -> int:
    """Output tiles of ``config`` over an (M = num_tokens) x (N = num_rows) product."""
    return -(-num_rows // config.block_n) * -(-num_tokens // config.block_m)


def pick_tile_config(num_tokens: int, num_rows: int, num_sms: int) -> TileConfig:
    """The tile size: the largest of ``TILE_SHAPES`` whose grid gives a tile to ``FILL_FRACTION`` of
    the SMs (else the smallest), 128-row tiles only for more than 64 rows of x.

    Measured on an H200 (see the module docstring): larger tiles read less per product and win as
    long as most SMs have one; a grid of 128 LARGE tiles (M = 512, N = 8192) beat 256 SMALL ones,
    and 64-row tiles beat 128-row ones whose lower half would be padding (M <= 64). A 128 x 128
    tiling (two consumers) was never the fastest of these on any decode or prefill shape tried.
    """
    for config in TILE_SHAPES:
        if config.block_m > WGMMA_M and num_tokens <= WGMMA_M:
            continue
        if tile_count(config, num_tokens, num_rows) >= FILL_FRACTION * num_sms:
            return config
    return TILE_SHAPES[-1]


def pick_plan(num_tokens: int, num_rows: int, k_dim: int, num_sms: int) -> tuple[TileConfig, int, bool, tuple[int, int]]:
    """The tiling, K split and whether the split's parts meet in a cluster: the tile size
    (``pick_tile_config``), its split (``pick_k_split``), then the stages for the grid that makes: a
    grid of at most one block per SM gets the deeper pipeline (SMALL_DEEP), one of more blocks than
    SMs the shallower one that lets blocks share an SM (TINY_SHALLOW). Where the grid leaves half the
    SMs idle, K is split between the two blocks of a cluster instead (TINY tiles split at most two
    ways). Past 128 rows of x on a K of 4096 or more, K is split in a cluster over the largest of
    MEDIUM and TALL whose pairs of blocks fill more than half the SMs; past 256 rows on a shorter K,
    TALL tiles are taken, unsplit, where they fill more than half the SMs and at most all of them.
    On an H200 this picked, within 2%, the fastest of every tiling and split tried at M = 32 .. 2048
    (powers of two) on Llama 3.2 1B's weights, or was faster where it was not; at M = 384 on the
    8192- and 16384-row weights it is 7% and 9% slower than LARGE and SMALL tiles (docs/benchmarks.md)."""
    config = pick_tile_config(num_tokens, num_rows, num_sms)
    tiles = tile_count(config, num_tokens, num_rows)
    split = pick_k_split(config, tiles, k_dim, num_sms)
    slices = -(-k_dim // BLOCK_K)
    cluster_k = slices >= 2 * MIN_CLUSTER_PART_SLICES  # slices enough for two parts
    if config == TINY and split <= 2 and 2 * tiles <= num_sms and cluster_k:
        return TINY, 2, True, NO_MULTICAST  # half the SMs idle: two blocks of a cluster share each tile's K
    if config in (TINY, SMALL) and num_tokens > 2 * WGMMA_M and cluster_k:
        if slices >= LONG_K_SLICES:  # 256 x 2048 x 8192: TALL/c2 27.7 us against TINY's 32.1; 384 rows: MEDIUM/c2 37.9, 48.8
            for wide in (MEDIUM, TALL):
                if num_sms < 4 * tile_count(wide, num_tokens, num_rows) <= 2 * num_sms:
                    return wide, 2, True, NO_MULTICAST
        elif num_tokens > 4 * WGMMA_M and num_sms < 2 * tile_count(TALL, num_tokens, num_rows) <= 2 * num_sms:
            return TALL, 1, False, NO_MULTICAST  # 512 x 2048 x 2048: 15.7 us against MEDIUM/c2's 16.0; 384 rows: 15.4, 16.6
    if config == SMALL and tiles * split <= num_sms:
        return SMALL_DEEP, split, False, NO_MULTICAST
    if config == TINY and tiles * split > num_sms:
        return TINY_SHALLOW, split, False, NO_MULTICAST
    return config, split, False, NO_MULTICAST


def pick_k_split(config: TileConfig, num_blocks: int, k_dim: int, num_sms: int) -> int:
    """Into how many parts to split K: doubling while the blocks still run at once (``blocks_per_sm``
    per SM) and each part keeps ``MIN_SPLIT_TILES`` slices.

    On an H200 a split paid only on long K (8192) with few tiles (M = 32 .. 128 on a 2048-row weight:
    32 and 64 TINY tiles, split 4 and 2 ways, and 128 SMALL tiles at M = 512, split 2); on K = 2048
    it did not: no product there is bound by its blocks' K loops (a 64-row product of a 2048 x 2048
    weight took 12.9 us on 32 blocks and 13.8 on 128 blocks of a 4-way split).
    """
    num_tiles = -(-k_dim // BLOCK_K)
    room = blocks_per_sm(config) * num_sms
    split = 1
    while num_blocks * split * 2 <= room and num_tiles // (split * 2) >= MIN_SPLIT_TILES:
        split *= 2
    return split


def gemm_wgmma(
    x, w, out, accumulate: bool = False, config: TileConfig | None = None, split: int | None = None, workspace=None,
    x_copy=None, in_cluster: bool | None = None, multicast: tuple[int, int] | None = None,
) -> None:
    """out = x @ w.T (or out += x @ w.T) with Hopper's wgmma; x is rounded to bf16.

    x (M, K) f32, w (N, K) bf16 device array (or its uint16 bits), out (M, N) f32. ``config``,
    ``split`` and ``in_cluster`` force a tiling, a K split and how its parts are summed: True, in a
    cluster of ``split`` blocks (2 or 4) through their shared memory; False, through global memory
    (tests, benchmarks). ``multicast``: force clusters of (mc_m, mc_n) blocks sharing their tiles'
    copies (``MULTICASTS``; (1, 1): none), K unsplit. ``workspace``: the model's
    `matmul.GemmWorkspace` (split-K parts and the bf16 buffers); without one, a split allocates its
    parts and x goes through a default copy buffer.

    ``x_copy``: a producer has already written x's bf16 copy (round to nearest even) from the start
    of this uint16 buffer, the view ``bf16_x_destination(workspace, M, K, w, x_copy)`` returned: the
    workspace's ``x_bf16`` (rms_norm, silu_and_mul) or ``act_bf16`` (``gemm_wgmma_silu_mul``). No
    conversion pass runs, and x is read for its shape alone. Raises KernelError when that view does
    not exist (K % 8, w unaligned, M x K past the buffer: then the f32 x is needed, and the caller
    must not have skipped it).
    """
    check_linear_args(x, w, out)
    _run(x, w, out, accumulate, config, split, in_cluster, workspace, x_copy, False, multicast)


def gemm_wgmma_silu_mul(
    x, w, out_bits, config: TileConfig | None = None, workspace=None, x_copy=None, split: int | None = None,
    multicast: tuple[int, int] | None = None,
) -> None:
    """out_bits = bf16(silu(x @ gate.T) * (x @ up.T)) for w = [gate; up]: SwiGLU in the product's epilogue.

    x (M, K) f32 (or only its shape, with ``x_copy`` as in ``gemm_wgmma``), w (2F, K) bf16 (or its
    uint16 bits), out_bits (M, F) uint16, F % 8 == 0, K % 8 == 0, w 16-byte aligned
    (``silu_mul_destination`` checks all of it). A block computes matching columns of gate and up (its
    w slice is two TMA boxes: ``block_n / 2`` gate rows and the same up rows), and its epilogue
    writes bf16(silu(g) * u) with ``activation.swiglu``: the bits that ``silu_and_mul``'s bf16 copy
    of the f32 product would hold, while the (M, 2F) f32 product is never written nor read back (at
    2,048 tokens of Llama 3.2 1B, 268 MB less traffic a layer). Split over K like ``gemm_wgmma`` (``split``:
    forced, for tests): the block that sums a tile's parts applies SwiGLU. ``multicast``: as in ``gemm_wgmma``.
    """
    num_rows = w.shape[0]
    num_tokens, num_rows, k_dim = check_linear_args(x, w, out_bits, out_cols=num_rows // 2, out_dtype=np.uint16)
    if not _silu_mul_fits(w):
        raise KernelError(f"gemm_wgmma_silu_mul: w ({num_rows} x {k_dim}) needs 2F and K multiples of 16 and 8, 16-byte aligned")
    pairs = _cached_views("pairs", out_bits, tuple(out_bits.shape), lambda: (out_bits.view(np.uint32),))[0]  # (M, F / 2)
    _run(x, w, pairs, False, config, split, False, workspace, x_copy, True, multicast)


def _run(x, w, out, accumulate, config, split, in_cluster, workspace, x_copy, silu_mul: bool, multicast) -> None:
    """gemm_wgmma's and gemm_wgmma_silu_mul's common path (arguments checked): x's bf16 copy as the
    producer left it in ``x_copy``, else converted into the x workspace, in row chunks when it does
    not fit; then the product (``out``: (M, N) f32, or with ``silu_mul`` the (M, F / 2) uint32 pairs)."""
    num_tokens, k_dim = x.shape
    num_rows = w.shape[0]
    written = bf16_x_destination(workspace, num_tokens, k_dim, w, x_copy) if x_copy is not None else None  # (M, K) uint16
    if x_copy is not None and written is None:
        raise KernelError(f"gemm_wgmma: x ({num_tokens} x {k_dim}) cannot be read from the bf16 copy as it is")
    if num_tokens == 0 or num_rows == 0:
        return
    w_bits = weight_bits(w)
    partials = None if workspace is None else workspace.partials
    counters = None if workspace is None else workspace.tile_counters
    # the epilogue's column pairs: even N, out 8-byte aligned (and C-contiguous, checked), so every
    # row's pairs are too; the SwiGLU output is whole uint32 words
    pairs = silu_mul or (out.shape[1] % 2 == 0 and vector_aligned(out, PAIR_BYTES))
    if written is not None and not pairs:
        raise KernelError(f"gemm_wgmma: out ({num_tokens} x {out.shape[1]}) must be 8-byte aligned rows when x is its bf16 copy")
    if k_dim % CHUNK_VALUES or not vector_aligned(w_bits) or not pairs:  # (gemm_wgmma_silu_mul has refused these)
        gemm_tc(x, w, out, accumulate, workspace=partials)  # no TMA copies of such rows; no Llama shape comes here
        return
    if written is not None:
        _product(x_copy, written, w_bits, out, accumulate, config, split, in_cluster, partials, counters, silu_mul,
                 multicast)  # fmt: skip
        return
    x_workspace = x_copy_buffer(workspace)
    rows = min(num_tokens, x_capacity(x_workspace, k_dim))
    for m in range(0, num_tokens, rows):  # row chunks whose bf16 copy fits the workspace
        part, part_out = (x, out) if rows == num_tokens else (x[m : m + rows], out[m : m + rows])
        x_bits, pairs = _x_views(x_workspace, part.shape[0], k_dim)
        blocks = min(-(-pairs.size // CONVERT_THREADS), 8 * num_sms())
        launch(_x_to_bf16_kernel, blocks, CONVERT_THREADS, part, pairs)
        _product(x_workspace, x_bits, w_bits, part_out, accumulate, config, split, in_cluster, partials, counters,
                 silu_mul, multicast)  # fmt: skip


def bf16_x_destination(workspace, num_tokens: int, k_dim: int, w=None, buffer=None):
    """Where a producer writes the bf16 copy of x (M, K) for ``gemm_wgmma(..., x_copy=buffer)``: the
    (M, K) uint16 view of ``buffer`` (default: the x workspace, ``workspace.x_bf16``, or the default
    one without a workspace) that the TMA copies from, rows of K values one after another from its
    start, no padding. None when the product would not read x from there in one piece: K not a
    multiple of ``CHUNK_VALUES`` or ``w`` (the product's (N, K) weight, when known) unaligned or of
    an odd N (gemm_tc runs it, on the f32 x), or M x K past the buffer (row chunks, each converted from the
    f32 x). Every Llama shape within the model's workspace gets a view."""
    x_workspace = x_copy_buffer(workspace) if buffer is None else buffer
    if k_dim == 0 or k_dim % CHUNK_VALUES or num_tokens > x_capacity(x_workspace, k_dim):
        return None
    if w is not None and (w.shape[1] != k_dim or w.shape[0] % 2 or not vector_aligned(w)):  # (w's address: no view to make)
        return None
    return _x_views(x_workspace, num_tokens, k_dim)[0]


def silu_mul_destination(workspace, num_tokens: int, w):
    """Where ``gemm_wgmma_silu_mul`` of x (M, K) and w = [gate; up] (2F, K) writes its (M, F) bf16
    output, which the down product then reads as its x (``x_copy=workspace.act_bf16``): the (M, F)
    view of ``workspace.act_bf16``. None when that product cannot run: no such buffer, F or K not a
    multiple of ``CHUNK_VALUES``, w unaligned, or M x F past the buffer."""
    if workspace is None or workspace.act_bf16 is None or not _silu_mul_fits(w):
        return None
    return bf16_x_destination(workspace, num_tokens, w.shape[0] // 2, None, workspace.act_bf16)


def _silu_mul_fits(w) -> bool:
    """Whether w = [gate; up] (2F, K) suits gemm_wgmma_silu_mul: F and K multiples of ``CHUNK_VALUES``
    (16-byte TMA rows of w and of the (M, F) output the down product copies), w 16-byte aligned."""
    num_rows, k_dim = w.shape
    return num_rows % (2 * CHUNK_VALUES) == 0 and k_dim % CHUNK_VALUES == 0 and vector_aligned(w)


def x_copy_buffer(workspace):
    """The x workspace, (>= M x K,) uint16, where x's bf16 copy goes: the model's, else the default one."""
    return _default_x_workspace() if workspace is None else workspace.x_bf16


def _product(x_workspace, x_bits, w_bits, out, accumulate, config, split, in_cluster, partials, counters,
             silu_mul: bool, multicast) -> None:  # fmt: skip
    """The wgmma product of x's bf16 copy (a view from the start of the buffer ``x_workspace``) and w
    (uint16 bits), split or not, over a cluster or through global memory, its tiles' copies
    multicast in clusters or not, by ``pick_plan`` unless the caller forces a tiling, split, way of
    splitting or multicast; with ``silu_mul`` SwiGLU in the epilogue."""
    num_tokens, k_dim = x_bits.shape
    num_rows = w_bits.shape[0]
    if config is None:
        config, picked, picked_cluster, picked_multicast = pick_plan(num_tokens, num_rows, k_dim, num_sms())
        split = split or picked
        in_cluster = picked_cluster if in_cluster is None else in_cluster
        multicast = picked_multicast if multicast is None else multicast
    multicast = (1, 1) if multicast is None else tuple(multicast)
    mc_m, mc_n = multicast
    grid_n, grid_m = -(-num_rows // config.block_n), -(-num_tokens // config.block_m)  # (silu_mul: F / (block_n / 2))
    if mc_m * mc_n > 1:
        if not multicast_fits(config, multicast, silu_mul) or (split or 1) > 1 or in_cluster:
            raise KernelError(f"gemm_wgmma: multicast {multicast} is one of {MULTICASTS[1:]}, with slices of "
                              f"{MIN_SLICE_ROWS}+ rows and K unsplit")  # fmt: skip
        split = 1
    split = split or pick_k_split(config, grid_n * grid_m, k_dim, num_sms())
    splits = min(split, -(-k_dim // (BLOCK_K * slices_a_wait(config, bool(in_cluster)))))  # no empty part
    # (parts are whole groups of the slices a consumer takes a wait)
    if in_cluster and (splits not in CLUSTER_SPLITS or silu_mul):
        raise KernelError(f"gemm_wgmma: a K split over a cluster is {CLUSTER_SPLITS[1:]} ways, without SwiGLU (asked: {splits})")
    cluster = splits if in_cluster else 1
    cluster_m, cluster_n = -(-grid_m // mc_m), -(-grid_n // mc_n)  # a multicast cluster's tiles (else: the output tiles)
    m_fastest = 1 if cluster_m <= 16 else 0
    tiles = grid_n * grid_m
    blocks = min(cluster_m * cluster_n, max(1, blocks_per_sm(config, cluster) * num_sms() // (splits * mc_m * mc_n)))
    capacity = x_capacity(x_workspace, k_dim)  # (blocks: persistent, at most one wave; with multicast, clusters)
    x_map = tensor_map_2d(_x_views(x_workspace, capacity, k_dim)[0], capacity, config.block_m // mc_n)
    w_map = tensor_map_2d(w_bits, num_rows, (config.block_n // 2 if silu_mul else config.block_n) // mc_m)
    kernel_ = gemm_wgmma_kernel_for(config, silu_mul, cluster, multicast)
    global_parts = splits > 1 and cluster == 1
    size = splits * tiles * config.block_m * config.block_n if global_parts else 1  # every block's accumulators
    if global_parts and tiles > TILE_COUNTERS:
        raise KernelError(f"gemm_wgmma: a K split of {tiles} output tiles exceeds the {TILE_COUNTERS} counters")
    if partials is None or counters is None:  # a call without the model's workspace: scratch of its own
        parts = cuda.device_array(size, np.float32)  # (unsplit: never read)
        counters = cuda.to_device(np.zeros(tiles if global_parts else 1, np.int32))
    elif size > partials.shape[0]:
        raise KernelError(f"gemm_wgmma: a {splits}-way K split of {tiles} tiles exceeds the workspace")
    else:
        parts = partials
    args = (x_map, w_map, x_bits, w_bits, out, parts, counters, 1 if accumulate else 0, m_fastest)
    shared_bytes = config.shared_bytes_for(cluster)
    blocks_z = splits * mc_m * mc_n  # a cluster's blocks (K parts, or multicast ranks) along z
    if blocks_z > 1 and (cluster > 1 or mc_m * mc_n > 1):  # as many clusters as run at once (one GPC holds a
        # cluster's blocks: can be fewer than blocks / cluster)
        blocks = min(blocks, max_active_clusters(kernel_, args, config.threads, shared_bytes, (1, 1, blocks_z)))
        launch(kernel_, (blocks, 1, blocks_z), config.threads, *args, shared_bytes=shared_bytes, cluster=(1, 1, blocks_z))
        return
    launch(kernel_, (blocks, 1, splits), config.threads, *args, shared_bytes=shared_bytes)
