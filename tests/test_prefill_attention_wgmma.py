"""prefill_attention_wgmma (Hopper wgmma prefill attention) against the NumPy reference, and its PTX.

The cases and the oracle are ``test_prefill_attention_tc``'s (``tests/helpers/attention.py``:
``check_prefill``): the paged cache with shuffled page ids and NaN in every slot no sequence owns (the
null page, spare pages, the tail of each last page: a stale V slot left in a stage poisons the output,
a key past the row left unmasked shifts it by its weight), NaN-poisoned outputs, the float64 reference
over the bf16-rounded q within the bound of a bf16-rounded P.

In the simulator every wgmma is a 128-thread rendezvous and the TMA copies a page at once; the cases
stay small: new-token counts around the page edges, chunks after a cached prefix, GQA groups 1/3/4/8,
head dims 64 and 128, key tiles of 16-128 keys with 2-3 stages (tiles that wrap the ring), one or two
consumer warpgroups (a warpgroup whose rows are all padding, warpgroups that skip the last tile).
The wgmma forms the kernel adds (A from registers, B MN-major) are probed alone in
``test_gemm_wgmma.py``. Without a GPU the registry's builds are assembled for sm_90a: no spills, no
local memory, no serialised wgmma, consumers raising their registers only by what the producer
warpgroup frees. The ``gpu`` test runs Llama 3.2 1B's heads on ragged prompts.
"""

from __future__ import annotations

import functools
import gc
import re
import subprocess
import weakref

import numpy as np
import pytest
from numba import cuda

from numba_vllm import LLM
from numba_vllm.bench.kernel_report import ReportError, find_ptxas, select
from numba_vllm.kernels._launch import KernelError
from numba_vllm.kernels.prefill_attention_wgmma import (
    LONG_CONTEXT,
    LONG_CONTEXT_TILINGS,
    OVERLAP_TILING,
    OVERLAP_WIDE_TILING,
    PERSISTENT_TILING,
    PINGPONG_TILING,
    SHORT_CONTEXT_TILINGS,
    Tiling,
    cache_operands,
    default_tiling,
    prefill_attention_wgmma,
)
from numba_vllm.kernels.wgmma import WARPGROUP_THREADS
from numba_vllm.loading.bf16 import upload_bf16
from numba_vllm.model import llama
from numba_vllm.model.config import PAGE_SIZE, ModelConfig
from numba_vllm.sim.warp import simulator_enabled
from tests.helpers import ptx as ptx_check
from tests.helpers.attention import EDGE_SEQS, PREFILL_SEQS, check_prefill
from tests.helpers.tiny_llama import random_weights, tiny_checkpoint, tiny_config_dict

pytestmark = pytest.mark.gpu_too  # `make test-gpu` runs these on the GPU as well

check_prefill_wgmma = functools.partial(check_prefill, prefill_attention_wgmma)


@pytest.mark.parametrize(
    "group, num_kv_heads, head_dim, seqs",
    [
        pytest.param(1, 2, 64, EDGE_SEQS, marks=pytest.mark.slow),
        pytest.param(3, 1, 64, PREFILL_SEQS, marks=pytest.mark.slow),
        pytest.param(4, 1, 64, PREFILL_SEQS, marks=pytest.mark.slow),
        (8, 1, 128, [(0, 17), (20, 13)]),
    ],
    ids=["g1-hd64-edges", "g3-hd64-prefix", "g4-hd64-prefix", "g8-hd128"],
)
def test_prefill_wgmma(group, num_kv_heads, head_dim, seqs):
    check_prefill_wgmma(np.random.default_rng(3), seqs, group, num_kv_heads, head_dim)


OTHER_TILINGS = [Tiling(1, 16, 2), Tiling(1, 32, 3), Tiling(2, 32, 2), Tiling(2, 64, 3), Tiling(2, 32, 2, overlap=True),
                 Tiling(1, 16, 3, overlap=True), Tiling(2, 32, 2, overlap=True, producer_registers=24),
                 Tiling(2, 32, 3, overlap=True, pingpong=True), Tiling(2, 16, 2, persistent=True),
                 Tiling(2, 32, 3, overlap=True, pingpong=True, persistent=True, producer_registers=24)]  # fmt: skip


@pytest.mark.parametrize(
    "tiling",
    [pytest.param(t, marks=pytest.mark.slow) if t.consumers == 2 else t for t in OTHER_TILINGS],  # two warpgroups: slow
    ids=["c1k16", "c1k32s3", "c2k32", "c2k64s3", "c2k32-overlap", "c1k16s3-overlap", "c2k32-overlap-p24",
         "c2k32s3-pingpong", "c2k16-persistent", "c2k32s3-pingpong-persistent-p24"],
)
def test_prefill_wgmma_tilings(tiling):
    """Other tilings, GQA 4 at head dim 64 after cached prefixes: several key tiles a block, the ring of
    stages reused, one consumer warpgroup a block, the softmax overlapped with the previous P V (a stage
    held one tile longer; in the simulator every wgmma completes at once, so this checks the order of
    the steps, not the waits), a producer warpgroup (setmaxnreg: a no-op in the simulator), the two
    warpgroups taking turns to issue (ping-pong: the simulator counts bar.sync and bar.arrive as the
    hardware does, so unmatched turns hang it), a persistent grid (one block in the simulator: every
    work item of every sequence and kv head in turn, the stage ring running on across them)."""
    check_prefill_wgmma(np.random.default_rng(5), [(15, 2), (5, 28), (0, 17), (57, 12)], 4, 1, 64, tiling=tiling)


def test_prefill_wgmma_scale():
    check_prefill_wgmma(np.random.default_rng(4), [(3, 20)], 2, 1, 64, scale=0.3)


MAX_JUMPS = lambda pos: 4.0 ** (pos // 32)  # noqa: E731


@pytest.mark.parametrize(
    "key_scale, overlap",
    [(MAX_JUMPS, False), (lambda pos: 2.0 ** (pos // 20), False), (lambda pos: np.where(pos < 32, 1.0, 2.0**-6), False),
     (MAX_JUMPS, True)],
    ids=["max-jumps", "max-creeps", "max-first", "max-jumps-overlap"],
)
def test_prefill_wgmma_key_tiles(key_scale, overlap):
    """Several 32-key tiles a row (``test_prefill_tc_key_tiles``' steering of the row max: it moves past
    RESCALE_LOG2 and O is rescaled, it creeps up and P grows past 1, or it never moves again); the
    overlapped order rescales O after the previous tile's P V instead of before this one's."""
    check_prefill_wgmma(np.random.default_rng(7), [(57, 12), (121, 9)], 4, 1, 64, tiling=Tiling(2, 32, 2, overlap=overlap),
                        key_scale=key_scale)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "group, head_dim, seqs, tiling",
    [
        (4, 64, [(0, 100), (37, 63)], None),  # 400 rows: 4 row tiles of 128; a 100-token prefix
        (1, 64, [(0, 100), (60, 40)], Tiling(2, 32, 2)),  # 100 rows: the second row tile's upper warpgroup is padding
        (8, 128, [(0, 100)], None),  # 64-key tiles of two 64-dim panels
    ],
    ids=["g4-hd64-100", "g1-hd64-100", "g8-hd128-100"],
)
def test_prefill_wgmma_longer(group, head_dim, seqs, tiling):
    check_prefill_wgmma(np.random.default_rng(6), seqs, group, 1, head_dim, tiling=tiling)


@pytest.mark.gpu
def test_prefill_wgmma_gpu():
    """Llama 3.2 1B heads (H 32, KVH 8, HD 64): ragged prompts up to 512 tokens, chunks after a
    cached prefix of up to 1000 tokens, single tokens, in the launcher's tilings and the others; and
    head dim 128 (benchmarks/attn_tc_gpu.py checks 16384-token prompts against torch)."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    seqs = [(0, 512), (0, 1), (100, 300), (1000, 200), (511, 1), (0, 333), (17, 100)]
    for head_dim, tiling in ((64, None), (64, LONG_CONTEXT_TILINGS[64]), (64, Tiling(2, 128, 2)), (64, OVERLAP_TILING),
                            (64, OVERLAP_WIDE_TILING), (64, PINGPONG_TILING), (64, PERSISTENT_TILING), (128, None)):
        try:
            check_prefill_wgmma(np.random.default_rng(seed), seqs, 4, 8, head_dim, tiling=tiling)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}, head dim {head_dim}, tiling {tiling}: {e}") from None


# ---- launcher checks -----------------------------------------------------------------------------


def test_launcher_rejects_head_dims_without_whole_panels():
    q = cuda.to_device(np.zeros((1, 2, 32), np.float32))
    cache = upload_bf16(np.zeros((2, PAGE_SIZE, 1, 32), np.float32))
    tables = cuda.to_device(np.ones((1, 1), np.int32))
    with pytest.raises(KernelError, match="head_dim 32 not supported"):
        prefill_attention_wgmma(q, cache, cache, tables, cuda.to_device(np.array([0, 1], np.int32)),
                                cuda.to_device(np.zeros(1, np.int32)), 1.0, cuda.device_array_like(q))  # fmt: skip


def test_an_engine_asking_for_it_on_an_unsupported_head_dim_is_refused_when_built(tmp_path):
    path = tiny_checkpoint(tmp_path, head_dim=16)
    with pytest.raises(KernelError, match="head_dim 16 not supported .*'tensor_cores'"):
        LLM(str(path), backend="sim" if simulator_enabled() else "cuda", prefill_attention="wgmma")


@pytest.mark.parametrize("on_hopper, head_dim, want", [(False, 64, "prefill_attention_tc"), (True, 64, "prefill_attention_wgmma"),
                                                        (True, 16, "prefill_attention_tc")])  # fmt: skip
def test_auto_runs_wgmma_on_hopper_where_the_head_dim_fits(monkeypatch, on_hopper, head_dim, want):
    """EngineConfig's default, "auto": this kernel on an H100/H200 (compute capability 9.0) for head dims of
    whole 64-dim panels, ``prefill_attention_tc`` elsewhere (no error: other GPUs and head dims just run it)."""
    monkeypatch.setattr(llama, "hopper", lambda: on_hopper)
    config = ModelConfig.from_dict(tiny_config_dict(head_dim=head_dim))
    model = llama.DeviceModel(config, random_weights(config, dtype="bf16"))
    assert model.prefill_attention.__name__ == want


def test_cache_operands_are_made_once_per_cache_and_do_not_keep_it():
    """The launcher's views and tensor maps of a layer's caches: the same objects on every call while the
    cache lives (no host work per launch), dropped with the cache (a dropped engine's memory is freed)."""
    k_cache, v_cache = (upload_bf16(np.zeros((3, PAGE_SIZE, 2, 64), np.float32)) for _ in range(2))
    first = cache_operands(k_cache, v_cache)
    assert all(a is b for a, b in zip(first, cache_operands(k_cache, v_cache), strict=True))
    assert first[0].shape == (3 * PAGE_SIZE, 2 * 64)
    other_v = upload_bf16(np.ones((3, PAGE_SIZE, 2, 64), np.float32))
    assert cache_operands(k_cache, other_v)[1] is not first[1]  # another V array: made afresh
    alive = weakref.ref(k_cache)
    del k_cache, first
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("tilings", [SHORT_CONTEXT_TILINGS, LONG_CONTEXT_TILINGS], ids=["short", "long"])
def test_launcher_tilings_fit_their_blocks_in_an_sms_shared_memory(tilings):
    for head_dim, tiling in tilings.items():
        assert tiling.blocks_per_sm * (tiling.shared_bytes(head_dim) + 1024) <= 228 * 1024  # (1 KB an SM keeps per block)
        assert tiling.block_keys % PAGE_SIZE == 0 and tiling.block_keys <= 256



@pytest.mark.parametrize(
    "tiling, at_launch, raised",
    [(OVERLAP_WIDE_TILING, 168, 240), (PERSISTENT_TILING, 168, 240),  # 384 threads, one block: 65536 / 384 = 170.7
     (Tiling(1, 64, 4, 3, producer_registers=24, persistent=True), 80, 136)],  # 256 threads, three blocks: 85.3
    ids=["two-consumers", "persistent", "one-consumer-three-blocks"],
)
def test_consumers_raise_themselves_only_to_what_the_producer_frees(tiling, at_launch, raised):
    """setmaxnreg.inc takes registers from the block's own pool and waits until they are there: the
    consumers may raise themselves by what the producer warpgroup's lowering to 24 frees, no more
    (one consumer in three blocks an SM: (80 - 24) x 128 registers freed, 56 more a consumer thread;
    asking for 144, a third of the SM's 64K less the producer's, its run never finished on the GPU)."""
    assert tiling.launch_registers == at_launch
    assert tiling.consumer_registers == raised
    assert WARPGROUP_THREADS * (tiling.consumers * raised + tiling.producer_registers) <= at_launch * tiling.threads


def test_the_launcher_takes_longer_key_tiles_from_the_long_context_length():
    assert default_tiling(64) == default_tiling(64, LONG_CONTEXT - 1) == SHORT_CONTEXT_TILINGS[64]
    assert default_tiling(64, LONG_CONTEXT) == default_tiling(64, 10**6) == LONG_CONTEXT_TILINGS[64]
    assert SHORT_CONTEXT_TILINGS[64].block_keys < LONG_CONTEXT_TILINGS[64].block_keys
    assert default_tiling(128, LONG_CONTEXT) == default_tiling(128) == SHORT_CONTEXT_TILINGS[128]


def test_a_wide_block_table_runs_the_long_context_tiling(monkeypatch):
    """The launcher bounds the context by the block table's width (the longest sequence's pages): a
    table as wide as LONG_CONTEXT keys runs LONG_CONTEXT_TILINGS, the same prompt in a narrow one the
    short tiling; both attend the same keys (the pages past the sequence are never read)."""
    built = []
    real = prefill_attention_wgmma.__globals__["prefill_attention_wgmma_kernel_for"]
    monkeypatch.setitem(prefill_attention_wgmma.__globals__, "prefill_attention_wgmma_kernel_for",
                        lambda group, head_dim, tiling: built.append(tiling) or real(group, head_dim, tiling))
    rng = np.random.default_rng(8)
    check_prefill_wgmma(rng, [(3, 20)], 4, 1, 64)
    check_prefill_wgmma(rng, [(3, 20)], 4, 1, 64, table_pages=LONG_CONTEXT // PAGE_SIZE)
    assert built == [SHORT_CONTEXT_TILINGS[64], LONG_CONTEXT_TILINGS[64]]


# ---- PTX, no GPU ----------------------------------------------------------------------------------

VARIANTS = select(("prefill_attention_wgmma",))  # the kernel registry's builds (numba_vllm/bench/kernel_report.py)


@pytest.fixture(scope="module")
def wgmma_ptx():
    return ptx_check.compile_ptx(VARIANTS)


@pytest.mark.slow  # compiles through NVVM
@pytest.mark.parametrize("variant", VARIANTS, ids=[v.key for v in VARIANTS])
def test_kernel_assembles_with_the_wgmma_kept_asynchronous(wgmma_ptx, tmp_path, variant):
    """The PTX: no FP64, no local memory, both wgmma forms and the TMA; ptxas for sm_90a: no spills,
    and no C7515 ("wgmma serialized": each wgmma would wait for the one before)."""
    result = wgmma_ptx[variant.key]
    assert "error" not in result, result.get("error")
    text = result["ptx"]
    assert ptx_check.ptx_problems(text, hot=True) == []
    head_dim = int(re.search(r"hd(\d+)", variant.variant).group(1))
    tiling = {"overlap": OVERLAP_TILING, "overlap wide": OVERLAP_WIDE_TILING, "pingpong": PINGPONG_TILING,
              "persistent": PERSISTENT_TILING, "long": LONG_CONTEXT_TILINGS[64]}.get(
        variant.variant.split("hd64 ")[-1])  # fmt: skip
    block_keys = (tiling or SHORT_CONTEXT_TILINGS[head_dim]).block_keys
    assert f"wgmma.mma_async.sync.aligned.m64n{block_keys}k16.f32.bf16.bf16" in text  # S = Q K^T
    pv = rf"wgmma\.mma_async\.sync\.aligned\.m64n{head_dim}k16\.f32\.bf16\.bf16 [^;]*\}}, \{{"  # P V: A in registers
    assert re.search(pv, text)
    assert "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes" in text
    assert ("bar.arrive" in text) == (tiling is PINGPONG_TILING)  # the turn handed over without waiting
    # 32-bit index arithmetic (index_math): 64-bit comparisons are left in the loops' bounds alone (numba's
    # int64 indices made 132 in the short-context build, 64 of them in the causal mask)
    assert len(re.findall(r"setp\.\w+\.s64", text)) <= 24
    try:
        ptxas = find_ptxas()
    except ReportError as e:
        pytest.skip(str(e))
    path = tmp_path / "kernel.ptx"
    path.write_text(re.sub(r"^\.target sm_90\b", ".target sm_90a", text, count=1, flags=re.M))
    proc = subprocess.run([ptxas.path, "--gpu-name=sm_90a", "-v", str(path), "-o", str(tmp_path / "kernel.cubin")],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "0 bytes spill stores" in proc.stderr, proc.stderr
    assert "C7515" not in proc.stderr and "serialized" not in proc.stderr, proc.stderr[-2000:]
    raised = re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32 (\d+);", text)
    if raised:  # the consumers raise themselves within the block's registers at launch (ptxas's count)
        lowered = re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32 (\d+);", text)
        at_launch = int(re.search(r"Used (\d+) registers", proc.stderr).group(1))
        assert at_launch == tiling.launch_registers, proc.stderr
        assert WARPGROUP_THREADS * (tiling.consumers * int(raised[0]) + int(lowered[0])) <= at_launch * tiling.threads
