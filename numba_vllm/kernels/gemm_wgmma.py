"""Hopper tensor-core matrix product: out (M, N) f32 = x (M, K) @ w (N, K) bf16 .T (or out += ...).

The contract of ``gemm_tc.py`` (same arguments, same rounding: x is rounded to bf16, products are
accumulated in fp32), computed with ``wgmma.mma_async`` (``wgmma.py``): a warpgroup of 128 threads
multiplies a 64 x 16 slice of x by a 16 x ``block_n`` slice of w.T per instruction, both read from
shared memory, the accumulators in registers. Needs sm_90a (an H100 or H200); ``linear`` sends
other GPUs to ``gemm_tc``.

Data flow:

- x is rounded to bf16 once per call by ``_x_to_bf16_kernel`` into a fixed workspace, so both
  operands can go from global to shared memory by ``cp.async`` with no pass through registers.
  Past ``X_WORKSPACE_VALUES`` values the product is done in row chunks that fit.
- A block of ``warpgroups`` x 128 threads computes a ``block_m x block_n`` tile of out
  (``block_m = 64 * warpgroups``; warpgroup ``i`` owns rows 64i .. 64i + 63 and all the columns).
  It walks K in slices of ``BLOCK_K`` = 64 values: one 128-byte row per matrix row, the 128-byte
  swizzle layout of ``wgmma.py``. A stage of the pipeline holds the x slice (block_m rows) and the w
  slice (block_n rows) of one K step; ``stages`` of them live in dynamic shared memory (over 48 KB,
  so the launch opts in: ``_launch.launch``), from a 1024-byte aligned address.
- Staging: thread ``tid`` copies 16-byte chunk ``tid % 8`` of rows ``tid // 8 + (threads / 8) i``,
  with ``cp.async`` (zero-filled past M, N and K: no branch, no garbage in the products). Eight
  consecutive threads read one row's 128 contiguous bytes.
- Pipeline, step ``s`` (one commit group of copies per step, empty past the end, so the counting
  stays uniform): wait until slice s has landed (``cp.async.wait_group stages - 3``), fence it
  for the tensor cores, ``syncthreads``; issue 4 wgmma (k = 16 each) on stage ``s % stages`` and
  commit them; while they run, start the copies of slice ``s + stages - 2`` into the stage slice
  ``s - 2`` used (free: every warpgroup waited for its wgmma of step s - 2 before the barrier);
  then wait until only this step's wgmma group is in flight (``wgmma.wait_group 1``): the tensor
  cores work on step s while the threads go through the next barrier, and ``stages - 2`` slices
  are in flight from memory.
- Epilogue: after the last wgmma, the block writes its accumulators to shared memory (the pipeline
  buffers, rows padded by 8 words so the quads of a warp hit distinct banks) and copies the tile
  out with row-contiguous 16-byte reads: consecutive threads write consecutive columns of ``out``.

Grids and splits: ``TILE_CONFIGS`` from largest to smallest; ``pick_tile_config`` takes the largest
tile whose grid covers every SM, and K is split like gemm_tc's (partial tiles into a workspace,
summed in a fixed order: deterministic) while the GPU has room for more blocks: that is what fills
132 SMs on the skinny products of decode. ``blockIdx.x`` walks the M tiles when there are few of
them (the blocks that run together share each w tile: a 128256-row head is read from memory once,
not once per M tile), else the N tiles (w of a layer fits in L2, x streams once).

Requirements: K % 8 == 0 and w 16-byte aligned (16-byte copies); otherwise ``gemm_wgmma`` hands the
product to ``gemm_tc``. Every Llama-family shape meets them.
"""

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, uint32

from numba_vllm.kernels._launch import KernelError, launch, num_sms
from numba_vllm.kernels.gemm_tc import SUM_THREADS, _split_workspace, _sum_splits_kernel, gemm_tc
from numba_vllm.kernels.gemv import check_linear_args, weight_bits
from numba_vllm.kernels.jit import device_function, kernel
from numba_vllm.kernels.mma import pack_bf16x2
from numba_vllm.kernels.vector_load import load_shared_f32x4, vector_aligned
from numba_vllm.kernels.wgmma import (
    ATOM_BYTES,
    DESC_K_STEP,
    SWIZZLE_ROW_BYTES,
    TILE_K,
    WARPGROUP_THREADS,
    WGMMA_K,
    WGMMA_M,
    cp_async_16_zfill,
    cp_async_commit,
    cp_async_wait,
    fence_proxy_async,
    shared_address,
    smem_descriptor,
    store_accumulators,
    wgmma_bf16,
    wgmma_commit,
    wgmma_fence,
    wgmma_wait,
)

BLOCK_K = TILE_K  # 64 values of K per pipeline stage (one 128-byte swizzled row)
ROW_WORDS = SWIZZLE_ROW_BYTES // 4  # 32 uint32 per staged row
CHUNK_VALUES = 8  # bf16 values per 16-byte copy
ROW_CHUNKS = BLOCK_K // CHUNK_VALUES  # 8 copies per staged row
OUT_PAD_WORDS = 8  # padding of an epilogue row: the 8 rows a warp stores cover distinct banks
X_WORKSPACE_VALUES = 32 * 1024 * 1024  # bf16 copy of x: 64 MB, allocated once (a fixed address)
SPLIT_BLOCKS_PER_SM = 4  # split K until the grid has about this many blocks per SM ...
MIN_SPLIT_TILES = 4  # ... keeping at least this many BLOCK_K slices (256 of K) in each part
CONVERT_THREADS = 256


@dataclass(frozen=True)
class TileConfig:
    """One tiling: warpgroups along M (64 rows each), columns per block, pipeline stages."""

    warpgroups: int
    block_n: int  # a multiple of 16, at most 256 (wgmma N)
    stages: int  # >= 3

    @property
    def block_m(self) -> int:
        return WGMMA_M * self.warpgroups

    @property
    def threads(self) -> int:
        return WARPGROUP_THREADS * self.warpgroups

    @property
    def stage_bytes(self) -> int:  # x slice and w slice of one K step
        return (self.block_m + self.block_n) * SWIZZLE_ROW_BYTES

    @property
    def shared_bytes(self) -> int:  # the stages (or the epilogue's tile, if larger) + alignment slack
        out_tile = self.block_m * (self.block_n + OUT_PAD_WORDS) * 4
        return max(self.stages * self.stage_bytes, out_tile) + ATOM_BYTES


# Prefill: 128 x 256, two warpgroups of 64 x 256 (128 accumulators a thread), 4 stages: 193 KB.
LARGE = TileConfig(warpgroups=2, block_n=256, stages=4)
# Mid-size products: 128 x 128, 4 stages: 129 KB.
MEDIUM = TileConfig(warpgroups=2, block_n=128, stages=4)
# Decode batches: 64 x 128, one warpgroup, 4 stages: 97 KB, two blocks per SM.
SMALL = TileConfig(warpgroups=1, block_n=128, stages=4)
TILE_CONFIGS = (LARGE, MEDIUM, SMALL)  # largest first
SHARED_BYTES_PER_SM = 228 * 1024  # H100/H200: shared memory an SM gives its blocks (1 KB each reserved)


def blocks_per_sm(config: TileConfig) -> int:
    """How many blocks of `config` fit on one SM by shared memory (what bounds these kernels)."""
    return max(1, SHARED_BYTES_PER_SM // (config.shared_bytes + 1024))


@functools.cache
def gemm_wgmma_kernel_for(config: TileConfig):
    """Compile-time specialisation of the kernel for one tiling (its sizes are constants in it)."""
    block_m, block_n, stages, threads = config.block_m, config.block_n, config.stages, config.threads
    assert block_n % 16 == 0 and block_n <= 256 and stages >= 3
    acc_count = block_n // 2  # accumulators per thread
    stage_bytes = config.stage_bytes
    stage_words = stage_bytes // 4
    stage_rows = threads // ROW_CHUNKS  # rows one pass of the block copies
    x_passes = block_m // stage_rows
    w_passes = block_n // stage_rows
    out_row_words = block_n + OUT_PAD_WORDS
    out_chunks = block_m * block_n // 4  # 16-byte pieces of the output tile
    mma = wgmma_bf16(block_n)
    fence_acc = wgmma_fence(block_n)
    wait_but_one = wgmma_wait(block_n, 1)
    wait_all = wgmma_wait(block_n, 0)
    wait_slice = cp_async_wait(stages - 3)
    store_acc = store_accumulators(block_n, out_row_words)

    @device_function
    def _copy_slice(x_bits, w_bits, smem, stage_word, m0, n0, k0, row, chunk_word, chunk):
        """Start this thread's copies of the K slice from k0 into the stage at word ``stage_word``."""
        num_tokens = x_bits.shape[0]
        num_rows = w_bits.shape[0]
        k_dim = x_bits.shape[1]
        k = k0 + chunk * CHUNK_VALUES
        k_in = k < k_dim
        k_src = min(k, k_dim - CHUNK_VALUES)  # a valid address even when nothing is read
        for i in range(x_passes):
            r = row + i * stage_rows
            m = m0 + r
            size = 16 if k_in and m < num_tokens else 0
            cp_async_16_zfill(smem, stage_word + r * ROW_WORDS + chunk_word, x_bits, (min(m, num_tokens - 1), k_src), size)
        for i in range(w_passes):
            r = row + i * stage_rows
            n = n0 + r
            size = 16 if k_in and n < num_rows else 0
            dst = stage_word + (block_m + r) * ROW_WORDS + chunk_word
            cp_async_16_zfill(smem, dst, w_bits, (min(n, num_rows - 1), k_src), size)

    @kernel(launch_bounds=threads)
    def gemm_wgmma_kernel(x_bits, w_bits, out, accumulate, tiles_per_split, m_fastest):
        # x_bits (M, K) uint16: bf16 bits; w_bits (N, K) uint16; K % 8 == 0, rows 16-byte aligned
        # out (M, N) f32, or with K split over blockIdx.z, (splits * M, N): part z's rows z*M .. z*M + M - 1
        # accumulate: 1 out +=, 0 out =; tiles_per_split: BLOCK_K slices per part of K
        # m_fastest: 1 when blockIdx.x walks the M tiles (and blockIdx.y the N tiles), 0 the reverse
        smem = cuda.shared.array(0, uint32)  # stages x (x slice, w slice), from a 1024-byte boundary
        smem_f32 = cuda.shared.array(0, float32)  # the same memory, for the epilogue
        acc = cuda.local.array(acc_count, float32)  # this thread's part of the warpgroup's 64 x block_n
        num_tokens = x_bits.shape[0]
        num_rows = w_bits.shape[0]
        k_dim = x_bits.shape[1]
        tid = cuda.threadIdx.x
        group = tid // WARPGROUP_THREADS
        m_tile = cuda.blockIdx.x if m_fastest else cuda.blockIdx.y
        n_tile = cuda.blockIdx.y if m_fastest else cuda.blockIdx.x
        m0 = m_tile * block_m
        n0 = n_tile * block_n

        base = shared_address(smem, 0)
        pad = (ATOM_BYTES - (base & (ATOM_BYTES - 1))) & (ATOM_BYTES - 1)  # bytes up to an aligned address
        first_word = pad >> 2
        tiles_address = base + pad
        row = tid // ROW_CHUNKS  # staging: rows row + stage_rows * i, chunk `chunk` of each
        chunk = tid % ROW_CHUNKS
        chunk_word = (chunk ^ (row % 8)) * 4  # swizzled; stage_rows is a multiple of 8, so the same for every i

        for i in range(acc_count):
            acc[i] = float32(0.0)

        first_tile = cuda.blockIdx.z * tiles_per_split
        num_tiles = min(tiles_per_split, (k_dim + BLOCK_K - 1) // BLOCK_K - first_tile)
        k_first = first_tile * BLOCK_K
        for s in range(stages - 2):
            if s < num_tiles:
                stage_word = first_word + s * stage_words
                _copy_slice(x_bits, w_bits, smem, stage_word, m0, n0, k_first + s * BLOCK_K, row, chunk_word, chunk)
            cp_async_commit()
        for tile in range(num_tiles):
            wait_slice()  # this thread's copies of slice `tile` have landed
            fence_proxy_async()  # ... and are visible to the tensor cores
            cuda.syncthreads()  # everyone's copies; every warpgroup is done with slice tile - 2
            stage_address = tiles_address + (tile % stages) * stage_bytes
            desc_a = smem_descriptor(stage_address + group * WGMMA_M * SWIZZLE_ROW_BYTES)
            desc_b = smem_descriptor(stage_address + block_m * SWIZZLE_ROW_BYTES)
            fence_acc(acc)
            for kk in range(BLOCK_K // WGMMA_K):
                mma(acc, smem, desc_a + kk * DESC_K_STEP, desc_b + kk * DESC_K_STEP)
            wgmma_commit()
            ahead = tile + stages - 2  # its copies go into the stage of slice tile - 2, while the wgmma run
            if ahead < num_tiles:
                stage_word = first_word + (ahead % stages) * stage_words
                _copy_slice(x_bits, w_bits, smem, stage_word, m0, n0, k_first + ahead * BLOCK_K, row, chunk_word, chunk)
            cp_async_commit()
            wait_but_one(acc)
        wait_all(acc)

        # Epilogue: accumulators -> shared memory (row-padded tile) -> out, 16 bytes per thread per row piece.
        cuda.syncthreads()  # every warpgroup is done reading the pipeline buffers
        lane = tid % 32
        warp_row = group * WGMMA_M + (tid % WARPGROUP_THREADS) // 32 * 16 + (lane >> 2)
        store_acc(acc, smem, first_word + warp_row * out_row_words + 2 * (lane & 3))
        cuda.syncthreads()
        row_offset = cuda.blockIdx.z * num_tokens
        for c in range(tid, out_chunks, threads):
            r = c // (block_n // 4)
            col = c % (block_n // 4) * 4
            m = m0 + r
            n = n0 + col
            if m < num_tokens:
                v0, v1, v2, v3 = load_shared_f32x4(smem_f32, first_word + r * out_row_words + col)
                _store4(out, row_offset + m, n, num_rows, v0, v1, v2, v3, accumulate)

    return gemm_wgmma_kernel


@device_function
def _store1(out, row, n, num_rows, value, accumulate):
    """out[row, n] (+)= value, when column n exists."""
    if n < num_rows:
        if accumulate:
            out[row, n] += value
        else:
            out[row, n] = value


@device_function
def _store4(out, row, n, num_rows, v0, v1, v2, v3, accumulate):
    """out[row, n .. n + 3] (+)= v0 .. v3, the columns past ``num_rows`` left alone."""
    _store1(out, row, n, num_rows, v0, accumulate)
    _store1(out, row, n + 1, num_rows, v1, accumulate)
    _store1(out, row, n + 2, num_rows, v2, accumulate)
    _store1(out, row, n + 3, num_rows, v3, accumulate)


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
def _x_workspace():
    """Device uint16 scratch for the bf16 copy of x, allocated once at its largest size (a CUDA
    graph that recorded a product keeps a valid address)."""
    return cuda.device_array(X_WORKSPACE_VALUES, np.uint16)


def pick_tile_config(num_tokens: int, num_rows: int, num_sms: int) -> TileConfig:
    """The largest tiling whose grid has at least one block per SM (else the smallest)."""
    for config in TILE_CONFIGS:
        if -(-num_rows // config.block_n) * -(-num_tokens // config.block_m) >= num_sms:
            return config
    return TILE_CONFIGS[-1]


def pick_k_split(config: TileConfig, num_blocks: int, k_dim: int, num_sms: int) -> int:
    """Into how many parts to split K: doubling while the grid stays under ``SPLIT_BLOCKS_PER_SM``
    blocks per SM (and what fits there at once) and each part keeps ``MIN_SPLIT_TILES`` slices."""
    num_tiles = -(-k_dim // BLOCK_K)
    room = min(SPLIT_BLOCKS_PER_SM, blocks_per_sm(config)) * num_sms
    split = 1
    while num_blocks * split * 2 <= room and num_tiles // (split * 2) >= MIN_SPLIT_TILES:
        split *= 2
    return split


def gemm_wgmma(x, w, out, accumulate: bool = False, config: TileConfig | None = None, split: int | None = None) -> None:
    """out = x @ w.T (or out += x @ w.T) with Hopper's wgmma; x is rounded to bf16.

    x (M, K) f32, w (N, K) bf16 device array (or its uint16 bits), out (M, N) f32. ``config`` and
    ``split`` force a tiling and a K split (tests, benchmarks).
    """
    num_tokens, num_rows, k_dim = check_linear_args(x, w, out)
    if num_tokens == 0 or num_rows == 0:
        return
    w_bits = weight_bits(w)
    if k_dim % CHUNK_VALUES or not vector_aligned(w_bits):
        gemm_tc(x, w, out, accumulate)  # 16-byte copies impossible; no Llama shape comes here
        return
    rows = max(1, min(num_tokens, X_WORKSPACE_VALUES // k_dim))
    for m in range(0, num_tokens, rows):  # row chunks whose bf16 copy fits the workspace
        chunk = x[m : m + rows]
        x_bits = _x_workspace()[: chunk.shape[0] * k_dim].reshape(chunk.shape[0], k_dim)
        pairs = x_bits.view(np.uint32)
        blocks = min(-(-pairs.size // CONVERT_THREADS), 8 * num_sms())
        launch(_x_to_bf16_kernel, blocks, CONVERT_THREADS, chunk, pairs)
        _product(x_bits, w_bits, out[m : m + rows], accumulate, config, split)


def _product(x_bits, w_bits, out, accumulate, config, split) -> None:
    """The wgmma product of bf16 x and w (uint16 bits, K % 8 == 0, aligned), split or not."""
    num_tokens, k_dim = x_bits.shape
    num_rows = w_bits.shape[0]
    config = config or pick_tile_config(num_tokens, num_rows, num_sms())
    grid_n, grid_m = -(-num_rows // config.block_n), -(-num_tokens // config.block_m)
    split = split or pick_k_split(config, grid_n * grid_m, k_dim, num_sms())
    num_tiles = -(-k_dim // BLOCK_K)
    tiles_per_split = -(-num_tiles // split)
    splits = -(-num_tiles // tiles_per_split)  # no empty part
    m_fastest = 1 if grid_m <= 16 else 0
    grid = (grid_m, grid_n, splits) if m_fastest else (grid_n, grid_m, splits)
    kernel_ = gemm_wgmma_kernel_for(config)
    flag = 1 if accumulate else 0
    shared = config.shared_bytes
    if splits == 1:
        launch(kernel_, grid, config.threads, x_bits, w_bits, out, flag, tiles_per_split, m_fastest, shared_bytes=shared)
        return
    workspace = _split_workspace()
    if splits * num_tokens * num_rows > workspace.shape[0]:
        raise KernelError(f"gemm_wgmma: a {splits}-way K split of a {num_tokens}x{num_rows} product exceeds the workspace")
    partials = workspace[: splits * num_tokens * num_rows].reshape(splits * num_tokens, num_rows)
    launch(kernel_, grid, config.threads, x_bits, w_bits, partials, 0, tiles_per_split, m_fastest, shared_bytes=shared)
    launch(_sum_splits_kernel, (-(-num_rows // SUM_THREADS), min(num_tokens, 1024)), SUM_THREADS, partials, out, flag)
