"""The tensor-core decode attention kernel (``decode_attention_tc``) against the NumPy reference.

The cache is ``test_attention``'s (shuffled pages, NaN in every slot no sequence owns and in table
entries past each context; NaN-poisoned outputs and workspace). Oracle: ``reference.attention`` in
float64 over the bf16-rounded q (the kernel rounds q to bf16 as it loads it) and the bf16 K/V; what
remains is P rounded to bf16 for the ``P V`` product, bounded per element as in
``test_prefill_attention_tc``: ``|out - ref| <= 1.1 * 2^-8 * attention(q, K, |V|) + 2e-6``.

Simulator shapes are small (every ``mma`` is a warp rendezvous): context lengths 1/15/16/17/33/100
around the page edges in one launch, GQA groups 1/3/4/8, head dims 64 and 128; splits pretend an
H200-sized GPU (``pretend_sms``) with one-warp blocks and one page a step, so ranges are one page.
The simulator reports one multiprocessor, so a grid of 3+ blocks counts as full there and runs the
one-page-a-step build (``FULL_GRID_*``) in blocks of 4, 2 or 1 warps (16 warp slots); smaller grids
run the two-page one. The same tests run on a GPU (``gpu_too``), where the launcher sizes its grids
by the GPU's multiprocessors: the tests of the full grids pin one (``one_sm``).
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from numba_vllm.kernels import decode_attention_fast as fast
from numba_vllm.kernels import decode_attention_tc as tc
from numba_vllm.loading.bf16 import BF16
from numba_vllm.model.config import PAGE_SIZE
from tests.helpers.attention import PagedCache, nan_device, reference_attention

pytestmark = pytest.mark.gpu_too  # `make test-gpu` runs these on the GPU as well

P_BOUND = 1.1 * 2.0**-8  # a bf16-rounded weight's relative error, plus fp32 slack
ATOL = 2e-6
LENGTHS = [1, 15, 16, 17, 33, 100]  # around page edges, all in one launch; 100: a 7-page table


def check_tc(rng, seq_lens, group, num_kv_heads, head_dim, scale=None, extra_columns=0, unwritten=np.nan):
    """Decode one query per sequence over a fresh paged cache with decode_attention_tc; assert the
    bound against the reference; return the output (B, H, HD) on the host. ``extra_columns`` < 0:
    the table loses that many columns (its padding column, when the contexts leave it empty)."""
    num_heads = group * num_kv_heads
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    cache = PagedCache(rng, seq_lens, num_kv_heads, head_dim, unwritten=unwritten)
    if extra_columns < 0:
        cache.block_tables = np.ascontiguousarray(cache.block_tables[:, :extra_columns])
    cache.block_tables = np.pad(cache.block_tables, ((0, 0), (0, max(extra_columns, 0))))
    past = np.arange(cache.block_tables.shape[1]) >= -(-np.array(seq_lens)[:, None] // PAGE_SIZE)
    cache.block_tables[past] = cache.num_pages  # names no page: a kernel that looks it up fails
    q = rng.standard_normal((len(seq_lens), num_heads, head_dim)).astype(np.float32)
    out = nan_device(q.shape)
    k_cache, v_cache, block_tables = cache.device()
    workspace = nan_device(fast.split_workspace_floats(num_heads, num_kv_heads, head_dim))
    lens = cuda.to_device(np.array(seq_lens, np.int32))
    tc.decode_attention_tc(cuda.to_device(q), k_cache, v_cache, block_tables, lens, scale, out, workspace)
    got = out.copy_to_host()
    q_bf16 = q.astype(BF16).astype(np.float32)
    for s, n in enumerate(seq_lens):
        want = reference_attention(q_bf16[s : s + 1], cache.k[s], cache.v[s], [n - 1], scale)
        bound = P_BOUND * reference_attention(q_bf16[s : s + 1], cache.k[s], np.abs(cache.v[s]), [n - 1], scale) + ATOL
        err = np.abs(got[s : s + 1] - want)
        assert not np.isnan(got[s]).any(), f"sequence {s} of {n} tokens: NaN in the output"
        worst = np.unravel_index(np.argmax(err / bound), err.shape)
        assert (err <= bound).all(), f"sequence {s} of {n} tokens: error {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"
    return got


def pretend_sms(monkeypatch, sms=132):
    """One-warp blocks taking a page a step, on a GPU of `sms` multiprocessors: small grids split
    into ranges of one page."""
    monkeypatch.setattr(fast, "num_sms", lambda: sms)
    monkeypatch.setattr(tc, "NUM_WARPS", 1)
    monkeypatch.setattr(tc, "PAGES_PER_STEP", 1)


def one_sm(monkeypatch):
    """Grids sized for a GPU of one multiprocessor, as the simulator reports (on a GPU too)."""
    monkeypatch.setattr(tc, "num_sms", lambda: 1)
    monkeypatch.setattr(fast, "num_sms", lambda: 1)


def record_grids(monkeypatch):
    """The (kernel name, grid) of every launch from now on (the split's go through decode_attention_fast)."""
    grids = []
    for module in (tc, fast):
        real_launch = module.launch

        def launch(kernel, grid, *args, real_launch=real_launch):
            grids.append((kernel.py_func.__name__, grid))
            real_launch(kernel, grid, *args)

        monkeypatch.setattr(module, "launch", launch)
    return grids


@pytest.mark.parametrize(
    "group, num_kv_heads, head_dim",
    [(4, 1, 64), (1, 2, 64), (3, 1, 64), (8, 1, 64), pytest.param(2, 1, 128, marks=pytest.mark.slow)],
)
def test_decode_tc(group, num_kv_heads, head_dim):
    check_tc(np.random.default_rng(21), LENGTHS, group, num_kv_heads, head_dim)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a warning in a simulated thread fails its launch
def test_decode_tc_masks_unwritten_slots_before_any_mma():
    """inf in the slots past each context: their K and V words must be zeroed before the mma (inf x 0
    in a padding row would be NaN)."""
    check_tc(np.random.default_rng(22), [1, 17, 40], 2, 1, 64, unwritten=np.inf)


def test_full_grids_take_a_page_a_step():
    """Full grids: a page a step at 128 registers, K/V streamed past L1 in four-warp blocks only,
    one-warp blocks as a block per sequence of a warp per kv head where the kv heads divide an SM's
    16 warp slots (8: yes; 3: no); other grids (four warps, two pages a step, 168 registers) stream
    at HD 64, not at HD 128."""
    for warps, stream in ((4, True), (2, False)):
        assert tc.launched_kernel(4, 64, 8, full_grid=True, num_warps=warps) is tc.decode_attention_tc_kernel_for(
            4, 64, 8, warps, False, tc.FULL_GRID_PAGES_PER_STEP, tc.FULL_GRID_MAX_REGISTERS, stream)
    assert tc.launched_kernel(4, 64, 8, full_grid=True, num_warps=1) is tc.decode_attention_tc_kernel_for(
        4, 64, 8, 8, False, tc.FULL_GRID_PAGES_PER_STEP, tc.FULL_GRID_MAX_REGISTERS, False, True)
    assert tc.launched_kernel(3, 64, 3, full_grid=True, num_warps=1) is tc.decode_attention_tc_kernel_for(
        3, 64, 3, 1, False, tc.FULL_GRID_PAGES_PER_STEP, tc.FULL_GRID_MAX_REGISTERS, False)
    for split in (False, True):
        assert tc.launched_kernel(4, 64, 8, split=split) is tc.decode_attention_tc_kernel_for(
            4, 64, 8, tc.NUM_WARPS, split, tc.PAGES_PER_STEP, tc.MAX_REGISTERS, True)
        assert tc.launched_kernel(4, 128, 8, split=split) is tc.decode_attention_tc_kernel_for(
            4, 128, 8, tc.NUM_WARPS, split, 1, None, False)


@pytest.mark.parametrize("blocks, warps", [(528, 4), (529, 2), (1056, 2), (1057, 1), (2112, 1), (5000, 1)])
def test_full_grids_take_the_most_warps_a_block_that_fit_one_wave(monkeypatch, blocks, warps):
    """132 SMs of 16 warps: 528 blocks of 4 warps fit at once, 1,056 of 2; past that one warp a block."""
    monkeypatch.setattr(tc, "num_sms", lambda: 132)
    assert tc.full_grid_warps(blocks) == warps


@pytest.mark.parametrize("num_seqs, warps", [(4, 4), (6, 2), (12, 1)])
def test_full_grids_of_every_block_size(monkeypatch, num_seqs, warps):
    """One SM: 3-4 blocks run 4 warps each, 5-8 two, more one; every sequence's result within the
    bound, whichever warps merge it (lengths around the page edges, repeated)."""
    one_sm(monkeypatch)
    monkeypatch.setattr(tc, "FULL_GRID_HEAD_WARPS", False)  # one-warp blocks of one kv head: below
    grids = record_grids(monkeypatch)
    blocks = []
    real = tc.decode_attention_tc_kernel_for
    monkeypatch.setattr(tc, "decode_attention_tc_kernel_for", lambda *a: blocks.append(a[3]) or real(*a))
    lengths = (LENGTHS * 2)[:num_seqs]
    check_tc(np.random.default_rng(26), lengths, 4, 1, 64)
    assert grids == [("decode_attention_tc_kernel", (1, num_seqs))]
    assert blocks == [warps]


@pytest.mark.parametrize("num_kv_heads, head_warps", [(2, True), (4, True), (3, False)])
def test_one_warp_full_grids_run_a_block_per_sequence_of_a_warp_per_kv_head(monkeypatch, num_kv_heads, head_warps):
    """A full grid past two warps a block (one SM: more than 8 blocks) runs a block per sequence whose
    warp w takes kv head w's pages and writes its heads' output straight from its registers, where
    the kv heads divide the SM's 16 warp slots; else a block per (kv head, sequence) of one warp.
    Every head of every sequence within the bound (lengths around the page edges)."""
    one_sm(monkeypatch)
    grids = record_grids(monkeypatch)
    lengths = (LENGTHS * 2)[:12]
    check_tc(np.random.default_rng(27), lengths, 2, num_kv_heads, 64)
    assert grids == [("decode_attention_tc_kernel", (12,) if head_warps else (num_kv_heads, 12))]


def test_head_warp_blocks_read_page_zero_before_the_context_length():
    """A block per sequence requests page 0's rows before the context length arrives, with page 1's
    table entry clamped to the table: contexts of one page in a table of one column (the simulator
    raises on an index past it), and contexts of 1 .. 3 pages in a table of 3."""
    check_tc(np.random.default_rng(28), [1, 16, 5, 15, 2, 9, 16, 1, 3, 11, 7, 14], 2, 2, 64, extra_columns=-1)
    check_tc(np.random.default_rng(29), [1, 17, 33, 48, 16, 32, 2, 40, 47, 20, 1, 3], 2, 2, 64, extra_columns=-1)


def test_decode_tc_several_steps_per_warp_and_scale(monkeypatch):
    """200 tokens: each warp walks several two-page steps (the last one past the context), the next
    step's loads in flight while it computes; scales other than 1/sqrt(HD), one large enough that
    the running max is raised more than once. (The simulator's one SM would split this small grid
    into ranges of a step per warp: one block per SM counts as full here.)"""
    monkeypatch.setattr(fast, "BLOCKS_PER_SM", 1)
    rng = np.random.default_rng(23)
    check_tc(rng, [200, 3], 4, 1, 64, scale=0.3)
    check_tc(rng, [200], 2, 1, 64, scale=2.0)


def test_decode_tc_split_and_bit_identical_in_a_padded_table(monkeypatch):
    """Ranges of one page over a 7-page table (+ the padding column): 8 blocks per (kv head,
    sequence), then the merge; a table padded to the next power of two (16 columns) gives the same
    bits (the extra ranges are empty)."""
    pretend_sms(monkeypatch)
    grids = record_grids(monkeypatch)
    narrow = check_tc(np.random.default_rng(24), LENGTHS, 4, 1, 64)
    wide = check_tc(np.random.default_rng(24), LENGTHS, 4, 1, 64, extra_columns=8)
    merge = ("decode_attention_fast_merge_kernel", (len(LENGTHS) * 4 * 64 // fast.MERGE_THREADS,))
    assert grids == [("decode_attention_tc_kernel", (1, len(LENGTHS), 8)), merge,
                     ("decode_attention_tc_kernel", (1, len(LENGTHS), 16)), merge]  # fmt: skip
    np.testing.assert_array_equal(narrow, wide)


def test_unsupported_heads_run_the_cuda_core_kernel(monkeypatch):
    grids = record_grids(monkeypatch)
    check_tc(np.random.default_rng(25), [1, 20], 2, 1, 32)
    assert grids[0][0] == "decode_attention_fast_kernel"


@pytest.mark.gpu
@pytest.mark.parametrize("seq_lens", [[1024, 1, 16, 17] + [int(n) for n in np.random.default_rng(0).integers(1, 1025, 60)],
                                      [3000], [1000, 3000, 17], [16384], [140],
                                      [int(n) for n in np.random.default_rng(1).integers(1, 600, 300)]])  # fmt: skip
def test_decode_tc_gpu(seq_lens):
    """Llama 3.2 1B heads (H 32, KVH 8, HD 64): 64 sequences (no split; a full grid of four-warp
    blocks), batches of 1 to 3 split over the context, 300 sequences (a full grid past two warps a
    block on 132 SMs: a block per sequence, a warp per kv head), with fresh random inputs (the seed
    is in the failure message)."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    try:
        check_tc(np.random.default_rng(seed), seq_lens, 4, 8, 64)
    except AssertionError as e:
        raise AssertionError(f"seed {seed}: {e}") from None
