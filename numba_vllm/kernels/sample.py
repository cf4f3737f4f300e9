"""Picking the next token on the GPU: greedy argmax, and temperature sampling by the Gumbel-max trick.

    argmax:         token_ids[b] = argmax_i logits[b, i]
    sample_gumbel:  token_ids[b] = argmax_i (logits[b, i] / temperatures[b] + G(seeds[b], steps[b], i))
                    (plain argmax where temperatures[b] == 0)

logits (B, V) float32; token_ids (B,) int32; temperatures (B,) float32; seeds (B,) uint32;
steps (B,) int32 (the request's output index: 0 for its first generated token, then 1, 2, ...).

Ties go to the lowest index and a NaN beats every number (the first NaN wins), as in
``numpy.argmax``: a row of NaN logits gives a NaN's index, visibly not a normal token.

Gumbel-max: if G_i are independent standard Gumbel variables, ``argmax_i (z_i + G_i)`` is a draw
from ``softmax(z)``. With ``z = logits / T`` that is exactly temperature sampling, done in the same
single pass as the argmax, with no softmax, no normalisation and no host round trip.
top-k and top-p are not applied here: requests that use them are still sampled on the host
(``numba_vllm.sampling``) for now.

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

Thread mapping: one block per row (grid = B) of ``min(SAMPLE_MAX_THREADS, ceil(V / 4) rounded up
to 32)`` threads. The row is walked in tiles of ``blockDim.x * SAMPLE_COLS_PER_THREAD`` columns; in
a tile, thread ``x`` loads columns ``tile + x + c * blockDim.x`` (``c < 4``: coalesced, 4 loads in
flight at once), then compares them in that order against its best (value, index). Because a
thread visits its indices in increasing order and replaces its best only on a strictly better
value, its best already has the lowest index among equal values. Then ``block_argmax`` combines
the threads' candidates: a warp-shuffle butterfly carrying (value, index) pairs in each warp, the
warp winners through shared memory, and a second butterfly. For Llama 3.2 1B (V = 128 256) a
block of 1024 threads reads 125 values per thread; one block per row keeps the reduction in one
place, at the cost of a single SM working on a batch-1 row. Measured on an H200: one row takes
25 us (argmax) and 74 us (sample_gumbel: the hashes and logs make it compute-bound), while 256
rows take 52 us (2.5 TB/s) and 150 us. Splitting a row over several blocks (partial winners,
then a second pass) is the next step if batch-1 decode needs it.

Shared memory: ``scratch_values`` (32,) float32 and ``scratch_indices`` (32,) int32, one slot per
warp (256 bytes). The per-thread (4,) array of loaded values lives in registers (constant-trip
loops, unrolled). Registers bound the tile: a 1024-thread block may use at most 64 registers per
thread, and with 16 columns a thread the kernels needed more and failed to launch
(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES).
"""

import math

import numpy as np
from numba import cuda, float32, int32, uint64

from numba_vllm.kernels.jit import device_function, kernel
from numba_vllm.kernels.launch import check_array, launch
from numba_vllm.kernels.reductions import FULL_MASK, WARP_SIZE

SAMPLE_MAX_THREADS = 1024  # threads per block; a row longer than 4 columns a thread loops
SAMPLE_COLS_PER_THREAD = 4  # columns a thread loads before comparing them (a compile-time constant)
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
@kernel
def argmax_kernel(logits, token_ids):
    """token_ids[b] = argmax of logits[b] (first index on ties, first NaN wins). Block b: row b.

    logits (B, V) float32; token_ids (B,) int32.
    """
    scratch_values = cuda.shared.array(32, float32)  # (32,) one winner value per warp
    scratch_indices = cuda.shared.array(32, int32)  # (32,) its index
    values = cuda.local.array(SAMPLE_COLS_PER_THREAD, float32)  # (4,) this thread's values in a tile
    b = cuda.blockIdx.x
    vocab_size = logits.shape[1]
    tile_width = cuda.blockDim.x * SAMPLE_COLS_PER_THREAD
    best_v = float32(-math.inf)
    best_i = int32(NO_INDEX)
    for tile in range(0, vocab_size, tile_width):
        first = tile + cuda.threadIdx.x
        for c in range(SAMPLE_COLS_PER_THREAD):  # every load first: they overlap in flight
            idx = first + c * cuda.blockDim.x
            if idx < vocab_size:
                values[c] = logits[b, idx]
        for c in range(SAMPLE_COLS_PER_THREAD):  # then compare, in increasing index order
            idx = first + c * cuda.blockDim.x
            if idx < vocab_size and ranks_before(values[c], int32(idx), best_v, best_i):
                best_v = values[c]
                best_i = int32(idx)
    best_v, best_i = block_argmax(best_v, best_i, scratch_values, scratch_indices)
    if cuda.threadIdx.x == 0:
        token_ids[b] = best_i


@kernel
def sample_gumbel_kernel(logits, temperatures, seeds, steps, token_ids):
    """token_ids[b] = argmax_i(logits[b, i] / T_b + Gumbel noise), greedy where T_b == 0. Block b: row b.

    logits (B, V) float32; temperatures (B,) float32; seeds (B,) uint32; steps (B,) int32;
    token_ids (B,) int32.
    """
    scratch_values = cuda.shared.array(32, float32)  # (32,) one winner value per warp
    scratch_indices = cuda.shared.array(32, int32)  # (32,) its index
    values = cuda.local.array(SAMPLE_COLS_PER_THREAD, float32)  # (4,) this thread's values in a tile
    b = cuda.blockIdx.x
    vocab_size = logits.shape[1]
    tile_width = cuda.blockDim.x * SAMPLE_COLS_PER_THREAD
    temperature = temperatures[b]
    greedy = not temperature > float32(0.0)
    key = _noise_key(seeds[b], steps[b])
    best_v = float32(-math.inf)
    best_i = int32(NO_INDEX)
    for tile in range(0, vocab_size, tile_width):
        first = tile + cuda.threadIdx.x
        for c in range(SAMPLE_COLS_PER_THREAD):  # every load first: they overlap in flight
            idx = first + c * cuda.blockDim.x
            if idx < vocab_size:
                values[c] = logits[b, idx]
        for c in range(SAMPLE_COLS_PER_THREAD):  # then perturb and compare, in increasing index order
            idx = first + c * cuda.blockDim.x
            if idx < vocab_size:
                v = values[c]
                if not greedy:
                    u = _noise_uniform(key, idx)
                    v = v / temperature - math.log(-math.log(u))  # + a standard Gumbel draw
                if ranks_before(v, int32(idx), best_v, best_i):
                    best_v = v
                    best_i = int32(idx)
    best_v, best_i = block_argmax(best_v, best_i, scratch_values, scratch_indices)
    if cuda.threadIdx.x == 0:
        token_ids[b] = best_i


# ---- launchers -----------------------------------------------------------------------------------
def _num_threads(vocab_size: int) -> int:
    cols_per_thread = -(-vocab_size // SAMPLE_COLS_PER_THREAD)
    return min(SAMPLE_MAX_THREADS, -(-cols_per_thread // WARP_SIZE) * WARP_SIZE)


def argmax(logits, token_ids) -> None:
    """Greedy decoding: token_ids[b] = argmax of logits[b] (device arrays).

    logits: (B, V) float32; token_ids: (B,) int32, overwritten.
    """
    check_array("logits", logits, dtype="float32", ndim=2)
    num_rows, vocab_size = logits.shape
    check_array("token_ids", token_ids, dtype="int32", shape=(num_rows,))
    if num_rows == 0:
        return
    launch(argmax_kernel, num_rows, _num_threads(vocab_size), logits, token_ids)


def sample_gumbel(logits, temperatures, seeds, steps, token_ids) -> None:
    """Temperature sampling of one token per row (device arrays); rows with temperature 0 are greedy.

    logits: (B, V) float32; temperatures: (B,) float32, >= 0; seeds: (B,) uint32 (a request's
    seed modulo 2**32); steps: (B,) int32, >= 0, the index of the token being generated within
    its request; token_ids: (B,) int32, overwritten. The same (seed, step, logits row) always
    gives the same token.
    """
    check_array("logits", logits, dtype="float32", ndim=2)
    num_rows, vocab_size = logits.shape
    check_array("temperatures", temperatures, dtype="float32", shape=(num_rows,))
    check_array("seeds", seeds, dtype="uint32", shape=(num_rows,))
    check_array("steps", steps, dtype="int32", shape=(num_rows,))
    check_array("token_ids", token_ids, dtype="int32", shape=(num_rows,))
    if num_rows == 0:
        return
    launch(sample_gumbel_kernel, num_rows, _num_threads(vocab_size), logits, temperatures, seeds, steps, token_ids)
