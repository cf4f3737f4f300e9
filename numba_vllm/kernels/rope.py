"""Rotary position embedding (RoPE) on the fused Q/K/V product, with K and V stored into the paged cache.

The model computes q, k and v of a token as one product (``qkv`` (T, H + 2*KVH, HD) float32: its H
query heads, then KVH key heads, then KVH value heads). This kernel splits it, in one launch:
- query heads are rotated and written to ``q`` (T, H, HD) float32, what attention reads;
- key heads are rotated and stored, rounded to bf16, at the token's kv index in ``k_cache``;
- value heads are stored, rounded to bf16, at the same place in ``v_cache``.
The kv index is ``kv_indices[t] = page_id * PAGE_SIZE + offset`` (int32), chosen by the host when it
allocated the sequence's pages: the token goes to ``cache[page_id, offset]``. A token that should not
be stored (padding) points at the null page 0, which attention never reads. Fusing the rotation with
the write saves a pass over K and a launch per layer (the rotated K only ever lives in the cache).

RoPE itself: for each token t, each head, and each i < HD/2, the channel pair (i, i + HD/2) ("rotate
half", Hugging Face's Llama pairing) is rotated by the angle

    angle = float32(positions[t]) * inv_freq[i]        (a float32 product, rounded once)
    x1' = x1 * cos(angle) - x2 * sin(angle)
    x2' = x2 * cos(angle) + x1 * sin(angle)

``inv_freq`` (HD/2,) float32 comes from ``rope_scaling.rope_inv_freq`` (Llama-3 scaling applied
once on the host). Positions are arbitrary per token, so one kernel serves prefill (0, 1, 2, ...),
decode (one position per sequence) and a batch mixing both. The angle is rounded to float32 as in
Hugging Face's and Meta's Llama code; at position 100 000 that rounding alone is up to
ulp(1e5)/2 = 0.004 rad, which is what the model saw in training.

Thread mapping: one block per token (grid = T) of ``WARP_SIZE x num_warps`` threads, with
``num_warps = min(ROPE_WARPS, H + 2*KVH)``: 32 x 8 for Llama 3.2 1B (48 heads, HD = 64). Warp ``y``
takes heads ``y, y + num_warps, ...`` of the token, ``ROPE_HEADS_IN_FLIGHT`` of them at a time, and
lane ``x`` channel pairs ``x, x + 32, ...`` below HD/2, so a warp reads and writes 32 neighbouring
channels of x1 and of x2 (coalesced). For each of its channel pairs a lane first loads the pair of
every head of the group (all the loads in flight together), then computes the pair's cos and sin
(the arithmetic runs while the loads are on their way), then rotates and stores. The 2-D block
gives head and channel without integer division (64-bit division costs ~100 instructions).

Why this shape: the first version took a block of 32 warps per token, one head per warp, with the
token's cos/sin table in shared memory behind a ``syncthreads``. At 52 registers a thread, one such
block filled an SM's registers: one token at a time per SM, one head's 256 bytes in flight per warp.
On an H200 a 2,048-token prefill step's launch took 70 us (10% of the step) for ~45 MB, 15 us at the
memory's bandwidth. This version's blocks of 8 warps, at 126 registers a thread (ptxas, sm_90),
fit two to an SM, and each warp has 6 heads' loads in flight: 24 KB in flight per SM against 8 KB.
Each warp computes the cos/sin of its own channels (a few dozen instructions, overlapped with its
loads), so there is no shared memory and no block barrier. On an H200 (the pointwise benchmark's
case, Llama 3.2 1B's heads, L2 flushed, CUDA events behind a sleeping kernel): 61.2 us for 4,096
tokens against 144.8 us for the first version in the same run (1.5 TB/s), 6.3 against 8.1 us for
one token. The activations are passed flat, with 32-bit index arithmetic (the launcher refuses a
step of 2**31 q/k/v elements); the caches, which pass 2**31 elements when they fill a GPU, as rows
of slots (a 64-bit row, a 32-bit place in it). HD may be at most ``2 * ROPE_MAX_HALF_DIM``.

The bf16 stores: the caches arrive as their uint16 bits (as attention reads them). A lane rounds its
pair (x1, x2) to bf16 with one ``pack_bf16x2`` (``cvt.rn.bf16x2.f32``, round to nearest even) and
stores the two halves of the word. Numba's own float32 -> bf16 store would call CUDA's bf16
constructor, linked in from C++, through local memory, and could not be linked with line
information on (``make profile``).

Why not ``math.cos``/``math.sin``: on a GPU they become libdevice's ``cosf``/``sinf``, whose slow
path for |angle| > 105615 (Llama 3 reaches 131072) reduces the argument with a 28-byte local array
and FP64 multiplies. ``_sin_cos`` below does the same job in float32 only, in a few lines a learner
can step through:
- Cody-Waite reduction: ``n = round(angle / (pi/2))``, ``r = angle - n * (pi/2)`` with pi/2 split
  into three 7-bit pieces and a float32 remainder (``PIO2_PIECES``). For ``|n| < 2**17`` (angles
  below ~205 000 rad) each product ``n * piece`` has at most 24 significant bits, so it and the
  subtraction are exact in float32: ``r`` is correct to about 1 ulp. Beyond that range the error
  grows like the rounding of the angle itself, which is already larger.
- Taylor polynomials of sin and cos on ``|r| <= pi/4`` (truncation error below 2e-9, under half a
  float32 ulp), then the quadrant ``n mod 4`` picks which one, and which sign, is sin and cos.
The result agrees with cos/sin of the same float32 angle to ~2e-7 (absolute), like ``cosf``.
"""

import math

import numpy as np
from numba import cuda, float32, int32, uint16, uint32

from numba_vllm.kernels._launch import KernelError, check_array, launch
from numba_vllm.kernels.jit import device_function, kernel
from numba_vllm.kernels.kept_views import page_rows
from numba_vllm.kernels.mma import pack_bf16x2
from numba_vllm.kernels.reductions import WARP_SIZE
from numba_vllm.loading.bf16 import BF16
from numba_vllm.model.config import PAGE_SIZE

ROPE_WARPS = 8  # warps per block (at most): one token's heads shared among them
ROPE_HEADS_IN_FLIGHT = 6  # heads a warp loads before rotating and storing any (8 x 6: Llama 3.2 1B's 48 in one pass)
ROPE_MAX_HALF_DIM = 128  # head_dim <= 256: a lane takes at most ROPE_MAX_HALF_DIM / 32 channel pairs


def _split_pi_over_2(num_short_pieces: int = 3, bits: int = 7) -> tuple:
    """pi/2 as ``num_short_pieces`` float32 numbers of ``bits`` significant bits, plus the remainder.

    The short pieces make ``n * piece`` exact for ``|n| < 2**(24 - bits)``. float64 pi/2 has 53
    bits, enough for the 3 * 7 + 24 = 45 used here.
    """
    pieces = []
    rest = math.pi / 2
    for _ in range(num_short_pieces):
        scale = 2.0 ** (bits - 1 - math.floor(math.log2(rest)))
        piece = math.floor(rest * scale) / scale  # the top `bits` bits of rest
        pieces.append(np.float32(piece))
        rest -= piece  # exact in float64
    pieces.append(np.float32(rest))
    return tuple(pieces)


PIO2_PIECES = _split_pi_over_2()  # pi/2 = sum of these (to ~1e-16): 1.5625, 0.00817871, 0.000117302, 3.13916e-07
_PIO2_A, _PIO2_B, _PIO2_C, _PIO2_D = PIO2_PIECES
_TWO_OVER_PI = np.float32(2 / math.pi)
# Taylor coefficients: sin r = r + r^3 S3 + ... + r^9 S9;  cos r = 1 + r^2 C2 + ... + r^10 C10
_S3, _S5, _S7, _S9 = (np.float32((-1) ** k / math.factorial(2 * k + 1)) for k in range(1, 5))
_C2, _C4, _C6, _C8, _C10 = (np.float32((-1) ** k / math.factorial(2 * k)) for k in range(1, 6))


@device_function
def _sin_cos(angle):
    """(sin(angle), cos(angle)) in float32 arithmetic only; see the module docstring."""
    n = float32(math.floor(angle * _TWO_OVER_PI + float32(0.5)))  # angle / (pi/2), rounded
    r = angle - n * _PIO2_A  # each product is exact, and so is each difference (Cody-Waite)
    r = r - n * _PIO2_B
    r = r - n * _PIO2_C
    r = r - n * _PIO2_D  # r = angle - n * pi/2, in [-pi/4, pi/4] (up to rounding)
    r2 = r * r
    sin_r = r + r * r2 * (_S3 + r2 * (_S5 + r2 * (_S7 + r2 * _S9)))
    cos_r = float32(1.0) + r2 * (_C2 + r2 * (_C4 + r2 * (_C6 + r2 * (_C8 + r2 * _C10))))
    quadrant = int32(n) & 3  # angle = r + quadrant * pi/2 (mod 2 pi)
    if quadrant == 0:
        return sin_r, cos_r
    if quadrant == 1:
        return cos_r, -sin_r
    if quadrant == 2:
        return -sin_r, -cos_r
    return -cos_r, sin_r


@kernel
def rope_kernel(qkv, positions, inv_freq, kv_indices, q, k_cache, v_cache, num_q_heads, num_kv_heads):
    """Split one token's fused Q/K/V (block t handles token t): rotate q into ``q``, rotate k into
    the K cache, copy v into the V cache.

    The activations flat, so that an element's place is one 32-bit multiply-add from its row's: qkv
    (T * (H + 2*KVH) * HD,) f32; positions, kv_indices (T,) int32; inv_freq (HD/2,) f32; q (T * H *
    HD,) f32 out. The caches as rows of slots, k_cache, v_cache (P * PAGE_SIZE, KVH * HD) uint16 (bf16
    bits): a slot's place is 64-bit (a cache can pass 2**31 elements), a place in it 32-bit.
    num_q_heads H, num_kv_heads KVH (int32).
    """
    x1s = cuda.local.array(ROPE_HEADS_IN_FLIGHT, float32)  # the group's heads' channel i
    x2s = cuda.local.array(ROPE_HEADS_IN_FLIGHT, float32)  # and channel i + HD/2
    t = cuda.blockIdx.x
    half = int32(inv_freq.shape[0])
    head_dim = 2 * half
    position = float32(positions[t])
    num_heads = num_q_heads + 2 * num_kv_heads
    qkv_row = t * num_heads * head_dim  # token t's first element of qkv
    q_row = t * num_q_heads * head_dim
    slot = kv_indices[t]  # its row (page * PAGE_SIZE + offset) in the caches
    warps = cuda.blockDim.y
    for first in range(cuda.threadIdx.y, num_heads, warps * ROPE_HEADS_IN_FLIGHT):  # heads first + j * warps
        for i in range(cuda.threadIdx.x, half, WARP_SIZE):  # the lane's channel pairs (i, i + HD/2)
            for j in range(ROPE_HEADS_IN_FLIGHT):  # every load of the group before any use
                head = first + j * warps
                if head < num_heads:
                    x1s[j] = qkv[qkv_row + head * head_dim + i]
                    x2s[j] = qkv[qkv_row + head * head_dim + i + half]
            sin_i, cos_i = _sin_cos(position * inv_freq[i])
            for j in range(ROPE_HEADS_IN_FLIGHT):
                head = first + j * warps
                if head >= num_heads:
                    continue
                x1, x2 = x1s[j], x2s[j]
                if head < num_q_heads + num_kv_heads:  # q or k: rotate
                    x1, x2 = x1 * cos_i - x2 * sin_i, x2 * cos_i + x1 * sin_i
                if head < num_q_heads:
                    q[q_row + head * head_dim + i] = x1
                    q[q_row + head * head_dim + i + half] = x2
                    continue
                pair = pack_bf16x2(x1, x2)  # bf16(x1) in the low half, bf16(x2) in the high half
                cache = k_cache if head < num_q_heads + num_kv_heads else v_cache
                at = (head - num_q_heads) % num_kv_heads * head_dim + i
                cache[slot, at] = uint16(pair & uint32(0xFFFF))
                cache[slot, at + half] = uint16(pair >> uint32(16))


def rope_and_cache_write(qkv, positions, inv_freq, kv_indices, q, k_cache, v_cache) -> None:
    """RoPE on the fused Q/K/V product: rotated q to ``q``, rotated k and v into the paged cache.

    qkv: (T, H + 2*KVH, HD) float32 (q heads, k heads, v heads); positions: (T,) int32, >= 0;
    inv_freq: (HD/2,) float32 from ``rope_scaling.rope_inv_freq``; kv_indices: (T,) int32 kv indices
    (``page_id * PAGE_SIZE + offset``); q: (T, H, HD) float32, written; k_cache, v_cache:
    (num_pages, PAGE_SIZE, KVH, HD) bf16, written at the kv indices only. HD even, at most 256.
    """
    check_array("qkv", qkv, dtype="float32", ndim=3)
    check_array("q", q, dtype="float32", ndim=3)
    num_tokens, num_heads, head_dim = q.shape
    check_array("k_cache", k_cache, BF16, (None, PAGE_SIZE, None, head_dim))
    check_array("v_cache", v_cache, BF16, tuple(k_cache.shape))
    num_kv_heads = k_cache.shape[2]
    check_array("qkv", qkv, shape=(num_tokens, num_heads + 2 * num_kv_heads, head_dim))
    check_array("positions", positions, dtype="int32", shape=(num_tokens,))
    check_array("kv_indices", kv_indices, dtype="int32", shape=(num_tokens,))
    if head_dim % 2 or head_dim // 2 > ROPE_MAX_HALF_DIM:
        raise KernelError(f"rope: head_dim {head_dim} must be even and at most {2 * ROPE_MAX_HALF_DIM}")
    check_array("inv_freq", inv_freq, dtype="float32", shape=(head_dim // 2,))
    if num_tokens == 0:
        return
    if k_cache.shape[0] == 0:
        raise KernelError("k_cache: has no pages")
    num_warps = min(ROPE_WARPS, num_heads + 2 * num_kv_heads)
    if qkv.size >= 2**31:
        raise KernelError(f"rope: a step of 2**31 q/k/v elements or more ({qkv.size}) needs 64-bit indices")
    launch(rope_kernel, num_tokens, (WARP_SIZE, num_warps), qkv.reshape(qkv.size), positions, inv_freq, kv_indices,
           q.reshape(q.size), page_rows(k_cache), page_rows(v_cache), np.int32(num_heads), np.int32(num_kv_heads))  # fmt: skip
