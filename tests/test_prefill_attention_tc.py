"""prefill_attention_tc (tensor-core prefill attention) against the NumPy reference, and its PTX.

The cases reuse ``test_attention``'s paged cache: shuffled page ids, NaN in every cache slot no
sequence owns (the null page, spare pages, the tail of each last page) and NaN-poisoned outputs, so
reading a token past the context, or leaving an output unwritten, fails.

Oracle: ``reference.attention`` in float64 over the bf16-rounded q (the kernel rounds q to bf16 as
it loads it; K and V are bf16 already). What remains is P, rounded to bf16 for the ``P V`` product
while the row sums add it unrounded: each weight w_j of the output ``sum_j w_j v_j`` is off by a
relative 2^-8 at most (bf16 keeps 8 significant bits), so ``|out - ref| <= 2^-8 * sum_j w_j |v_j|``,
which is ``attention(q, K, |V|)``; ``P_BOUND`` (tests/helpers/attention.py) adds 10% for the fp32
sums and ``exp2.approx``, and ``PREFILL_ATOL`` covers outputs near zero. The bound is per element: a
key masked wrongly shifts an output by its whole weight, far more than 2^-8 of it.

Simulator cases are tiny (every ``mma``, ``ldmatrix`` and shuffle is a warp rendezvous; a 4-warp
block per key tile costs ~0.1 s): new-token counts 1/15/16/17/33 around the 16-token page edges,
chunks after a cached prefix, GQA groups 1/3/4/8, head dims 64 and 128 (and 16 and 32, the tiny
models'), every tiling (warp tile, key tile, Q in registers or shared memory); sequences longer than
a block's rows (several row tiles, warps whose rows are all padding) are ``slow``. A ``gpu`` test runs
Llama 3.2 1B's heads on ragged prompts and chunks after a prefix. The PTX tests compile the kernel
registry's builds and the other tilings for sm_90: no FP64, no local memory, the tensor-core
instructions present (tests/test_kernel_report.py assembles the registry's and checks for spills).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from numba import cuda, uint32

from numba_vllm.bench.kernel_report import PREFILL_TC_SIG, KernelVariant, select
from numba_vllm.kernels._launch import KernelError
from numba_vllm.kernels.jit import kernel
from numba_vllm.kernels.mma import ldmatrix_x4_trans
from numba_vllm.kernels.prefill_attention_tc import prefill_attention_tc
from numba_vllm.kernels.vector_load import SHARED_ALIGN
from numba_vllm.loading.bf16 import upload_bf16
from numba_vllm.model.config import PAGE_SIZE
from tests.helpers import ptx as ptx_check
from tests.helpers.attention import EDGE_SEQS, PREFILL_SEQS, check_prefill

pytestmark = pytest.mark.gpu_too  # `make test-gpu` runs these on the GPU as well

check_prefill_tc = functools.partial(check_prefill, prefill_attention_tc)


# ---- the transposing ldmatrix, one warp ----------------------------------------------------------


@kernel
def _ldmatrix_trans_probe_kernel(src, regs):
    # src (16, 8) uint32: a 16 x 16 bf16 block B[k, n], two n per word; regs (32, 4) uint32
    tile = cuda.shared.array((16, 8), uint32, SHARED_ALIGN)
    lane = cuda.threadIdx.x
    for i in range(4):
        tile[lane // 2, (lane % 2) * 4 + i] = src[lane // 2, (lane % 2) * 4 + i]
    cuda.syncthreads()  # the tile is in shared memory
    # B-operand addressing of P V: lane points at k row (lane & 7) + 8 ((lane >> 3) & 1), n chunk lane >> 4
    r0, r1, r2, r3 = ldmatrix_x4_trans(tile, ((lane & 7) + (((lane >> 3) & 1) << 3), (lane >> 4) * 4))
    regs[lane, 0] = r0
    regs[lane, 1] = r1
    regs[lane, 2] = r2
    regs[lane, 3] = r3


def test_ldmatrix_trans_gives_the_b_fragment_layout():
    """Registers (0, 1) are b0, b1 of n tile 0 and (2, 3) of n tile 1: b0 = B[2t, n], B[2t + 1, n]
    (low, high half), b1 the same 8 rows further, with n = g (+ 8 for tile 1)."""
    b = np.arange(256, dtype=np.uint32).reshape(16, 16)  # B[k, n] = 16 k + n: distinct 16-bit values
    src = b[:, 0::2] | (b[:, 1::2] << np.uint32(16))  # (16, 8) words: n = 2w low, 2w + 1 high
    regs = cuda.to_device(np.zeros((32, 4), np.uint32))
    _ldmatrix_trans_probe_kernel[1, 32](cuda.to_device(src), regs)
    got = regs.copy_to_host()
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    for r, (k0, n0) in enumerate([(0, 0), (8, 0), (0, 8), (8, 8)]):
        want = b[k0 + 2 * t, n0 + g] | (b[k0 + 2 * t + 1, n0 + g] << np.uint32(16))
        np.testing.assert_array_equal(got[:, r], want, err_msg=f"register {r}")


# ---- the kernel against the reference ------------------------------------------------------------


@pytest.mark.parametrize(
    "group, num_kv_heads, head_dim, seqs",
    [
        pytest.param(1, 2, 64, EDGE_SEQS, marks=pytest.mark.slow),
        pytest.param(3, 1, 64, PREFILL_SEQS, marks=pytest.mark.slow),
        pytest.param(4, 1, 64, PREFILL_SEQS, marks=pytest.mark.slow),
        (8, 1, 128, [(0, 17), (20, 13)]),
        (2, 1, 16, PREFILL_SEQS),
        (2, 1, 32, [(0, 33), (16, 16)]),
    ],
    ids=["g1-hd64-edges", "g3-hd64-prefix", "g4-hd64-prefix", "g8-hd128", "g2-hd16", "g2-hd32"],
)
def test_prefill_tc(group, num_kv_heads, head_dim, seqs):
    check_prefill_tc(np.random.default_rng(3), seqs, group, num_kv_heads, head_dim)


@pytest.mark.parametrize("tiling", [(1, 64, False), (2, 32, False), (1, 32, False), (2, 64, True), (2, 32, True)])
def test_prefill_tc_tilings(tiling):
    """Other tilings (warp_m_tiles, block_keys, q_shared), GQA 4 at head dim 64 after cached prefixes."""
    check_prefill_tc(np.random.default_rng(5), [(15, 2), (5, 28), (0, 17)], 4, 1, 64, tiling=tiling)


def test_prefill_tc_scale():
    check_prefill_tc(np.random.default_rng(4), [(3, 20)], 2, 1, 64, scale=0.3)


# Contexts of a few 64-key tiles: tiles before a warp's first position (no mask), the diagonal tile
# where some of a warp's rows see every key and others are masked (new tokens from 57 and from 121:
# positions 57..64 share warp 0), tiles past the context's end.
MULTI_TILE_SEQS = [(57, 12), (121, 9)]


@pytest.mark.parametrize(
    "key_scale",
    [None, lambda pos: 4.0 ** (pos // 64), lambda pos: 2.0 ** (pos // 40), lambda pos: np.where(pos < 64, 1.0, 2.0**-6)],
    ids=["random", "max-jumps", "max-creeps", "max-first"],
)
def test_prefill_tc_key_tiles(key_scale):
    """Several key tiles per row. Scores are ~N(0, 1.44^2) in log2 units at scale 1/8, so a tile's max
    is ~3.5: keys x4 per 64-key tile push it up by ~10 > RESCALE_LOG2 (the running max moves, O is
    rescaled); keys x2 every 40 positions by less (the max stays, P grows past 1); keys shrunk past
    the first tile bring no larger max at all."""
    check_prefill_tc(np.random.default_rng(7), MULTI_TILE_SEQS, 4, 1, 64, key_scale=key_scale)


@pytest.mark.slow
@pytest.mark.parametrize(
    "group, head_dim, seqs, tiling",
    [
        (1, 64, [(0, 100), (60, 40)], (1, 64, False)),  # 2 row tiles; warps whose rows are all padding
        (4, 64, [(0, 100), (37, 63)], None),  # 400 rows: 4 row tiles of 128; a 100-token prefix
        (8, 128, [(0, 100)], None),  # key tiles of 32 at head dim 128
        (3, 64, [(0, 100), (90, 10), (0, 1)], (1, 32, True)),
    ],
    ids=["g1-hd64-100", "g4-hd64-100", "g8-hd128-100", "g3-hd64-m1k32q"],
)
def test_prefill_tc_longer(group, head_dim, seqs, tiling):
    check_prefill_tc(np.random.default_rng(6), seqs, group, 1, head_dim, tiling=tiling)


@pytest.mark.gpu
def test_prefill_tc_gpu():
    """Llama 3.2 1B heads (H 32, KVH 8, HD 64): ragged prompts up to 512 tokens, chunks after a
    cached prefix of up to 1000 tokens, single tokens, in the default and two other tilings (the NumPy
    reference is the slow part; benchmarks/attn_tc_gpu.py checks 16384-token prompts against torch)."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    seqs = [(0, 512), (0, 1), (100, 300), (1000, 200), (511, 1), (0, 333), (17, 100)]
    for tiling in (None, (2, 32, False), (2, 64, True)):
        try:
            check_prefill_tc(np.random.default_rng(seed), seqs, 4, 8, 64, tiling=tiling)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}, tiling {tiling}: {e}") from None


# ---- launcher checks -----------------------------------------------------------------------------


def test_launcher_rejects_what_it_cannot_run():
    pool = upload_bf16(np.zeros((2, PAGE_SIZE, 1, 48), np.float32))
    tables = cuda.to_device(np.ones((1, 1), np.int32))
    cu_seqlens = cuda.to_device(np.array([0, 1], np.int32))
    start_pos = cuda.to_device(np.zeros(1, np.int32))
    q = cuda.to_device(np.zeros((1, 2, 48), np.float32))
    with pytest.raises(KernelError, match="prefill_attention_tc: head_dim 48"):
        prefill_attention_tc(q, pool, pool, tables, cu_seqlens, start_pos, 1.0, cuda.to_device(np.zeros((1, 2, 48), np.float32)))
    pool = upload_bf16(np.zeros((2, PAGE_SIZE, 1, 16), np.float32))
    q = cuda.to_device(np.zeros((1, 17, 16), np.float32))
    with pytest.raises(KernelError, match="17 query heads per kv head"):
        prefill_attention_tc(q, pool, pool, tables, cu_seqlens, start_pos, 1.0, cuda.to_device(np.zeros((1, 17, 16), np.float32)))
    with pytest.raises(KernelError, match="cu_seqlens"):
        prefill_attention_tc(q, pool, pool, tables, cuda.to_device(np.array([0, 1], np.int64)), start_pos, 1.0,
                             cuda.to_device(np.zeros((1, 17, 16), np.float32)))


# ---- PTX -----------------------------------------------------------------------------------------

# The registry's builds (the launcher's default tiling per head dim; tests/test_kernel_report.py
# checks they do not spill) and the other tilings the launcher accepts, as registry-style variants.
OTHER_TILINGS = [(4, 64, 2, 32, False), (4, 64, 1, 64, False), (4, 64, 2, 32, True), (8, 128, 1, 32, True)]
VARIANTS = select(("prefill_attention_tc",)) + [
    KernelVariant("prefill_attention_tc", "g{} hd{} tiling {} {} {}".format(*c),
                  "prefill_attention_tc:prefill_attention_tc_kernel_for({}, {}, {}, {}, {}, 8)".format(*c), PREFILL_TC_SIG,
                  "THREADS")
    for c in OTHER_TILINGS
]  # fmt: skip


@pytest.fixture(scope="module")
def ptx():
    return ptx_check.compile_ptx(VARIANTS)


@pytest.mark.slow  # compiles each variant (seconds each)
@pytest.mark.parametrize("variant", VARIANTS, ids=[v.key for v in VARIANTS])
def test_kernel_compiles_clean(ptx, variant):
    result = ptx[variant.key]
    assert "error" not in result, result.get("error")
    text = result["ptx"]
    assert ptx_check.ptx_problems(text, hot=True) == []
    for instruction in ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "cp.async.cg.shared.global", "ex2.approx"):
        assert instruction in text, f"{variant.key}: no {instruction}"
