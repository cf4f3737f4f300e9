"""The bandwidth decode attention kernel (``decode_attention_fast``) against the NumPy reference.

The same checks as the reference kernel's (``tests/test_attention.py``, whose ``check_decode`` builds
the cache: shuffled pages, NaN in every slot no sequence owns and in table entries past each
context, NaN-poisoned outputs and workspace), at small awkward shapes: context lengths 1/15/16/17/33/
100 around the 16-token page edges in one launch, GQA ratios 1/3/4/8, head dims 64 and 128 and the
small ones. Split launches need a GPU's multiprocessor count (the simulator reports one):
``pretend_sms`` makes the rule see an H200-sized GPU, and ``NUM_WARPS = 1`` makes ranges of one page.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from numba_vllm.kernels import decode_attention_fast as fast
from numba_vllm.kernels._launch import launch
from numba_vllm.model.config import PAGE_SIZE
from tests.test_attention import check_decode

pytestmark = pytest.mark.gpu_too  # `make test-gpu` runs these on the GPU as well

LENGTHS = [1, 15, 16, 17, 33, 100]  # around page edges, all in one launch; 100: a 7-page table


def check_fast(rng, seq_lens, group, num_kv_heads, head_dim, **kwargs):
    return check_decode(rng, seq_lens, group, num_kv_heads, head_dim, attention=fast.decode_attention_fast,
                        workspace_floats=fast.split_workspace_floats, **kwargs)  # fmt: skip


def pretend_sms(monkeypatch, sms=132, warps=None):
    """Let pick_split see `sms` multiprocessors (and blocks of `warps` warps), so small grids split."""
    monkeypatch.setattr(fast, "num_sms", lambda: sms)
    if warps is not None:
        monkeypatch.setattr(fast, "NUM_WARPS", warps)


def record_grids(monkeypatch):
    """The (kernel name, grid) of every launch decode_attention_fast makes from now on."""
    grids = []
    real_launch = fast.launch

    def launch(kernel, grid, *args):
        grids.append((kernel.py_func.__name__, grid))
        real_launch(kernel, grid, *args)

    monkeypatch.setattr(fast, "launch", launch)
    return grids


@pytest.mark.parametrize(
    "group, num_kv_heads, head_dim",
    [(4, 1, 64), (1, 2, 64), (3, 1, 64), (8, 1, 64), (2, 1, 128), (2, 2, 16), (2, 1, 8)],
)
def test_decode_fast(group, num_kv_heads, head_dim):
    check_fast(np.random.default_rng(11), LENGTHS, group, num_kv_heads, head_dim)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a warning in a simulated thread fails its launch
def test_decode_fast_masks_unwritten_slots_before_any_arithmetic():
    """inf in the slots past each context: the kernel must not compute with them (q . inf sums +inf
    and -inf to NaN), not even a score it then masks, and no exp of -inf - -inf."""
    check_fast(np.random.default_rng(12), [1, 17, 40], 2, 1, 16, unwritten=np.inf)


def test_decode_fast_several_steps_per_warp_and_scale():
    """150 tokens: each warp walks several pages (the L2 prefetch of the next one included); a scale
    other than 1/sqrt(HD); the running max raised as larger scores arrive (scores grow with the
    position here, so the lazy rescale runs more than once)."""
    rng = np.random.default_rng(13)
    check_fast(rng, [150, 3], 4, 1, 32, scale=0.3)
    check_fast(rng, [150], 2, 1, 32, scale=3.0)


@pytest.mark.parametrize(
    "group, num_kv_heads, head_dim, warps",
    [
        (4, 1, 64, 1),  # ranges of 1 page: 8 splits over the 8-column table
        pytest.param(1, 2, 64, 2, marks=pytest.mark.slow),  # 2 kv heads: each block's rows of the partials
        pytest.param(2, 1, 128, 1, marks=pytest.mark.slow),  # HD 128: a step is half a page
        pytest.param(2, 1, 8, 1, marks=pytest.mark.slow),  # HD 8: a step is two pages, its second past a range
    ],
)
def test_decode_fast_split(monkeypatch, group, num_kv_heads, head_dim, warps):
    pretend_sms(monkeypatch, warps=warps)
    grids = record_grids(monkeypatch)
    check_fast(np.random.default_rng(14), LENGTHS, group, num_kv_heads, head_dim)
    splits, _ = fast.pick_split(len(LENGTHS) * num_kv_heads, 8, fast.min_split_pages(head_dim))  # a table of 7 pages + 1 column
    assert splits > 1
    assert grids[0] == ("decode_attention_fast_kernel", (num_kv_heads, len(LENGTHS), splits))
    assert grids[1][0] == "decode_attention_fast_merge_kernel"


@pytest.mark.slow
def test_decode_fast_split_grid_depends_on_shapes_only(monkeypatch):
    """A CUDA graph replays a recorded launch with each step's context lengths: with the same shapes,
    other lengths give the same grids and still the right results."""
    pretend_sms(monkeypatch, warps=1)
    grids = record_grids(monkeypatch)
    for context_lens in ([120, 120], [1, 17], [33, 100], [128, 16]):
        check_fast(np.random.default_rng(15), [128, 128], 4, 1, 32, context_lens=context_lens)
    assert {grid for _, grid in grids[::2]} == {(1, 2, 9)}  # 8 pages + the padding column, a page a range


def test_decode_fast_split_is_bit_identical_in_a_padded_table(monkeypatch):
    """The engine's CUDA graphs run a step with its block table padded to the next power of two
    pages: the ranges stay the same, the extra (empty) ones add exact zeros in the merge."""
    pretend_sms(monkeypatch, warps=2)
    grids = record_grids(monkeypatch)
    narrow = check_fast(np.random.default_rng(16), [70, 33], 4, 1, 64)  # 5 pages + 1 column: 3 ranges of 2
    wide = check_fast(np.random.default_rng(16), [70, 33], 4, 1, 64, extra_columns=2)  # 8 columns: 4 ranges
    assert [grid for _, grid in grids[::2]] == [(1, 2, 3), (1, 2, 4)]
    np.testing.assert_array_equal(narrow, wide)


def test_merge_kernel_over_several_chunks_of_ranges():
    """The merge against float64 NumPy on made-up partial states: 2 sequences x 3 heads x HD 8 over
    37 ranges (three chunks of MERGE_CHUNK), with maxima that rise in later chunks (the running max
    moves and what was added is rescaled), ranges of very different weight, and empty ranges (m =
    -inf, zero sums) inside and at the end, as a padded table makes them."""
    rng = np.random.default_rng(31)
    batch, heads, head_dim, splits = 2, 3, 8, 2 * fast.MERGE_CHUNK + 5
    m = rng.uniform(-4.0, 4.0, (splits, batch, heads)) + np.arange(splits)[:, None, None] * 0.5  # log2 units
    sums = rng.uniform(0.5, 3.0, (splits, batch, heads))
    acc = rng.standard_normal((splits, batch, heads, head_dim)) * sums[..., None]
    empty = np.zeros(splits, bool)
    empty[[3, fast.MERGE_CHUNK + 1, splits - 2, splits - 1]] = True
    m[empty], sums[empty], acc[empty] = -np.inf, 0.0, 0.0
    partials = np.concatenate([acc, m[..., None], sums[..., None]], axis=3).astype(np.float32)  # (splits, B, H, HD + 2)
    out = cuda.to_device(np.full((batch, heads, head_dim), np.nan, np.float32))
    threads = fast.MERGE_THREADS
    launch(fast.decode_attention_fast_merge_kernel, (-(-out.size // threads),), threads,
           cuda.to_device(partials.reshape(splits * batch, heads, head_dim + 2)), out)  # fmt: skip
    m64, sums64, acc64 = (partials[..., head_dim].astype(np.float64), partials[..., head_dim + 1].astype(np.float64),
                          partials[..., :head_dim].astype(np.float64))  # fmt: skip
    weights = np.exp2(m64 - m64.max(axis=0))  # (splits, B, H): 0 for the empty ranges
    want = (weights[..., None] * acc64).sum(axis=0) / (weights * sums64).sum(axis=0)[..., None]
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=2e-6, atol=1e-6)


def test_pick_split_rule(monkeypatch):
    """Llama 3.2 1B's heads (8 kv heads, HD 64) on an H200 (132 SMs): the splits the module docstring
    lists; a full grid is not split; ranges are powers of two pages, at most MAX_SPLITS of them and
    at most MAX_SPLIT_BLOCKS blocks; padding a table to the next power of two keeps the ranges."""
    pretend_sms(monkeypatch)
    def pick(blocks, width, head_dim):
        return fast.pick_split(blocks, width, fast.min_split_pages(head_dim))

    assert pick(8, 65, 64) == (17, 4)  # batch 1, 1,024 tokens (+ the engine's spare column)
    assert pick(8, 1024, 64) == (32, 32)  # batch 1, 16,384 tokens
    assert pick(4 * 8, 256, 64) == (16, 16)  # batch 4, 4,096 tokens
    assert pick(32 * 8, 256, 64) == (2, 128)  # batch 32, 4,096 tokens
    assert pick(64 * 8, 64, 64) == (1, 64)  # batch 64: the grid is nearly full; one range anyway
    assert pick(4 * 132, 1024, 64) == (1, 1024)
    for blocks in (1, 8, 24, 64, 200, 527):
        for width in [*range(1, 200, 7), 1000, 1024, 4097, 8192]:
            splits, pages = pick(blocks, width, 64)
            assert (splits - 1) * pages < width <= splits * pages  # every range starts inside the table
            assert splits == 1 or (splits <= fast.MAX_SPLITS and splits * blocks <= fast.MAX_SPLIT_BLOCKS)
            if splits > 1:
                assert pages & (pages - 1) == 0
                padded = 1 << (width - 1).bit_length()
                assert pick(blocks, padded, 64)[1] == pages


def test_launcher_rejects_bad_inputs():
    from numba import cuda

    from numba_vllm.kernels._launch import KernelError
    from numba_vllm.loading.bf16 import upload_bf16

    q = cuda.to_device(np.zeros((1, 4, 48), np.float32))
    pool = upload_bf16(np.zeros((2, PAGE_SIZE, 2, 48), np.float32))
    tables = cuda.to_device(np.ones((1, 1), np.int32))
    lens = cuda.to_device(np.ones(1, np.int32))
    with pytest.raises(KernelError, match="head_dim 48"):
        fast.decode_attention_fast(q, pool, pool, tables, lens, 1.0, cuda.to_device(np.zeros((1, 4, 48), np.float32)))
    q = cuda.to_device(np.zeros((1, 3, 16), np.float32))
    pool = upload_bf16(np.zeros((2, PAGE_SIZE, 2, 16), np.float32))
    with pytest.raises(KernelError, match="not a multiple"):
        fast.decode_attention_fast(q, pool, pool, tables, lens, 1.0, cuda.to_device(np.zeros((1, 3, 16), np.float32)))


@pytest.mark.gpu
@pytest.mark.parametrize("seq_lens", [[1024, 1, 16, 17] + [int(n) for n in np.random.default_rng(0).integers(1, 1025, 60)],
                                      [3000], [1000, 3000, 17], [16384], [140]])  # fmt: skip
def test_decode_fast_gpu(seq_lens):
    """Llama 3.2 1B heads (H 32, KVH 8, HD 64): 64 sequences (no split), batches of 1 to 3 split over
    the context, with fresh random inputs (the seed is in the failure message)."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    try:
        check_fast(np.random.default_rng(seed), seq_lens, 4, 8, 64)
    except AssertionError as e:
        raise AssertionError(f"seed {seed}: {e}") from None
