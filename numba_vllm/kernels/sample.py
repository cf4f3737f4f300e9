"""Picking the next token on the GPU: greedy argmax, and temperature sampling by the Gumbel-max trick.

    argmax:         token_ids[b] = argmax_i logits[b, i]
    sample_gumbel:  token_ids[b] = argmax_i (logits[b, i] / temperatures[b] + G(seeds[b], steps[b], i))
                    (plain argmax where temperatures[b] == 0: those rows compute no noise at all,
                    so one launch serves a batch mixing greedy and sampled rows)

logits (B, V) float32; token_ids (B,) int32; temperatures (B,) float32; seeds (B,) uint32;
steps (B,) int32 (the request's output index: 0 for its first generated token, then 1, 2, ...).

Ties go to the lowest index and a NaN beats every number (the first NaN wins), as in
``numpy.argmax``: a row of NaN logits gives a NaN's index, visibly not a normal token.

Gumbel-max: if G_i are independent standard Gumbel variables, ``argmax_i (z_i + G_i)`` is a draw
from ``softmax(z)``. With ``z = logits / T`` that is exactly temperature sampling, done in the same
single pass as the argmax, with no softmax, no normalisation and no host round trip.
top-k and top-p are not applied here: requests that use them are still sampled on the host
(``numba_vllm.engine.sampling``) for now.

The noise is a counter-based hash, not a stateful generator: ``G = -log(-log(u))`` with
``u = uniform(pcg_hash(pcg_hash(i) ^ key))`` and ``key = pcg_hash(pcg_hash(seed) ^ step)``. Any
thread can compute the noise of any (seed, step, i) independently, nothing is stored between
steps, and a request's tokens depend only on its own seed, step and logits, not on the batch it
runs in. ``pcg_hash`` is the "PCG hash" of Jarzynski and Olano (Hash Functions for GPU Rendering,
JCGT 2020): one step of a PCG linear congruential generator followed by PCG's RXS-M-XS output
permutation, a 32-bit to 32-bit bijection that passes the usual avalanche tests. Hashing the index
before mixing in the key keeps draws of different steps unrelated (with ``i ^ key`` alone, step s
would see the noise of step s' at index ``i ^ key ^ key'``). The arithmetic runs on uint64 holding
32-bit values, masked after each multiply, so it is exact and identical on the GPU, in the
simulator and in the NumPy mirror ``gumbel_noise`` (``pcg_hash`` and ``bits_to_uniform`` are the
same Python functions in all three).
``u = (top 23 bits + 0.5) / 2**23`` lies in [2**-24, 1 - 2**-24]: never 0 or 1, so the logs are
finite (|G| <= 16.7).

Thread mapping: grid (B, parts), blocks of ``min(SAMPLE_MAX_THREADS, ceil(part_cols / 4) rounded
up to 32)`` threads. Block (b, p) owns the contiguous slice ``[p * part_cols, min(V, (p + 1) *
part_cols))`` of row b, where ``part_cols = ceil(V / parts)`` rounded up to a multiple of 32 (a
slice starts 128-byte aligned when its row does) and ``parts`` is then recounted as
``ceil(V / part_cols)`` so that no part is empty. The slice is walked in tiles of ``blockDim.x *
SAMPLE_COLS_PER_THREAD`` columns; in a tile, thread ``x`` loads columns ``tile + x + c *
blockDim.x`` (``c < 4``: coalesced, 4 loads in flight at once), then compares them in that order
against its best (value, index). Because a thread visits its indices in increasing order and
replaces its best only on a strictly better value, its best already has the lowest index among
equal values. Then ``block_argmax`` combines the threads' candidates: a warp-shuffle butterfly
carrying (value, index) pairs in each warp, the warp winners through shared memory, and a second
butterfly. With ``parts == 1`` thread 0 writes ``token_ids[b]`` and that is all (one launch).
Otherwise it writes the slice's winner to slot ``b * parts + p`` of the workspace, and a second
kernel, ``reduce_parts_kernel`` (grid = B, one warp per row), finishes: lane ``l`` compares parts
``l, l + 32, ...`` in increasing order, ``warp_argmax`` combines the lanes, lane 0 writes
``token_ids[b]``. ``ranks_before`` is a total order on (value, index) pairs, so the winner does
not depend on how a row is cut: any ``parts`` gives the same token, and the same as numpy.

The parts rule (``pick_parts``) looks at the shapes and the SM count only, never at the data: a
CUDA graph records the grid once and replays it on other logits.
``parts = max(1, min(SAMPLE_BLOCKS_PER_SM * num_sms // B, V // SAMPLE_MIN_PART_COLS))``: split the
rows until the grid has about 2 blocks per SM, keeping at least 2048 columns in a part (a block
then still has hundreds of threads with 4 loads each in flight; smaller parts would only add
second-pass work). On an H200 (132 SMs: 264 blocks) with V = 128 256: B = 1 or 3 gives 62 parts of
2080 columns (544 threads), B = 8 gives 33, B = 64 gives 4, and B >= 133 one block per row, in a
single pass.

The workspace (``workspace``, a `PartWinners`): ``SAMPLE_WORKSPACE_SLOTS`` winners, values (float32)
and indices (int32) in two device arrays that the model allocates with its other buffers, so their
addresses never change and a recorded graph keeps pointing at them. 4096 slots (32 KB) hold the
2-blocks-per-SM grid of any GPU up to 2048 SMs. One workspace serves every launch: samplers must
not run concurrently on two streams.

Measured on an H200 with the earlier one-block-per-row kernels (grid = B, no split): one row of
Llama 3.2 1B (V = 128 256; a block of 1024 threads reading 125 values per thread) took 25 us
(argmax) and 74 us (sample_gumbel: the hashes and logs make it compute-bound) with a single SM
working, while 256 rows took 52 us (2.5 TB/s) and 150 us. Those batch-1 figures are what the split
addresses; 256 rows still run one block per row. The split kernels have not been measured yet.

Shared memory: ``scratch_values`` (32,) float32 and ``scratch_indices`` (32,) int32, one slot per
warp (256 bytes). The per-thread (4,) array of loaded values lives in registers (constant-trip
loops, unrolled). Registers bound the tile: a 1024-thread block may use at most 64 registers per
thread, and with 16 columns a thread the kernels needed more and failed to launch
(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES).
"""

import math
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, int32, uint64

from numba_vllm.kernels._launch import KernelError, check_array, launch, num_sms
from numba_vllm.kernels.jit import device_function, kernel
from numba_vllm.kernels.reductions import FULL_MASK, WARP_SIZE

SAMPLE_MAX_THREADS = 1024  # threads per block; a part longer than 4 columns a thread loops
SAMPLE_COLS_PER_THREAD = 4  # columns a thread loads before comparing them (a compile-time constant)
SAMPLE_BLOCKS_PER_SM = 2  # split rows into parts until the grid has about this many blocks per SM ...
SAMPLE_MIN_PART_COLS = 2048  # ... but keep at least this many columns in each part
SAMPLE_WORKSPACE_SLOTS = 4096  # part winners the workspace holds (B * parts of a split launch)
NO_INDEX = 2**31 - 1  # index of "no candidate yet": loses every tie against a real index
MASK32 = uint64(0xFFFFFFFF)


# ---- (value, index) reductions -------------------------------------------------------------------
@device_function
def ranks_before(v, i, w, j):
    """True when candidate (v, i) beats (w, j): NaN first, then the larger value, then the lower index."""
    if math.isnan(v):
        return not math.isnan(w) or i < j
    if math.isnan(w):
        return False
    return v > w or (v == w and i < j)


@device_function
def warp_argmax(v, i):
    """The best (value, index) over the 32 lanes of the warp, returned in every lane."""
    offset = WARP_SIZE // 2
    while offset > 0:
        other_v = cuda.shfl_xor_sync(FULL_MASK, v, offset)
        other_i = cuda.shfl_xor_sync(FULL_MASK, i, offset)
        if ranks_before(other_v, other_i, v, i):
            v = other_v
            i = other_i
        offset //= 2
    return v, i


@device_function
def block_argmax(v, i, scratch_values, scratch_indices):
    """The best (value, index) over the block, returned in every thread (all threads must call).

    scratch_values (32,) float32 and scratch_indices (32,) int32: shared arrays, overwritten.
    """
    lane = cuda.threadIdx.x % WARP_SIZE
    warp = cuda.threadIdx.x // WARP_SIZE
    num_warps = cuda.blockDim.x // WARP_SIZE
    v, i = warp_argmax(v, i)
    if lane == 0:
        scratch_values[warp] = v
        scratch_indices[warp] = i
    cuda.syncthreads()  # wait for every warp's winner
    if lane < num_warps:
        v = scratch_values[lane]
        i = scratch_indices[lane]
    else:
        v = float32(-math.inf)
        i = int32(NO_INDEX)
    v, i = warp_argmax(v, i)
    cuda.syncthreads()  # wait until every warp has read the scratch arrays, so they can be reused
    return v, i


# ---- counter-based noise -------------------------------------------------------------------------
# pcg_hash and bits_to_uniform are plain Python: compiled below as device functions for the kernel,
# and called on NumPy arrays by gumbel_noise, so host and device share one definition.
def pcg_hash(x):
    """uint32 -> uint32 mixer (PCG hash). x: uint64 holding a value below 2**32 (scalar or array)."""
    state = (x * uint64(747796405) + uint64(2891336453)) & MASK32  # one LCG step
    shift = (state >> uint64(28)) + uint64(4)  # RXS: a shift chosen by the top bits
    word = (((state >> shift) ^ state) * uint64(277803737)) & MASK32  # M: multiply
    return (word >> uint64(22)) ^ word  # XS: fold the high bits down


def bits_to_uniform(bits):
    """32 random bits -> float32 in [2**-24, 1 - 2**-24]: the top 23 bits, centred in their cell."""
    return (float32(bits >> uint64(9)) + float32(0.5)) * float32(1.0 / 2**23)


_pcg_hash = device_function(pcg_hash)
_bits_to_uniform = device_function(bits_to_uniform)


@device_function
def _noise_key(seed, step):
    """The key all of a row's noise derives from: pcg_hash(pcg_hash(seed) ^ step)."""
    return _pcg_hash(_pcg_hash(uint64(seed) & MASK32) ^ (uint64(step) & MASK32))


@device_function
def _noise_uniform(key, index):
    """The uniform draw of vocabulary entry ``index`` under ``key``: pcg_hash(pcg_hash(index) ^ key)."""
    return _bits_to_uniform(_pcg_hash(_pcg_hash(uint64(index) & MASK32) ^ key))


def gumbel_noise(seed: int, step: int, vocab_size: int) -> np.ndarray:
    """The kernel's Gumbel noise for one (seed, step), computed on the host: (vocab_size,) float32.

    The same arithmetic as ``_noise_key`` and ``_noise_uniform``; -log(-log(u)) in float32.
    """
    key = pcg_hash(pcg_hash(np.uint64(seed % 2**32)) ^ np.uint64(step % 2**32))
    u = bits_to_uniform(pcg_hash(pcg_hash(np.arange(vocab_size, dtype=np.uint64)) ^ key))
    return -np.log(-np.log(u))


# ---- the kernels ---------------------------------------------------------------------------------
@device_function
def _pick_in_slice(logits, greedy, temperature, key, part_cols, token_ids, part_values, part_indices):
    """Block (b, p)'s winner over its slice of row b: token_ids[b] when the grid has one part, else slot
    b * parts + p of the workspace. Every thread of the block must call it (it reduces over the block).

    logits (B, V) float32; greedy: compare the logits themselves, else logits / temperature + the
    Gumbel noise of ``key``; part_cols: columns per part; token_ids (B,) int32; part_values
    (>= B * parts,) float32 and part_indices (>= B * parts,) int32: the workspace.
    """
    scratch_values = cuda.shared.array(32, float32)  # (32,) one winner value per warp
    scratch_indices = cuda.shared.array(32, int32)  # (32,) its index
    values = cuda.local.array(SAMPLE_COLS_PER_THREAD, float32)  # (4,) this thread's values in a tile
    b = cuda.blockIdx.x
    p = cuda.blockIdx.y
    start = p * part_cols
    stop = min(start + part_cols, logits.shape[1])
    tile_width = cuda.blockDim.x * SAMPLE_COLS_PER_THREAD
    best_v = float32(-math.inf)
    best_i = int32(NO_INDEX)
    for tile in range(start, stop, tile_width):
        first = tile + cuda.threadIdx.x
        for c in range(SAMPLE_COLS_PER_THREAD):  # every load first: they overlap in flight
            idx = first + c * cuda.blockDim.x
            if idx < stop:
                values[c] = logits[b, idx]
        for c in range(SAMPLE_COLS_PER_THREAD):  # then perturb and compare, in increasing index order
            idx = first + c * cuda.blockDim.x
            if idx < stop:
                v = values[c]
                if not greedy:
                    u = _noise_uniform(key, idx)
                    v = v / temperature - math.log(-math.log(u))  # + a standard Gumbel draw
                if ranks_before(v, int32(idx), best_v, best_i):
                    best_v = v
                    best_i = int32(idx)
    best_v, best_i = block_argmax(best_v, best_i, scratch_values, scratch_indices)
    if cuda.threadIdx.x == 0:
        if cuda.gridDim.y == 1:
            token_ids[b] = best_i
        else:
            slot = b * cuda.gridDim.y + p
            part_values[slot] = best_v
            part_indices[slot] = best_i


@kernel
def argmax_kernel(logits, part_cols, token_ids, part_values, part_indices):
    """token_ids[b] = argmax of logits[b] (first index on ties, first NaN wins). Block (b, p): part p of row b.

    logits (B, V) float32; part_cols: columns per part; token_ids (B,) int32 (single part);
    part_values (>= B * parts,) float32 and part_indices (>= B * parts,) int32: the workspace.
    """
    _pick_in_slice(logits, True, float32(0.0), uint64(0), part_cols, token_ids, part_values, part_indices)


@kernel
def sample_gumbel_kernel(logits, temperatures, seeds, steps, part_cols, token_ids, part_values, part_indices):
    """token_ids[b] = argmax_i(logits[b, i] / T_b + Gumbel noise), greedy where T_b == 0. Block (b, p): part p of row b.

    logits (B, V) float32; temperatures (B,) float32; seeds (B,) uint32; steps (B,) int32;
    part_cols: columns per part; token_ids (B,) int32 (single part); part_values (>= B * parts,)
    float32 and part_indices (>= B * parts,) int32: the workspace.
    """
    b = cuda.blockIdx.x
    temperature = temperatures[b]
    greedy = not temperature > float32(0.0)
    key = uint64(0)
    if not greedy:  # a greedy row computes no noise, not even its key
        key = _noise_key(seeds[b], steps[b])
    _pick_in_slice(logits, greedy, temperature, key, part_cols, token_ids, part_values, part_indices)


@kernel
def reduce_parts_kernel(part_values, part_indices, parts, token_ids):
    """token_ids[b] = the index of the best of row b's part winners. Block b (one warp): row b.

    part_values (>= B * parts,) float32 and part_indices (>= B * parts,) int32: the workspace, row
    b's winners in slots b * parts .. b * parts + parts - 1; token_ids (B,) int32.
    """
    b = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    best_v = float32(-math.inf)
    best_i = int32(NO_INDEX)
    for p in range(lane, parts, WARP_SIZE):  # increasing part order within the lane
        slot = b * parts + p
        if ranks_before(part_values[slot], part_indices[slot], best_v, best_i):
            best_v = part_values[slot]
            best_i = part_indices[slot]
    best_v, best_i = warp_argmax(best_v, best_i)
    if lane == 0:
        token_ids[b] = best_i


# ---- launchers -----------------------------------------------------------------------------------
def pick_parts(num_rows: int, vocab_size: int, num_sms: int) -> int:
    """Into how many parts to split each row: up to ``SAMPLE_BLOCKS_PER_SM`` blocks per SM in all,
    each part keeping at least ``SAMPLE_MIN_PART_COLS`` columns; 1 when the rows alone fill that.

    Shapes only, never the data: a CUDA graph replays the grid it recorded.
    """
    return max(1, min(SAMPLE_BLOCKS_PER_SM * num_sms // num_rows, vocab_size // SAMPLE_MIN_PART_COLS))


class PartWinners(NamedTuple):
    """Device scratch of a split launch: each (row, part)'s winner."""

    values: object  # (SAMPLE_WORKSPACE_SLOTS,) f32
    indices: object  # (SAMPLE_WORKSPACE_SLOTS,) i32


def allocate_part_winners() -> PartWinners:
    return PartWinners(cuda.device_array(SAMPLE_WORKSPACE_SLOTS, np.float32), cuda.device_array(SAMPLE_WORKSPACE_SLOTS, np.int32))


def _num_threads(part_cols: int) -> int:
    cols_per_thread = -(-part_cols // SAMPLE_COLS_PER_THREAD)
    return min(SAMPLE_MAX_THREADS, -(-cols_per_thread // WARP_SIZE) * WARP_SIZE)


def _launch_picker(name, kernel_, logits, row_args, token_ids, workspace) -> None:
    """Launch ``kernel_`` (argmax or sample_gumbel) over grid (B, parts), then, with several parts,
    ``reduce_parts_kernel`` over the winners. row_args: the kernel's per-row arrays after logits."""
    num_rows, vocab_size = logits.shape
    if vocab_size == 0:
        raise KernelError(f"{name}: logits have no columns")
    part_cols = -(-vocab_size // pick_parts(num_rows, vocab_size, num_sms()))
    part_cols = -(-part_cols // WARP_SIZE) * WARP_SIZE  # slices start on 128-byte boundaries
    parts = -(-vocab_size // part_cols)  # no empty part
    part_values, part_indices = workspace or allocate_part_winners()
    if parts > 1 and num_rows * parts > SAMPLE_WORKSPACE_SLOTS:
        raise KernelError(f"{name}: {num_rows} rows in {parts} parts exceed the {SAMPLE_WORKSPACE_SLOTS}-slot workspace")
    grid = (num_rows, parts)
    launch(kernel_, grid, _num_threads(part_cols), logits, *row_args, part_cols, token_ids, part_values, part_indices)
    if parts > 1:
        launch(reduce_parts_kernel, num_rows, WARP_SIZE, part_values, part_indices, parts, token_ids)


def argmax(logits, token_ids, workspace: PartWinners | None = None) -> None:
    """Greedy decoding: token_ids[b] = argmax of logits[b] (device arrays).

    logits: (B, V) float32; token_ids: (B,) int32, overwritten. `workspace`: the model's part
    winners (a split launch without one allocates its own).
    """
    check_array("logits", logits, dtype="float32", ndim=2)
    num_rows = logits.shape[0]
    check_array("token_ids", token_ids, dtype="int32", shape=(num_rows,))
    if num_rows == 0:
        return
    _launch_picker("argmax", argmax_kernel, logits, (), token_ids, workspace)


def sample_gumbel(logits, temperatures, seeds, steps, token_ids, workspace: PartWinners | None = None) -> None:
    """Temperature sampling of one token per row (device arrays); rows with temperature 0 are greedy.

    logits: (B, V) float32; temperatures: (B,) float32, >= 0; seeds: (B,) uint32 (a request's
    seed modulo 2**32); steps: (B,) int32, >= 0, the index of the token being generated within
    its request; token_ids: (B,) int32, overwritten. The same (seed, step, logits row) always
    gives the same token. temperatures and seeds may be float32 / uint32 views of an int32
    buffer's slice (a CUDA graph's packed per-step inputs): only the dtype and layout are checked.
    `workspace` as for `argmax`.
    """
    check_array("logits", logits, dtype="float32", ndim=2)
    num_rows = logits.shape[0]
    check_array("temperatures", temperatures, dtype="float32", shape=(num_rows,))
    check_array("seeds", seeds, dtype="uint32", shape=(num_rows,))
    check_array("steps", steps, dtype="int32", shape=(num_rows,))
    check_array("token_ids", token_ids, dtype="int32", shape=(num_rows,))
    if num_rows == 0:
        return
    _launch_picker("sample_gumbel", sample_gumbel_kernel, logits, (temperatures, seeds, steps), token_ids, workspace)
