"""Tensor-core matrix product for prefill: out (M, N) f32 = x (M, K) f32 @ w (N, K) bf16 .T (or out += ...).

The same contract as ``gemm.py``, computed on the tensor cores with ``mma.sync`` m16n8k16 (bf16 x
bf16, fp32 accumulate; ``mma.py`` has the instruction and its fragment layout). The activations are
float32 in this engine: they are rounded to bf16 (nearest even) as they are staged into shared
memory, so the result is that of the bf16-rounded x and w, accumulated in fp32 (relative error
~2^-9 per product against the fp32 ``gemm``, which uses x unrounded).

Two tilings (``TileConfig``; the kernel is compiled once per tiling by ``gemm_tc_kernel_for``, its
sizes constants in the code): ``LARGE`` for prefill, described below, and ``SMALL``, 64 x 64 block
tiles of 4 warps owning 32 x 32 each (2 x 4 mma tiles), for decode batches of a few hundred tokens,
where LARGE's grid would leave most SMs idle (M = 256, N = 2048: 16 blocks for 132 SMs). The
launcher takes the largest tiling whose grid has a block for every SM.

Tiling of ``LARGE`` (SMALL is the same with its sizes):

- A block of ``BLOCK_THREADS`` = 256 threads (8 warps) computes a ``BLOCK_M x BLOCK_N`` = 128 x 256
  tile of ``out``; ``blockIdx.x`` picks the columns (rows of ``w``), ``blockIdx.y`` the rows (tokens).
  A wide N tile because x is read as float32 (4 bytes an element against w's 2): per K step the
  block reads 16 KB of x and 16 KB of w for 2 MFLOP.
- The warps form a 2 x 4 grid; warp ``(warp % 2, warp // 2)`` owns a 64 x 64 warp tile: 4 x 8
  mma tiles of 16 x 8, i.e. 4 x 8 x 4 = 128 fp32 accumulators per lane in ``acc`` (a
  ``cuda.local.array`` indexed only by constants in fully unrolled loops: registers).
- The block walks K in steps of ``BLOCK_K`` = 32. Each step stages a 128 x 32 slice of x (rounded to
  bf16) and a 256 x 32 slice of w in shared memory, k contiguous, 64 bytes a row. Per 16-wide half of
  the slice each warp loads its A fragments with 4 ``ldmatrix.x4`` (one per 16 rows) and its B
  fragments with 4 (each covers two 8-row n tiles), then issues 4 x 8 = 32 ``mma.sync``.
- Lane layout of a fragment (``g = lane >> 2``, ``t = lane & 3``): of a 16 x 16 block of x the lane
  holds rows g and g + 8, k = 2t, 2t + 1, 2t + 8, 2t + 9; of an 8-row tile of w, row g at the same k;
  of the 16 x 8 output tile, rows g and g + 8, columns 2t and 2t + 1. The epilogue writes those.

Shared memory: ``xs`` (2, 128, 16) and ``ws`` (2, 256, 16) uint32 words (two bf16 each), double
buffered: 2 x (8 + 16) KB = 48 KB, all of the static limit. Rows are 64 bytes = 4 chunks of 16
bytes. ``ldmatrix`` reads, per 8 lanes, one 16-byte chunk from each of 8 consecutive rows; stored
plainly, rows r and r + 2 would share banks (4-way conflicts). So chunk ``c`` of row ``r`` is stored
at chunk position ``c ^ ((r >> 1) & 3)`` (an XOR swizzle): the 8 rows then cover all 32 banks once,
for the ldmatrix reads and for the 16-byte stores alike, with no padding bytes (which would not fit).

Staging and double buffering: a thread stages the 16-byte chunks of rows ``tid // 4 + 64 j`` at k
chunk ``tid % 4`` (four consecutive threads cover a row's 64 bytes): 2 chunks of x, 4 of w.

- x needs converting, so it goes through registers: 2 x two 16-byte ``ld.global.nc.v4.f32`` per
  slice into ``x_next``; at the top of step s the thread rounds them to bf16 pairs
  (``cvt.rn.bf16x2.f32``) and writes buffer ``s % 2`` with 16-byte ``st.shared.v4`` stores.
- w is already bf16, so it is copied global -> shared without registers: 4 ``cp.async`` of 16
  bytes per slice, waited for (``cp.async.wait_all``) just before the barrier of the step that
  uses them.
- Step s: store x, wait for own copies, ``syncthreads``, then start slice s + 1 (x loads into
  registers, w copies into buffer ``(s + 1) % 2``), then the mma on buffer ``s % 2``: the memory
  latency of slice s + 1 hides behind the 64 mma per warp of slice s. One barrier per step (see
  the comment at it).

Edges: rows past M and N are clamped to the last row when loading (their products land only in
outputs that are not stored) and the stores are guarded. A K slice that runs past K, or any slice
when K % 8 != 0 or x / w is not 16-byte aligned, is loaded element by element with zeros past K
(zero products add nothing).

Registers: 128 accumulators, 16 staged floats of x, 32 fragment words and addresses. ptxas (CUDA
13.0, sm_90) assigns 247 registers with no spills (it fits in 223 without spilling when capped), so
one block of 256 threads runs per SM (8 warps); ``tests/test_ptx_matmul.py`` checks that the PTX
has no local memory (acc indexed at run time would put it there).

Not done (next steps for speed): a 3-4 stage ``cp.async`` pipeline needs more than the 48 KB of
static shared memory (dynamic shared memory with the opt-in attribute, which Numba does not set);
storing x as bf16 once per layer instead of rounding it in every block would halve the bytes read.
"""

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, uint32

from numba_vllm.kernels._launch import KernelError, launch, num_sms
from numba_vllm.kernels.gemv import check_linear_args, weight_bits
from numba_vllm.kernels.jit import device_function, kernel
from numba_vllm.kernels.mma import (
    MMA_K,
    MMA_M,
    MMA_N,
    cp_async_16,
    cp_async_wait_all,
    ldmatrix_x4,
    mma_bf16_16816,
    pack_bf16x2,
    store_shared_u32x4,
)
from numba_vllm.kernels.vector_load import SHARED_ALIGN, load_f32x4, vector_aligned


@dataclass(frozen=True)
class TileConfig:
    """One tiling of the product: block tile, warp grid, and everything that follows from them."""

    block_m: int  # output rows (tokens) per block
    block_n: int  # output columns (rows of w) per block
    warps_m: int  # warps along M
    warps_n: int  # warps along N

    @property
    def threads(self) -> int:
        return self.warps_m * self.warps_n * WARP_SIZE

    @property
    def shared_bytes(self) -> int:  # two stages of x and w slices
        return 2 * (self.block_m + self.block_n) * ROW_WORDS * 4


BLOCK_K = 32  # K per shared-memory stage
WARP_SIZE = 32
K_STEPS = BLOCK_K // MMA_K  # 2 mma k-steps per stage
ROW_WORDS = BLOCK_K // 2  # 16 uint32 words (32 bf16, 64 bytes) per staged row
CHUNK_WORDS = 4  # 16 bytes = 4 words = 8 bf16
ROW_CHUNKS = ROW_WORDS // CHUNK_WORDS  # 4 chunks per staged row
CHUNK_VALUES = 2 * CHUNK_WORDS  # 8 values of k per chunk

# Prefill: 128 x 256 tiles, 8 warps of 64 x 64 (4 x 8 mma tiles each). 48 KB of shared memory.
LARGE = TileConfig(block_m=128, block_n=256, warps_m=2, warps_n=4)
# Decode batches (M up to a few hundred): 64 x 64 tiles, 4 warps of 32 x 32 (2 x 4 mma tiles), 16 KB:
# 16 times the blocks of LARGE, so a 256-token product with N = 2048 still fills an H200's 132 SMs.
SMALL = TileConfig(block_m=64, block_n=64, warps_m=2, warps_n=2)
TILE_CONFIGS = (LARGE, SMALL)  # largest first: `gemm_tc` takes the first that fills the GPU
SPLIT_BLOCKS_PER_SM = 4  # split K until the grid has about this many blocks per SM ...
MIN_SPLIT_TILES = 8  # ... but keep at least this many BLOCK_K slices (256 of K) in each part
SUM_THREADS = 256  # threads per block of the kernel that adds the parts of a split K


@device_function
def _swizzle(row, chunk):
    """Where chunk ``chunk`` (0..3) of staged row ``row`` is stored: its word offset in the row."""
    return (chunk ^ ((row >> 1) & 3)) * CHUNK_WORDS


@device_function(inline="always")
def _w_pair(w_bits, n, k, k_dim):
    """w[n, k] and w[n, k + 1] as one uint32 (k in the low half), zero past K.

    Inlined by numba itself: otherwise each of ``_stage_w``'s two specialisations (``buf`` a literal
    0, or a variable) links its own copy of this function's module, and with line information on
    (``make profile``) NVVM rejects the kernel ("Symbol name with unsupported characters"); it
    accepts it once the second copy is gone.
    """
    lo = uint32(w_bits[n, k]) if k < k_dim else uint32(0)
    hi = uint32(w_bits[n, k + 1]) if k + 1 < k_dim else uint32(0)
    return lo | (hi << uint32(16))


@functools.cache
def gemm_tc_kernel_for(config: TileConfig):
    """Compile-time specialisation of the kernel for one tiling (its sizes are constants in it)."""
    block_m, block_n, warps_m = config.block_m, config.block_n, config.warps_m
    block_threads = config.threads
    warp_m = block_m // warps_m  # rows per warp
    warp_n = block_n // config.warps_n  # columns per warp
    frags_m = warp_m // MMA_M  # mma tiles along M per warp
    frags_n = warp_n // MMA_N  # mma tiles along N per warp
    stage_rows = block_threads // ROW_CHUNKS  # rows staged per pass of the whole block
    x_chunks = block_m // stage_rows  # chunks of x per thread per stage
    w_chunks = block_n // stage_rows  # chunks of w per thread per stage
    assert warp_m % 16 == 0 and stage_rows % 8 == 0  # the swizzle of a row depends only on row % 8
    assert frags_m in (2, 4) and frags_n % 2 == 0  # the epilogue's bands; B fragments load in pairs
    assert config.shared_bytes <= 48 * 1024  # static shared memory per block

    @device_function
    def _store_band(out, acc, i, m_base, n_base, lane, accumulate, num_tokens, row_offset):
        """Write (or add) this lane's outputs of the i-th 16-row band of the warp tile.

        acc[i, j, 2h + e] is out[m_base + 16i + 8h + g, n_base + 8j + 2t + e] (g = lane >> 2, t = lane & 3),
        stored at row ``row_offset + m`` (a split K's partial tile goes to its own rows of the workspace).
        """
        num_rows = out.shape[1]
        g = lane >> 2
        t = lane & 3
        for store in range(2):  # pass 0 (accumulate only) adds what out holds, pass 1 stores: every load
            # first, since a store between two loads (which may alias, for all the compiler knows) would
            # hold the next load back by a memory latency
            if store or accumulate:
                for h in range(2):
                    m = m_base + i * MMA_M + h * 8 + g
                    if m < num_tokens:
                        for j in range(frags_n):
                            n = n_base + j * MMA_N + 2 * t
                            for e in range(2):
                                if n + e < num_rows:
                                    if store:
                                        out[row_offset + m, n + e] = acc[i, j, 2 * h + e]
                                    else:
                                        acc[i, j, 2 * h + e] += out[row_offset + m, n + e]

    @device_function
    def _load_x(x, x_next, m0, stage_row, stage_chunk, k0, vectors_ok):
        """Load this thread's chunks of the x slice starting at k0 into registers (zeros past K)."""
        num_tokens = x.shape[0]
        k_dim = x.shape[1]
        k = k0 + stage_chunk * CHUNK_VALUES
        for j in range(x_chunks):
            m = min(m0 + stage_row + j * stage_rows, num_tokens - 1)
            if vectors_ok != 0 and k0 + BLOCK_K <= k_dim:
                x_next[j, 0], x_next[j, 1], x_next[j, 2], x_next[j, 3] = load_f32x4(x, (m, k))
                x_next[j, 4], x_next[j, 5], x_next[j, 6], x_next[j, 7] = load_f32x4(x, (m, k + 4))
            else:
                for e in range(CHUNK_VALUES):
                    x_next[j, e] = x[m, k + e] if k + e < k_dim else float32(0.0)

    @device_function
    def _stage_w(w_bits, ws, buf, n0, stage_row, stage_chunk, stage_word, k0, vectors_ok):
        """Start copying this thread's chunks of the w slice starting at k0 into buffer ``buf``.

        Fast path: 16-byte ``cp.async`` copies, complete after ``cp_async_wait_all``. Otherwise element
        loads with zeros past K, stored at once.
        """
        num_rows = w_bits.shape[0]
        k_dim = w_bits.shape[1]
        k = k0 + stage_chunk * CHUNK_VALUES
        for j in range(w_chunks):
            row = stage_row + j * stage_rows
            n = min(n0 + row, num_rows - 1)
            if vectors_ok != 0 and k0 + BLOCK_K <= k_dim:
                cp_async_16(ws, (buf, row, stage_word), w_bits, (n, k))
            else:
                store_shared_u32x4(
                    ws,
                    (buf, row, stage_word),
                    _w_pair(w_bits, n, k, k_dim),
                    _w_pair(w_bits, n, k + 2, k_dim),
                    _w_pair(w_bits, n, k + 4, k_dim),
                    _w_pair(w_bits, n, k + 6, k_dim),
                )

    @kernel(launch_bounds=block_threads)
    def gemm_tc_kernel(x, w_bits, out, accumulate, vectors_ok, tiles_per_split):
        # x (M, K) f32; w_bits (N, K) uint16 (bf16 bits); accumulate: 1 out +=, 0 out =
        # out: (M, N) f32, or with K split over blockIdx.z, (splits * M, N): part z's rows z*M .. z*M + M - 1
        # vectors_ok: 1 when K % 8 == 0 and x, w are 16-byte aligned (16-byte loads allowed)
        # tiles_per_split: BLOCK_K slices of K this block sums, from blockIdx.z * tiles_per_split
        k_dim = x.shape[1]
        xs = cuda.shared.array((2, block_m, ROW_WORDS), uint32, SHARED_ALIGN)  # x slices as bf16 pairs, swizzled
        ws = cuda.shared.array((2, block_n, ROW_WORDS), uint32, SHARED_ALIGN)  # w slices as bf16 pairs, swizzled
        acc = cuda.local.array((frags_m, frags_n, 4), float32)  # this lane's D fragments
        a = cuda.local.array((frags_m, 4), uint32)  # A fragments of one k-step
        b = cuda.local.array((frags_n, 2), uint32)  # B fragments of one k-step
        x_next = cuda.local.array((x_chunks, CHUNK_VALUES), float32)  # next x slice, on its way to shared

        tid = cuda.threadIdx.x
        lane = tid % WARP_SIZE
        warp = tid // WARP_SIZE
        m0 = cuda.blockIdx.y * block_m
        n0 = cuda.blockIdx.x * block_n
        wm0 = (warp % warps_m) * warp_m  # this warp's tile within the block
        wn0 = (warp // warps_m) * warp_n

        # Staging: rows stage_row + stage_rows * j, k chunk stage_chunk (the swizzle is the same for all j).
        stage_row = tid // ROW_CHUNKS
        stage_chunk = tid % ROW_CHUNKS
        stage_word = _swizzle(stage_row, stage_chunk)

        # ldmatrix rows of this lane: for A, row (lane & 15) of a 16-row block, chunk + (lane >> 4);
        # for B, row (lane & 7) + 8 * (lane >> 4) of a 16-row block (two n tiles), chunk + ((lane >> 3) & 1).
        a_row = wm0 + (lane & 15)
        a_half = lane >> 4
        b_row = wn0 + (lane & 7) + ((lane >> 4) << 3)
        b_half = (lane >> 3) & 1

        for i in range(frags_m):
            for j in range(frags_n):
                for r in range(4):
                    acc[i, j, r] = float32(0.0)

        first_tile = cuda.blockIdx.z * tiles_per_split
        num_tiles = min(tiles_per_split, (k_dim + BLOCK_K - 1) // BLOCK_K - first_tile)
        k_first = first_tile * BLOCK_K
        _load_x(x, x_next, m0, stage_row, stage_chunk, k_first, vectors_ok)  # this block's first slice
        _stage_w(w_bits, ws, 0, n0, stage_row, stage_chunk, stage_word, k_first, vectors_ok)
        for tile in range(num_tiles):
            buf = tile % 2
            for j in range(x_chunks):
                store_shared_u32x4(
                    xs,
                    (buf, stage_row + j * stage_rows, stage_word),
                    pack_bf16x2(x_next[j, 0], x_next[j, 1]),
                    pack_bf16x2(x_next[j, 2], x_next[j, 3]),
                    pack_bf16x2(x_next[j, 4], x_next[j, 5]),
                    pack_bf16x2(x_next[j, 6], x_next[j, 7]),
                )
            cp_async_wait_all()  # this thread's copies of the w slice into buffer `buf` have landed
            # Wait until the whole slice (everyone's x stores and w copies) is in buffer `buf`. This
            # also guarantees that every warp finished its mma on the previous slice, which lived in
            # the other buffer: the next slice goes there, right below, with no second barrier.
            cuda.syncthreads()
            if tile + 1 < num_tiles:  # start the next slice's loads and copies before the mma
                k_next = k_first + (tile + 1) * BLOCK_K
                _load_x(x, x_next, m0, stage_row, stage_chunk, k_next, vectors_ok)
                _stage_w(w_bits, ws, 1 - buf, n0, stage_row, stage_chunk, stage_word, k_next, vectors_ok)
            for kk in range(K_STEPS):
                a_word = _swizzle(a_row, kk * 2 + a_half)
                b_word = _swizzle(b_row, kk * 2 + b_half)
                for i in range(frags_m):
                    a[i, 0], a[i, 1], a[i, 2], a[i, 3] = ldmatrix_x4(xs, (buf, a_row + i * MMA_M, a_word))
                for j in range(frags_n // 2):
                    b[2 * j, 0], b[2 * j, 1], b[2 * j + 1, 0], b[2 * j + 1, 1] = ldmatrix_x4(
                        ws, (buf, b_row + j * 2 * MMA_N, b_word)
                    )
                for i in range(frags_m):
                    for j in range(frags_n):
                        acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3] = mma_bf16_16816(
                            a[i, 0], a[i, 1], a[i, 2], a[i, 3],  # A: 16 x 16 of x
                            b[j, 0], b[j, 1],  # B: 16 (k) x 8 (n) of w.T
                            acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3],  # C, replaced by D
                        )  # fmt: skip

        # Epilogue. Each call is its own loop nest over one 16-row band of mma tiles: small enough for
        # the compiler to unroll fully, so acc is indexed by constants only and stays in registers (one
        # nest over all the values is not unrolled, and acc would go to local memory).
        m_base = m0 + wm0
        n_base = n0 + wn0
        num_tokens = x.shape[0]
        row_offset = cuda.blockIdx.z * num_tokens
        _store_band(out, acc, 0, m_base, n_base, lane, accumulate, num_tokens, row_offset)
        _store_band(out, acc, 1, m_base, n_base, lane, accumulate, num_tokens, row_offset)
        if frags_m == 4:  # a compile-time constant: the branch is folded away
            _store_band(out, acc, 2, m_base, n_base, lane, accumulate, num_tokens, row_offset)
            _store_band(out, acc, 3, m_base, n_base, lane, accumulate, num_tokens, row_offset)

    return gemm_tc_kernel


def pick_tile_config(num_tokens: int, num_rows: int, num_sms: int) -> TileConfig:
    """The largest tiling whose tile fits inside the product and whose grid has at least one block
    per SM (else the smallest): a tile larger than the product would mostly compute padding."""
    for config in TILE_CONFIGS:
        fits = num_tokens >= config.block_m and num_rows >= config.block_n
        if fits and -(-num_rows // config.block_n) * -(-num_tokens // config.block_m) >= num_sms:
            return config
    return TILE_CONFIGS[-1]


def pick_k_split(num_blocks: int, k_dim: int, num_sms: int) -> int:
    """Into how many parts to split K: doubling while the grid stays under ``SPLIT_BLOCKS_PER_SM``
    blocks per SM and each part keeps at least ``MIN_SPLIT_TILES`` slices.

    Why: a decode batch gives few output tiles (M = 256, N = 2048: 128 SMALL blocks, one per SM), and
    one block's loads in flight, a slice or two, cannot cover memory latency: splitting K puts
    several blocks on each SM, each summing part of K into its own partial tile.
    """
    num_tiles = -(-k_dim // BLOCK_K)
    split = 1
    while num_blocks * split * 2 <= SPLIT_BLOCKS_PER_SM * num_sms and num_tiles // (split * 2) >= MIN_SPLIT_TILES:
        split *= 2
    return split


def split_workspace_floats(num_sms: int) -> int:
    """Floats of scratch that any split-K product needs at most: a split grid has at most
    ``SPLIT_BLOCKS_PER_SM * num_sms`` blocks, each with one tile of partial sums. The model allocates
    this once (`DeviceModel.allocate`), so its address never changes and a recorded graph stays valid."""
    return SPLIT_BLOCKS_PER_SM * num_sms * max(c.block_m * c.block_n for c in TILE_CONFIGS)


@kernel
def _sum_splits_kernel(partials, out, accumulate):
    """out (M, N) f32 (+)= the sum over z of partials[z*M + m, n], z in a fixed order (deterministic).

    partials (splits * M, N) f32. Thread (blockIdx.x * blockDim.x + threadIdx.x) owns column n;
    blockIdx.y walks the rows (grid-stride): N/256 x M blocks, enough to keep every SM streaming.
    """
    num_tokens = out.shape[0]
    splits = partials.shape[0] // num_tokens
    n = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if n < out.shape[1]:
        for m in range(cuda.blockIdx.y, num_tokens, cuda.gridDim.y):
            total = out[m, n] if accumulate else float32(0.0)
            for z in range(splits):
                total += partials[z * num_tokens + m, n]
            out[m, n] = total


def gemm_tc(
    x, w, out, accumulate: bool = False, config: TileConfig | None = None, split: int | None = None, workspace=None
) -> None:
    """out = x @ w.T (or out += x @ w.T) on the tensor cores, any shape; x is rounded to bf16.

    x (M, K) f32, w (N, K) bf16 device array (or its uint16 bits view), out (M, N) f32.
    `config` and `split` force a tiling and a K split (tests); by default the largest tiling that
    fills the GPU, and K split while the GPU has room for more blocks. The parts of a split K are
    written to a workspace and summed in a fixed order by a second kernel: the same inputs give the
    same bits on every run (atomic adds would not, and bf16 rounding downstream amplifies their order).
    `workspace`: (>= split_workspace_floats(num_sms),) f32 device scratch for those parts (the
    model's); without one a split product allocates its own.
    """
    num_tokens, num_rows, k_dim = check_linear_args(x, w, out)
    if num_tokens == 0 or num_rows == 0:
        return
    w_bits = weight_bits(w)
    vectors_ok = 1 if k_dim % CHUNK_VALUES == 0 and vector_aligned(x) and vector_aligned(w_bits) else 0
    config = config or pick_tile_config(num_tokens, num_rows, num_sms())
    grid_n, grid_m = -(-num_rows // config.block_n), -(-num_tokens // config.block_m)
    split = split or pick_k_split(grid_n * grid_m, k_dim, num_sms())
    num_tiles = -(-k_dim // BLOCK_K)
    tiles_per_split = -(-num_tiles // split)
    splits = -(-num_tiles // tiles_per_split)  # no empty part
    kernel_ = gemm_tc_kernel_for(config)
    flag = 1 if accumulate else 0
    if splits == 1:
        launch(kernel_, (grid_n, grid_m, 1), config.threads, x, w_bits, out, flag, vectors_ok, tiles_per_split)
        return
    if workspace is None:
        workspace = cuda.device_array(splits * num_tokens * num_rows, np.float32)
    if splits * num_tokens * num_rows > workspace.shape[0]:
        raise KernelError(f"gemm_tc: a {splits}-way K split of a {num_tokens}x{num_rows} product exceeds the workspace")
    partials = workspace[: splits * num_tokens * num_rows].reshape(splits * num_tokens, num_rows)
    launch(kernel_, (grid_n, grid_m, splits), config.threads, x, w_bits, partials, 0, vectors_ok, tiles_per_split)
    launch(_sum_splits_kernel, (-(-num_rows // SUM_THREADS), min(num_tokens, 1024)), SUM_THREADS, partials, out, flag)
