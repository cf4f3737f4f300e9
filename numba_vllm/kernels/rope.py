"""Rotary position embedding (RoPE), applied in place to the queries and keys in one launch.

For each token t, each head of q (T, H, HD) and of k (T, KVH, HD), and each i < HD/2, the channel
pair (i, i + HD/2) ("rotate half", Hugging Face's Llama pairing) is rotated by the angle

    angle = float32(positions[t]) * inv_freq[i]        (a float32 product, rounded once)
    x1' = x1 * cos(angle) - x2 * sin(angle)
    x2' = x2 * cos(angle) + x1 * sin(angle)

``inv_freq`` (HD/2,) float32 comes from ``rope_scaling.rope_inv_freq`` (Llama-3 scaling applied
once on the host). Positions are arbitrary per token, so one kernel serves prefill (0, 1, 2, ...),
decode (one position per sequence) and a batch mixing both. The angle is rounded to float32 as in
Hugging Face's and Meta's Llama code; at position 100 000 that rounding alone is up to
ulp(1e5)/2 = 0.004 rad, which is what the model saw in training.

Thread mapping: one block per token (grid = T) of ``WARP_SIZE x num_warps`` threads, with
``num_warps = min(ROPE_MAX_WARPS, H + KVH)``: 32 x 32 for Llama 3.2 1B (40 heads, HD = 64).
1. The block's threads, numbered flat, compute cos and sin of the token's HD/2 angles into shared
   memory: each angle is computed once per token, not once per head.
2. ``syncthreads``; then warp ``y`` takes heads ``y, y + num_warps, ...`` of the token (q heads
   0..H-1, then k heads as H..H+KVH-1) and lane ``x`` channels ``x, x + 32, ...`` below HD/2, so
   a warp reads and writes 32 neighbouring channels of x1 and of x2 (coalesced). The 2-D block
   gives head and channel without integer division (64-bit division costs ~100 instructions).

Shared memory: ``cos_table`` and ``sin_table``, ``ROPE_MAX_HALF_DIM`` float32 each (1 KiB), of which
the first HD/2 are used; HD may be at most ``2 * ROPE_MAX_HALF_DIM``.

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
from numba import cuda, float32, int32

from numba_vllm.kernels.jit import device_function, kernel
from numba_vllm.kernels.launch import KernelError, check_array, launch
from numba_vllm.kernels.reductions import WARP_SIZE

ROPE_MAX_WARPS = 32  # warps per block (one head each at a time); more heads than this loop
ROPE_MAX_HALF_DIM = 128  # shared cos/sin table size: head_dim <= 256


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


@device_function
def _rotate_pair(x, t, head, i, half, c, s):
    """Rotate channels (i, i + half) of x[t, head] by the angle whose cos and sin are c and s."""
    x1 = x[t, head, i]
    x2 = x[t, head, i + half]
    x[t, head, i] = x1 * c - x2 * s
    x[t, head, i + half] = x2 * c + x1 * s


@kernel
def rope_kernel(q, k, positions, inv_freq):
    """Rotate every (i, i + HD/2) channel pair of q and k in place. Block t handles token t.

    q (T, H, HD), k (T, KVH, HD) float32; positions (T,) int32; inv_freq (HD/2,) float32.
    """
    cos_table = cuda.shared.array(ROPE_MAX_HALF_DIM, float32)  # (HD/2,) used: cos of this token's angles
    sin_table = cuda.shared.array(ROPE_MAX_HALF_DIM, float32)  # (HD/2,) used: sin of this token's angles
    t = cuda.blockIdx.x
    half = inv_freq.shape[0]
    position = float32(positions[t])
    flat_id = cuda.threadIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    for i in range(flat_id, half, cuda.blockDim.x * cuda.blockDim.y):
        s, c = _sin_cos(position * inv_freq[i])
        sin_table[i] = s
        cos_table[i] = c
    cuda.syncthreads()  # wait for the token's whole cos/sin table

    num_q_heads = q.shape[1]
    for head in range(cuda.threadIdx.y, num_q_heads + k.shape[1], cuda.blockDim.y):
        for i in range(cuda.threadIdx.x, half, cuda.blockDim.x):
            if head < num_q_heads:
                _rotate_pair(q, t, head, i, half, cos_table[i], sin_table[i])
            else:
                _rotate_pair(k, t, head - num_q_heads, i, half, cos_table[i], sin_table[i])


def rope(q, k, positions, inv_freq) -> None:
    """Apply RoPE in place to q and k (device arrays) at the tokens' positions.

    q: (T, H, HD) float32; k: (T, KVH, HD) float32; positions: (T,) int32, >= 0;
    inv_freq: (HD/2,) float32 from ``rope_scaling.rope_inv_freq``. HD even, at most 256.
    """
    check_array("q", q, dtype="float32", ndim=3)
    num_tokens, num_heads, head_dim = q.shape
    check_array("k", k, dtype="float32", shape=(num_tokens, None, head_dim))
    check_array("positions", positions, dtype="int32", shape=(num_tokens,))
    if head_dim % 2 or head_dim // 2 > ROPE_MAX_HALF_DIM:
        raise KernelError(f"rope: head_dim {head_dim} must be even and at most {2 * ROPE_MAX_HALF_DIM}")
    check_array("inv_freq", inv_freq, dtype="float32", shape=(head_dim // 2,))
    if num_tokens == 0:
        return
    num_warps = min(ROPE_MAX_WARPS, num_heads + k.shape[1])
    launch(rope_kernel, num_tokens, (WARP_SIZE, num_warps), q, k, positions, inv_freq)
