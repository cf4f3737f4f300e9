"""Attention kernels against the NumPy reference: paged decode, paged causal prefill.

Every case builds a paged KV cache the way the engine does: each sequence's pages are drawn from a
random permutation of the pool (so block tables are neither contiguous nor ordered), page 0 is the
null page, and every cache slot no sequence owns (page 0, unused pages, the tail of each last
page) holds NaN, so a kernel that reads a token it should not, or leaves an output unwritten
(outputs are poisoned with NaN too), fails.

Oracle: ``reference.attention`` in float64 over the same bf16-rounded K/V the kernels read. The
kernels compute in float32 (products, exp, sums), so they differ from it by float32 rounding:
``RTOL``/``ATOL`` below (measured: ~1e-6 at a few dozen keys, a few 1e-6 at 1024).

Under the simulator the shapes are small (context lengths 1/15/16/17/33 around the 16-token page
edges, GQA ratios 1/3/4/8, head dims 64 and small ones) and the whole file takes about a minute;
the ``gpu`` tests run Llama 3.2 1B's heads at 64 sequences x 1024 tokens, and decode at batch 1 and
2 over up to 3000 tokens (split over the context), with fresh random inputs (the seed is in the
failure message).

Decode splits a small grid over the context (flash-decoding) by the GPU's SM count; the simulator
reports one SM, so the split tests pretend to have more (``force_splits``) to get a few splits.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from numba_vllm.kernels import decode_attention as decode_attention_module
from numba_vllm.kernels._launch import KernelError
from numba_vllm.kernels.decode_attention import decode_attention
from numba_vllm.kernels.prefill_attention import prefill_attention
from numba_vllm.kernels.rope import rope_and_cache_write
from numba_vllm.loading.bf16 import to_bf16, upload_bf16
from numba_vllm.model.config import PAGE_SIZE
from tests.helpers.attention import ATOL, PREFILL_SEQS, RTOL, PagedCache, nan_device, reference_attention

pytestmark = pytest.mark.gpu_too  # `make test-gpu` runs these on the GPU as well

EDGE_LENGTHS = [1, 15, 16, 17, 33]  # around page edges, all in one launch








# ---- decode --------------------------------------------------------------------------------------


def check_decode(rng, seq_lens, group, num_kv_heads, head_dim, scale=None, context_lens=None, extra_columns=0, unwritten=np.nan,
                 attention=decode_attention, workspace_floats=decode_attention_module.split_workspace_floats):  # fmt: skip
    """Decode one query per sequence over a cache of `seq_lens` tokens, attending to the first
    `context_lens` of them (default all): the same block tables with shorter contexts; the tables
    get `extra_columns` more (unused) pages. Returns the output (B, H, HD) on the host. `attention`:
    the launcher under test, `workspace_floats` its split workspace's size."""
    num_heads = group * num_kv_heads
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    context_lens = seq_lens if context_lens is None else context_lens
    cache = PagedCache(rng, seq_lens, num_kv_heads, head_dim, unwritten=unwritten)
    cache.block_tables = np.pad(cache.block_tables, ((0, 0), (0, extra_columns)))
    # Table entries past each context name no page at all: a kernel that looks one up fails.
    past = np.arange(cache.block_tables.shape[1]) >= -(-np.array(context_lens)[:, None] // PAGE_SIZE)
    cache.block_tables[past] = cache.num_pages
    q = rng.standard_normal((len(seq_lens), num_heads, head_dim)).astype(np.float32)
    out = nan_device(q.shape)
    k_cache, v_cache, block_tables = cache.device()
    lens = cuda.to_device(np.array(context_lens, np.int32))
    workspace = nan_device(workspace_floats(num_heads, num_kv_heads, head_dim))
    attention(cuda.to_device(q), k_cache, v_cache, block_tables, lens, scale, out, workspace)
    got = out.copy_to_host()
    for s, n in enumerate(context_lens):
        want = reference_attention(q[s : s + 1], cache.k[s], cache.v[s], [n - 1], scale)
        np.testing.assert_allclose(got[s : s + 1], want, rtol=RTOL, atol=ATOL, err_msg=f"sequence {s} of {n} tokens")
    return got


@pytest.mark.parametrize(
    "group, num_kv_heads, head_dim",
    [(1, 2, 64), (3, 1, 64), (4, 2, 64), (8, 1, 64), (2, 2, 16), (2, 1, 8), (2, 1, 128)],
)
def test_decode(group, num_kv_heads, head_dim):
    check_decode(np.random.default_rng(1), EDGE_LENGTHS, group, num_kv_heads, head_dim)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # process-wide: a warning in a simulated thread fails its launch
def test_decode_masks_unwritten_slots_before_any_arithmetic():
    """The cache slots past each context hold inf here (unwritten memory may hold any bits; q . inf
    sums +inf and -inf to NaN): the kernel must not compute with them, not even a score it then masks."""
    check_decode(np.random.default_rng(2), [1, 17], 2, 1, 16, unwritten=np.inf)


@pytest.mark.parametrize("large_grid", [False, True])
def test_decode_several_steps_per_warp_and_scale(monkeypatch, large_grid):
    """150 tokens: each warp walks several pages; a scale other than 1/sqrt(HD). Small grids get
    blocks of SMALL_GRID_WARPS warps, large ones NUM_WARPS: pretend the grid is large to run both."""
    if large_grid:
        monkeypatch.setattr(decode_attention_module, "SMALL_GRID_BLOCKS", 0)
    check_decode(np.random.default_rng(2), [150, 3], 4, 1, 32, scale=0.3)


@pytest.mark.gpu
def test_decode_gpu():
    """Llama 3.2 1B heads (H 32, KVH 8, HD 64), 64 sequences up to 1024 tokens."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    seq_lens = [1024, 1, 16, 17] + list(rng.integers(1, 1025, 60))
    try:
        check_decode(rng, seq_lens, 4, 8, 64)
    except AssertionError as e:
        raise AssertionError(f"seed {seed}: {e}") from None


# ---- decode split over the context (small batches) -----------------------------------------------

SPLIT_LENGTHS = EDGE_LENGTHS + [100]  # a block table 8 pages wide: 7 pages and the padding column


def force_splits(monkeypatch, pages_per_split, min_width=1):
    """Split tables of `min_width` pages or more into ranges of `pages_per_split` pages (the engine's
    sizes need contexts too long for the simulator). `check_decode` passes a workspace poisoned with
    NaN: a partial state the merge reads but no block wrote fails."""
    monkeypatch.setattr(decode_attention_module, "SPLIT_MIN_WIDTH", min_width)
    monkeypatch.setattr(decode_attention_module, "PAGES_PER_SPLIT", pages_per_split)
    monkeypatch.setattr(decode_attention_module, "MAX_SPLITS", 16)


def record_grids(monkeypatch):
    """The (kernel name, grid) of every launch decode_attention makes from now on."""
    grids = []
    real_launch = decode_attention_module.launch

    def launch(kernel, grid, *args):
        grids.append((kernel.py_func.__name__, grid))
        real_launch(kernel, grid, *args)

    monkeypatch.setattr(decode_attention_module, "launch", launch)
    return grids


@pytest.mark.parametrize(
    "group, num_kv_heads, head_dim, pages_per_split, splits",
    [
        (4, 1, 64, 2, 4),  # 2 pages a split: up to 33 tokens leave splits empty, 100 fill all 4 (the last partly)
        pytest.param(1, 2, 64, 2, 4, marks=pytest.mark.slow),  # the same over 2 kv heads: each block's rows of the partials
        pytest.param(4, 1, 64, 1, 8, marks=pytest.mark.slow),  # a page a split
        pytest.param(2, 1, 8, 1, 8, marks=pytest.mark.slow),  # HD 8: a step is two pages, its second past a one-page split
    ],
)
def test_decode_split(monkeypatch, group, num_kv_heads, head_dim, pages_per_split, splits):
    force_splits(monkeypatch, pages_per_split)
    grids = record_grids(monkeypatch)
    check_decode(np.random.default_rng(6), SPLIT_LENGTHS, group, num_kv_heads, head_dim)
    batch = len(SPLIT_LENGTHS)
    assert grids[0] == ("decode_attention_kernel", (num_kv_heads, batch, splits))
    assert grids[1][0] == "decode_attention_merge_kernel"


@pytest.mark.slow
def test_decode_split_grid_depends_on_table_width_only(monkeypatch):
    """A CUDA graph replays a recorded launch with each step's context lengths: with the same
    shapes (a table 9 pages wide), other lengths give the same grids and still the right results."""
    force_splits(monkeypatch, 2)
    grids = record_grids(monkeypatch)
    for context_lens in ([120, 120], [1, 17], [33, 100], [128, 16]):
        check_decode(np.random.default_rng(7), [128, 128], 4, 1, 32, context_lens=context_lens)
    assert {grid for _, grid in grids[::2]} == {(1, 2, 5)}  # ceil(9 / 2) = 5 splits of 2 pages


@pytest.mark.slow
def test_decode_split_is_bit_identical_in_a_wider_table(monkeypatch):
    """The engine's CUDA graphs run a step with its block table padded to a power of two: the extra
    (empty) splits add exact zeros, so the output is the same bits as in a table just wide enough."""
    force_splits(monkeypatch, 2, min_width=4)
    grids = record_grids(monkeypatch)
    narrow = check_decode(np.random.default_rng(8), [70, 33], 4, 1, 64)  # 5 pages + 1 column: 3 splits
    wide = check_decode(np.random.default_rng(8), [70, 33], 4, 1, 64, extra_columns=10)  # 8 splits
    assert [grid for _, grid in grids[::2]] == [(1, 2, 3), (1, 2, 8)]
    np.testing.assert_array_equal(narrow, wide)


def test_pick_splits_rule():
    """Only tables of SPLIT_MIN_WIDTH pages or more, in small grids, are split: into 16-page ranges,
    at most MAX_SPLITS; every split starts inside the table."""
    pick = decode_attention_module.pick_splits
    assert [pick(8, width) for width in (8, 16, 32, 63, 64, 256, 1024, 2048, 8192)] == [1, 1, 1, 1, 4, 16, 64, 64, 64]
    assert pick(decode_attention_module.SMALL_GRID_BLOCKS, 1024) == 1
    for width in [*range(60, 200), 1000, 1024, 4096, 8191]:
        splits = pick(8, width)
        pages_per_split = -(-width // splits)  # as the kernel computes it
        assert (splits - 1) * pages_per_split < width <= splits * pages_per_split
        assert splits <= decode_attention_module.MAX_SPLITS


@pytest.mark.gpu
@pytest.mark.parametrize("seq_lens", [[3000], [1000, 3000], [140]])
def test_decode_split_gpu(monkeypatch, seq_lens):
    """Llama 3.2 1B heads (H 32, KVH 8, HD 64) at batch 1 and 2: few blocks, so a long context is
    split (a table of 64 pages or more), a short one is not."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    grids = record_grids(monkeypatch)
    try:
        check_decode(rng, seq_lens, 4, 8, 64)
    except AssertionError as e:
        raise AssertionError(f"seed {seed}: {e}") from None
    width = -(-max(seq_lens) // PAGE_SIZE) + 1
    assert (grids[0][1][2] > 1 if len(grids[0][1]) == 3 else False) == (width >= decode_attention_module.SPLIT_MIN_WIDTH)


# ---- prefill -------------------------------------------------------------------------------------


def check_prefill(rng, seqs, group, num_kv_heads, head_dim, scale=None):
    """seqs: (start_pos, num_new) per sequence; the first start_pos tokens are a cached prefix."""
    num_heads = group * num_kv_heads
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    cache = PagedCache(rng, [start + n for start, n in seqs], num_kv_heads, head_dim)
    cu_seqlens = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    start_pos = np.array([start for start, _ in seqs], np.int32)
    q = rng.standard_normal((cu_seqlens[-1], num_heads, head_dim)).astype(np.float32)
    out = nan_device(q.shape)
    k_cache, v_cache, block_tables = cache.device()
    prefill_attention(cuda.to_device(q), k_cache, v_cache, block_tables, cuda.to_device(cu_seqlens),
                      cuda.to_device(start_pos), scale, out)
    got = out.copy_to_host()
    for s, (start, n) in enumerate(seqs):
        rows = slice(cu_seqlens[s], cu_seqlens[s + 1])
        want = reference_attention(q[rows], cache.k[s], cache.v[s], start + np.arange(n), scale)
        np.testing.assert_allclose(got[rows], want, rtol=RTOL, atol=ATOL, err_msg=f"sequence {s}: {start} cached + {n} new")




@pytest.mark.parametrize(
    "group, num_kv_heads, head_dim",
    [(1, 2, 16), (3, 1, 16), (8, 1, 8)]
    + [pytest.param(4, 1, 64, marks=pytest.mark.slow), pytest.param(2, 1, 128, marks=pytest.mark.slow)],  # HD 64, 128
)
def test_prefill(group, num_kv_heads, head_dim):
    check_prefill(np.random.default_rng(3), PREFILL_SEQS, group, num_kv_heads, head_dim)


def test_prefill_scale():
    check_prefill(np.random.default_rng(4), [(3, 20)], 2, 1, 32, scale=0.3)


@pytest.mark.gpu
def test_prefill_gpu():
    """Llama 3.2 1B heads; 8 prompts, some after a cached prefix, up to 1024 tokens in all."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    seqs = [(0, 512), (0, 1), (100, 412), (511, 1), (0, 333), (64, 64), (17, 300), (0, 1024)]
    try:
        check_prefill(rng, seqs, 4, 8, 64)
    except AssertionError as e:
        raise AssertionError(f"seed {seed}: {e}") from None


# ---- the cache write and the two attention kernels together, as a model step runs them -----------


def cache_write(k, v, slots, k_cache, v_cache):
    """Store host k, v (T, KVH, HD) f32 at `slots` through the rope kernel: at position 0 its rotation
    is the identity, so the cache gets bf16(k) and bf16(v) (tests/test_rope.py checks it bit-exactly)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    qkv = np.concatenate([np.zeros_like(k), k, v], axis=1)  # one query head per kv head, unused
    positions = cuda.to_device(np.zeros(num_tokens, np.int32))
    inv_freq = cuda.to_device(np.ones(head_dim // 2, np.float32))
    q = cuda.device_array((num_tokens, num_kv_heads, head_dim), np.float32)
    rope_and_cache_write(cuda.to_device(qkv), positions, inv_freq, cuda.to_device(slots), q, k_cache, v_cache)


def test_write_prefill_then_decode():
    """Store the prompt's K/V (the rope kernel at position 0, where it only stores), prefill it,
    store one more token, decode it; against the reference on the same bf16-rounded K/V."""
    rng = np.random.default_rng(5)
    group, num_kv_heads, head_dim, prompt = 2, 2, 16, 19
    num_heads = group * num_kv_heads
    scale = 1.0 / np.sqrt(head_dim)
    num_pages = 6
    page_ids = np.array([4, 1, 5], np.int32)  # the sequence's pages, out of order
    block_tables = cuda.to_device(page_ids.reshape(1, -1).copy())
    k = rng.standard_normal((prompt + 1, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((prompt + 1, num_kv_heads, head_dim)).astype(np.float32)
    q = rng.standard_normal((prompt + 1, num_heads, head_dim)).astype(np.float32)
    pos = np.arange(prompt + 1)
    slots = (page_ids[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE).astype(np.int32)
    nan_pool = to_bf16(np.full((num_pages, PAGE_SIZE, num_kv_heads, head_dim), np.nan, np.float32))
    k_cache, v_cache = upload_bf16(nan_pool), upload_bf16(nan_pool)

    cache_write(k[:prompt], v[:prompt], slots[:prompt], k_cache, v_cache)
    out = nan_device((prompt, num_heads, head_dim))
    prefill_attention(cuda.to_device(q[:prompt]), k_cache, v_cache, block_tables,
                      cuda.to_device(np.array([0, prompt], np.int32)), cuda.to_device(np.zeros(1, np.int32)), scale, out)
    kb, vb = to_bf16(k).astype(np.float32), to_bf16(v).astype(np.float32)
    want = reference_attention(q[:prompt], kb[:prompt], vb[:prompt], pos[:prompt], scale)
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=RTOL, atol=ATOL)

    cache_write(k[prompt:], v[prompt:], slots[prompt:], k_cache, v_cache)
    out = nan_device((1, num_heads, head_dim))
    decode_attention(cuda.to_device(q[prompt:]), k_cache, v_cache, block_tables,
                     cuda.to_device(np.array([prompt + 1], np.int32)), scale, out)
    want = reference_attention(q[prompt:], kb, vb, [prompt], scale)
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=RTOL, atol=ATOL)


# ---- launcher checks -----------------------------------------------------------------------------


def test_launchers_reject_bad_inputs():
    q = cuda.to_device(np.zeros((1, 4, 48), np.float32))
    pool = upload_bf16(np.zeros((2, PAGE_SIZE, 2, 48), np.float32))
    tables = cuda.to_device(np.ones((1, 1), np.int32))
    lens = cuda.to_device(np.ones(1, np.int32))
    with pytest.raises(KernelError, match="head_dim 48"):
        decode_attention(q, pool, pool, tables, lens, 1.0, cuda.to_device(np.zeros((1, 4, 48), np.float32)))
    q = cuda.to_device(np.zeros((1, 3, 16), np.float32))
    pool = upload_bf16(np.zeros((2, PAGE_SIZE, 2, 16), np.float32))
    with pytest.raises(KernelError, match="not a multiple"):
        decode_attention(q, pool, pool, tables, lens, 1.0, cuda.to_device(np.zeros((1, 3, 16), np.float32)))
    q = cuda.to_device(np.zeros((1, 4, 16), np.float32))
    with pytest.raises(KernelError, match="block_tables"):
        prefill_attention(q, pool, pool, cuda.to_device(np.ones((1, 1), np.int64)), cuda.to_device(np.array([0, 1], np.int32)),
                          cuda.to_device(np.zeros(1, np.int32)), 1.0, cuda.to_device(np.zeros((1, 4, 16), np.float32)))
