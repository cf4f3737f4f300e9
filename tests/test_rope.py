"""RoPE fused with the K/V cache write (numba_vllm.kernels.rope) against reference.apply_rope, with
Llama 3.2's scaled frequencies, and the K/V rows landing bit-exactly at their kv indices.

Two references:
- the same float32 angle as the kernel (``float32(pos) * inv_freq``, one rounding), with cos and
  sin taken in float64: only the kernel's own sin/cos and the rotation's roundings differ, so the
  tolerance is tight: 1e-6 * max|x| absolute (a few float32 ulps of the largest input; an output
  channel is a difference of two products, so its error is not relative to itself);
- the float64 oracle (``rope_scaling.rope_cos_sin``: exact angles): here the float32 angle's
  rounding adds up to ``|angle32 - angle| <= 2**-24 * angle`` (half an ulp) of rotation error,
  times the pair's length. At position 131071 with inv_freq 1 that is up to 0.0039 rad. The test
  computes each angle's actual rounding and allows exactly that, plus the tight tolerance.
Rotated queries come back in float32; rotated keys are read back from the bf16 cache, so they get
the tolerance plus half a bf16 ulp (up to 2**-8 relative).
``_sin_cos`` (the kernel's float32-only sin/cos) is also tested alone against float64 sin/cos.
"""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from numba_vllm.kernels import rope as rope_module
from numba_vllm.kernels._launch import KernelError
from numba_vllm.kernels.jit import kernel
from numba_vllm.kernels.rope import rope_and_cache_write
from numba_vllm.loading.bf16 import bf16_bits, bf16_from_bits, to_bf16, upload_bf16
from numba_vllm.model import reference
from numba_vllm.model.config import PAGE_SIZE, ModelConfig
from numba_vllm.model.rope_scaling import rope_cos_sin, rope_inv_freq

pytestmark = pytest.mark.gpu_too  # `make test-gpu` runs these on the GPU as well

gpu = pytest.mark.gpu

LLAMA_3_2_1B_DIR = Path(__file__).parent / "data" / "llama-3.2-1b-instruct"  # the published config
MAX_POSITION = 131072
EDGE_POSITIONS = [0, 1, 2, 15, 16, 17, 5000, 8191, 8192, 100000, MAX_POSITION - 1]


def _rng():
    seed = np.random.SeedSequence().entropy % 2**32
    print(f"random seed {seed}")  # shown by pytest when the test fails
    return np.random.default_rng(seed)


def _inv_freq(head_dim):
    """Llama 3.2's llama3-scaled inverse frequencies for this head_dim: (head_dim // 2,) float32."""
    config = ModelConfig.from_dir(LLAMA_3_2_1B_DIR)
    return rope_inv_freq(dataclasses.replace(config, head_dim=head_dim))


def _positions(rng, num_tokens):
    """(T,) int32: the edge positions first (small and large), then random ones, in no order."""
    positions = rng.integers(0, MAX_POSITION, num_tokens).astype(np.int32)
    edges = rng.permutation(EDGE_POSITIONS)[:num_tokens]
    positions[: len(edges)] = edges
    return positions


def _run(q, k, positions, inv_freq, rng=None, v=None):
    """Run the kernel on qkv = [q | k | v] with each token at a random slot of a NaN-filled pool.

    Returns q (T, H, HD) f32, and the K and V rows read back from the cache (T, KVH, HD) as f32;
    also checks that no other slot of the pool was touched."""
    rng = rng or np.random.default_rng(0)
    num_tokens, num_kv_heads, head_dim = k.shape
    v = np.zeros_like(k) if v is None else v
    num_pages = 1 + -(-num_tokens // PAGE_SIZE)
    slots = rng.permutation(np.arange(PAGE_SIZE, num_pages * PAGE_SIZE))[:num_tokens].astype(np.int32)  # never page 0
    pool = to_bf16(np.full((num_pages, PAGE_SIZE, num_kv_heads, head_dim), np.nan, np.float32))
    k_cache, v_cache = upload_bf16(pool), upload_bf16(pool)
    d_q = cuda.to_device(np.full(q.shape, np.nan, np.float32))
    qkv = np.concatenate([q, k, v], axis=1)
    rope_and_cache_write(cuda.to_device(qkv), cuda.to_device(positions), cuda.to_device(inv_freq), cuda.to_device(slots),
                         d_q, k_cache, v_cache)  # fmt: skip
    rows = []
    for cache in (k_cache, v_cache):
        got = bf16_from_bits(cache.view(np.uint16).copy_to_host()).astype(np.float32).reshape(-1, num_kv_heads, head_dim)
        untouched = np.ones(len(got), bool)
        untouched[slots] = False
        assert np.isnan(got[untouched]).all()  # only the tokens' own slots were written
        rows.append(got[slots])
    return d_q.copy_to_host(), rows[0], rows[1]


def _random_case(num_tokens, num_heads, num_kv_heads, head_dim):
    """Random q, k at Llama 3.2's frequencies and edge-heavy positions, through the kernel:
    (q, k, positions, inv_freq, rotated q, rotated k read back from the cache)."""
    rng = _rng()
    q = rng.standard_normal((num_tokens, num_heads, head_dim), dtype=np.float32)
    k = rng.standard_normal((num_tokens, num_kv_heads, head_dim), dtype=np.float32)
    positions = _positions(rng, num_tokens)
    inv_freq = _inv_freq(head_dim)
    q_out, k_out, _ = _run(q, k, positions, inv_freq, rng)
    return q, k, positions, inv_freq, q_out, k_out


def _angles32(positions, inv_freq):
    """(T, HD/2) float32: the kernel's angles, float32(pos) * inv_freq rounded once."""
    return positions.astype(np.float32)[:, None] * inv_freq[None, :]


SHAPES = [  # (T, H, KVH, HD)
    (1, 1, 1, 8),
    (5, 3, 1, 16),
    (3, 4, 2, 64),
    (2, 33, 1, 16),  # 35 heads: 8 warps of 6 heads in flight, the last group partly empty
    (2, 40, 8, 16),  # 56 heads: more than 8 x 6, the head loop runs twice
    (2, 1, 1, 256),  # HD/2 = 128: each lane rotates 4 channel pairs
    pytest.param(1, 32, 8, 64, marks=gpu),
    pytest.param(64, 32, 8, 64, marks=gpu),
    pytest.param(4096, 32, 8, 64, marks=gpu),
]


@pytest.mark.parametrize("num_tokens, num_heads, num_kv_heads, head_dim", SHAPES)
def test_rope_matches_reference_at_the_same_float32_angles(num_tokens, num_heads, num_kv_heads, head_dim):
    q, k, positions, inv_freq, q_out, k_out = _random_case(num_tokens, num_heads, num_kv_heads, head_dim)

    angles = _angles32(positions, inv_freq).astype(np.float64)
    cos, sin = np.cos(angles), np.sin(angles)
    for x, out, cached in ((q, q_out, False), (k, k_out, True)):
        expected = reference.apply_rope(x, cos, sin)
        np.testing.assert_allclose(out, expected, rtol=2.0**-8 if cached else 0, atol=1e-6 * np.abs(x).max())


@pytest.mark.parametrize("num_tokens, num_heads, num_kv_heads, head_dim", SHAPES)
def test_rope_matches_the_float64_oracle_within_angle_rounding(num_tokens, num_heads, num_kv_heads, head_dim):
    q, k, positions, inv_freq, q_out, k_out = _random_case(num_tokens, num_heads, num_kv_heads, head_dim)

    exact = positions.astype(np.float64)[:, None] * inv_freq.astype(np.float64)[None, :]  # (T, HD/2)
    angle_error = np.abs(_angles32(positions, inv_freq) - exact)  # the float32 angle's rounding
    assert (angle_error <= 2.0**-24 * exact).all()  # at most half an ulp
    cos, sin = rope_cos_sin(inv_freq, positions)  # (T, HD/2) of the exact angles, rounded to float32
    half = head_dim // 2
    for x, out, cached in ((q, q_out, False), (k, k_out, True)):
        expected = reference.apply_rope(x, cos, sin)
        pair_length = np.hypot(x[..., :half], x[..., half:])  # (T, heads, HD/2)
        allowed = angle_error[:, None, :] * pair_length + 1e-6 * np.abs(x).max()
        allowed = np.concatenate([allowed, allowed], axis=-1)  # (T, heads, HD): both channels of a pair
        err = np.abs(out - expected)
        if cached:  # the stored key was rounded to bf16: up to 2**-8 of the kernel's value, itself within `allowed`
            allowed = allowed + 2.0**-8 * (np.abs(expected) + allowed)
        assert (err <= allowed).all(), err.max()


@kernel
def sin_cos_kernel(angles, sin_out, cos_out):
    """sin_out[i], cos_out[i] = rope._sin_cos(angles[i]); grid-stride."""
    for i in range(cuda.grid(1), angles.shape[0], cuda.gridsize(1)):
        s, c = rope_module._sin_cos(angles[i])
        sin_out[i] = s
        cos_out[i] = c


def _sin_cos(angles):
    sin_out = cuda.to_device(np.full(angles.shape, np.nan, np.float32))
    cos_out = cuda.to_device(np.full(angles.shape, np.nan, np.float32))
    sin_cos_kernel[min(64, -(-len(angles) // 128)), 128](cuda.to_device(angles), sin_out, cos_out)
    return sin_out.copy_to_host(), cos_out.copy_to_host()


@pytest.mark.parametrize("num_random", [200, pytest.param(1_000_000, marks=gpu)])
def test_sin_cos_is_accurate_over_llama3_angles(num_random):
    """Within 2.5e-7 of float64 sin/cos of the same float32 angle (cosf's own error is ~1e-7)."""
    rng = _rng()
    quarter_turns = np.arange(-3, 200, dtype=np.float64) * (np.pi / 4)  # where the quadrant changes
    special = np.concatenate([
        [0.0, 1e-30, 1e-7, 0.5, 1.0, 105615.0, 131071.0, 131072.0, 205000.0],
        quarter_turns, np.nextafter(quarter_turns.astype(np.float32), np.float32(np.inf)),
    ]).astype(np.float32)
    random = rng.uniform(0, MAX_POSITION, num_random).astype(np.float32)
    angles = np.concatenate([special, -special, random])
    s, c = _sin_cos(angles)
    np.testing.assert_allclose(s, np.sin(angles.astype(np.float64)), rtol=0, atol=2.5e-7)
    np.testing.assert_allclose(c, np.cos(angles.astype(np.float64)), rtol=0, atol=2.5e-7)


def test_sin_cos_beyond_the_exact_range_errs_less_than_the_angle_rounding():
    """Past 2**17 quarter turns the reduction is no longer exact: the error stays below ulp(angle)."""
    angles = np.array([3e5, 1e6, 4e6, 2.0**24 - 1], np.float32)
    s, c = _sin_cos(angles)
    ulp = np.spacing(angles).astype(np.float64)
    assert (np.abs(s - np.sin(angles.astype(np.float64))) <= ulp).all()
    assert (np.abs(c - np.cos(angles.astype(np.float64))) <= ulp).all()


def test_k_and_v_land_bit_exact_at_their_kv_indices():
    """At position 0 the rotation is the identity, so the cache must hold exactly bf16(k) and bf16(v)
    (round to nearest even, as the host's ml_dtypes does), at each token's own slot."""
    rng = np.random.default_rng(0)
    num_tokens, num_heads, num_kv_heads, head_dim = 37, 4, 2, 16  # 37 tokens: three pages
    q = rng.standard_normal((num_tokens, num_heads, head_dim), dtype=np.float32)
    k = rng.standard_normal((num_tokens, num_kv_heads, head_dim), dtype=np.float32)
    v = rng.standard_normal((num_tokens, num_kv_heads, head_dim), dtype=np.float32)
    q_out, k_out, v_out = _run(q, k, np.zeros(num_tokens, np.int32), _inv_freq(head_dim), rng, v)
    np.testing.assert_array_equal(q_out, q)
    np.testing.assert_array_equal(bf16_bits(to_bf16(k_out)), bf16_bits(to_bf16(k)))
    np.testing.assert_array_equal(bf16_bits(to_bf16(v_out)), bf16_bits(to_bf16(v)))


def test_bad_arguments_are_named():
    qkv = cuda.to_device(np.zeros((2, 8, 8), np.float32))  # 4 q heads, 2 kv heads
    q = cuda.to_device(np.zeros((2, 4, 8), np.float32))
    pool = upload_bf16(np.zeros((2, PAGE_SIZE, 2, 8), np.float32))
    positions = cuda.to_device(np.zeros(2, np.int32))
    inv_freq = cuda.to_device(np.ones(4, np.float32))

    def call(qkv=qkv, positions=positions, inv_freq=inv_freq, q=q, k_cache=pool):
        rope_and_cache_write(qkv, positions, inv_freq, cuda.to_device(np.full(2, PAGE_SIZE, np.int32)), q, k_cache, k_cache)

    call()
    with pytest.raises(KernelError, match="positions: dtype int64"):
        call(positions=cuda.to_device(np.zeros(2, np.int64)))
    with pytest.raises(KernelError, match="qkv: shape"):
        call(qkv=cuda.to_device(np.zeros((2, 7, 8), np.float32)))
    with pytest.raises(KernelError, match="inv_freq: shape"):
        call(inv_freq=cuda.to_device(np.ones(8, np.float32)))
    with pytest.raises(KernelError, match="k_cache: dtype float32"):
        call(k_cache=cuda.to_device(np.zeros((2, PAGE_SIZE, 2, 8), np.float32)))
    with pytest.raises(KernelError, match="head_dim 7"):
        call(qkv=cuda.to_device(np.zeros((2, 8, 7), np.float32)), q=cuda.to_device(np.zeros((2, 4, 7), np.float32)),
             k_cache=upload_bf16(np.zeros((2, PAGE_SIZE, 2, 7), np.float32)))  # fmt: skip
