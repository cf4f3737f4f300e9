"""Stopping one simulated CUDA thread at a line (numba_vllm.sim.stepping.break_in).

The callback mode (``on_hit``) captures a chosen thread's locals inside real kernels, which are
compared with NumPy: in RMSNorm the thread's partial sum of squares, each warp_sum shuffle round,
block_sum's shared ``scratch`` and the row's total; in paged decode attention a lane's partial dot
product before and after each shuffle round, its scores, and the block's shared-memory partial
softmaxes; in the wgmma prefill attention a thread's share of P at each key tile (the stepping
guide's example). The pdb mode is driven through a fake stdin. Lines are named by their text, so
the tests survive edits that move them. Simulator only: skipped when the tests run on a GPU.
"""

import contextlib
import io
import math

import numpy as np
import pytest
from numba import cuda

from numba_vllm.kernels import reductions
from numba_vllm.kernels._launch import KernelError
from numba_vllm.kernels.decode_attention import decode_attention, decode_attention_kernel_for
from numba_vllm.kernels.prefill_attention_wgmma import Tiling, prefill_attention_wgmma, prefill_attention_wgmma_kernel_for
from numba_vllm.kernels.rmsnorm import rms_norm, rms_norm_kernel
from numba_vllm.loading.bf16 import BF16, to_bf16, upload_bf16
from numba_vllm.model.config import PAGE_SIZE
from numba_vllm.sim import blocks as sim_blocks
from numba_vllm.sim import stepping
from numba_vllm.sim import warp as simulator
from numba_vllm.sim.stepping import break_in
from tests.helpers.attention import PagedCache

pytestmark = pytest.mark.skipif(not simulator.simulator_enabled(), reason="tests the CUDA simulator")

EPS = 1e-5


def _f(frame):
    """The simulator's fake ``cuda`` module the kernel sees: its indices answer for the calling thread."""
    return frame.f_globals["cuda"]


# ---- RMSNorm -------------------------------------------------------------------------------------

ROWS, DIM, THREADS = 2, 300, 96  # rms_norm runs 96 threads (3 warps) a row for D = 300, one tile


def _rms_inputs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    return x, to_bf16(1.0 + 0.1 * rng.standard_normal(DIM))


def _run_rms_norm(x, weight):
    out = cuda.to_device(np.full(x.shape, np.nan, np.float32))
    rms_norm(cuda.to_device(x), upload_bf16(weight), out, EPS)
    return out.copy_to_host()


def _thread_partials(row):
    """(THREADS,) each thread's float32 sum of squares, in the kernel's order: thread j % THREADS owns column j."""
    partials = np.zeros(THREADS, np.float32)
    for j, v in enumerate(row):
        partials[j % THREADS] += v * v
    return partials


def test_rms_norm_thread_sees_its_partial_the_shuffle_rounds_scratch_and_the_total():
    x, weight = _rms_inputs()
    block, thread = 1, 37  # lane 5 of warp 1
    partials = _thread_partials(x[block])
    seen = {"rounds": []}

    def before(frame):
        seen["sum_sq"] = frame.f_locals["sum_sq"]
        seen["index"] = (tuple(_f(frame).blockIdx), tuple(_f(frame).threadIdx))

    def shuffle_round(frame):  # warp_sum, before `offset //= 2`: x after the round of this offset
        seen["rounds"].append((frame.f_locals["offset"], frame.f_locals["x"]))

    def after_barrier(frame):  # block_sum, after the first syncthreads; copy: shared memory is reused
        seen["scratch"] = frame.f_locals["scratch"][: frame.f_locals["num_warps"]].copy()

    def after(frame):
        seen["total"] = frame.f_locals["total"]

    stops = [
        (rms_norm_kernel, "total = block_sum(sum_sq, scratch)", before),
        (reductions.warp_sum, "offset //= 2", shuffle_round),
        (reductions.block_sum, "partial = scratch[lane]", after_barrier),
        (rms_norm_kernel, "inv_rms = float32(1.0)", after),
    ]
    bps = []
    with contextlib.ExitStack() as stack:
        for fn, line, on_hit in stops:
            bps.append(stack.enter_context(break_in(fn, line, block=block, thread=thread, on_hit=on_hit)))
        out = _run_rms_norm(x, weight)

    assert [bp.hits for bp in bps] == [1, 10, 1, 1]  # warp_sum: 5 rounds, twice (warp, then across warps)
    assert seen["index"] == ((1, 0, 0), (37, 0, 0))
    assert seen["sum_sq"] == partials[thread]  # the same float32 additions
    lane, warp = thread % 32, thread // 32
    warp_sums = partials.reshape(3, 32).astype(np.float64).sum(axis=1)
    for k, (offset, value) in enumerate(seen["rounds"][:5]):
        assert offset == 16 >> k
        lanes = [j for j in range(32) if j % offset == lane % offset]  # the lanes folded in so far
        np.testing.assert_allclose(value, partials[32 * warp + np.array(lanes)].astype(np.float64).sum(), rtol=1e-6)
    np.testing.assert_allclose(seen["scratch"], warp_sums, rtol=1e-6)
    np.testing.assert_allclose(seen["rounds"][-1][1], warp_sums.sum(), rtol=1e-6)  # the second warp_sum's result
    np.testing.assert_allclose(seen["total"], (x[block].astype(np.float64) ** 2).sum(), rtol=1e-6)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + EPS) * weight.astype(np.float64)
    np.testing.assert_allclose(out, want, rtol=1e-5)  # the stops changed nothing


# ---- decode attention ----------------------------------------------------------------------------

SEQ_LENS, KV_HEADS, GROUP, HEAD_DIM = [40, 21], 2, 2, 32  # HD 32: 4 lanes a token, 8 tokens a load, steps of 16


def _paged_inputs():
    rng = np.random.default_rng(1)
    pages = [-(-n // PAGE_SIZE) for n in SEQ_LENS]
    num_pages = 1 + sum(pages) + 1
    page_ids = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    tables = np.zeros((len(SEQ_LENS), max(pages)), np.int32)
    k_pool = np.zeros((num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM), np.float32)
    v_pool = np.zeros_like(k_pool)
    used = 0
    for s, n in enumerate(SEQ_LENS):
        tables[s, : pages[s]] = page_ids[used : used + pages[s]]
        used += pages[s]
        pos = np.arange(n)
        for pool in (k_pool, v_pool):  # bf16-exact values
            pool[tables[s, pos // PAGE_SIZE], pos % PAGE_SIZE] = to_bf16(rng.standard_normal((n, KV_HEADS, HEAD_DIM)))
    q = rng.standard_normal((len(SEQ_LENS), GROUP * KV_HEADS, HEAD_DIM)).astype(np.float32)
    return q, k_pool, v_pool, tables


def test_decode_attention_lane_after_shuffles_and_shared_partials():
    q, k_pool, v_pool, tables = _paged_inputs()
    scale = 1 / math.sqrt(HEAD_DIM)
    kv_head, seq, thread = 1, 0, 9  # warp 0, lane 9: token slot 2 of each load, dims 8..15
    n = SEQ_LENS[seq]
    seen = {"partial": [], "rounds": [], "scores": []}

    def before_shuffle(frame):
        f = frame.f_locals
        seen["partial"].append((f["pos"], f["g"], f["d0"], f["s"]))

    def shuffle_round(frame):  # before `offset *= 2`: s after the round of this offset
        seen["rounds"].append((frame.f_locals["offset"], frame.f_locals["s"]))

    def score(frame):
        f = frame.f_locals
        seen["scores"].append((f["pos"], f["g"], f["s"]))

    def merge(frame):  # after the syncthreads; copies: shared memory is reused by the next block
        f = frame.f_locals
        seen.update(part_m=f["part_m"].copy(), part_sum=f["part_sum"].copy(), part_acc=f["part_acc"].copy())
        seen["sizes"] = {k: f[k] for k in ("step", "tokens_per_load", "loads")} | {"warps": _f(frame).blockDim.x // 32}

    kernel = decode_attention_kernel_for(1, 8)  # every configuration shares the kernel's code object
    out = cuda.to_device(np.full(q.shape, np.nan, np.float32))
    with contextlib.ExitStack() as stack:
        bps = [
            stack.enter_context(break_in(kernel, line, block=(kv_head, seq), thread=thread, on_hit=on_hit, max_hits=hits))
            for line, on_hit, hits in (
                ("offset = 1", before_shuffle, 1),
                ("offset *= 2", shuffle_round, 2),  # the first score's two rounds (4 lanes a token)
                ("scores[i * group + g] = s if", score, None),
                ("o = cuda.threadIdx.x", merge, None),
            )
        ]
        decode_attention(cuda.to_device(q), upload_bf16(k_pool), upload_bf16(v_pool), cuda.to_device(tables),
                         cuda.to_device(np.array(SEQ_LENS, np.int32)), scale, out)  # fmt: skip

    heads = slice(kv_head * GROUP, (kv_head + 1) * GROUP)
    qs = q[seq, heads].astype(np.float64) * scale  # (group, HD) this block's query heads, scaled

    def k_row(pos):
        return k_pool[tables[seq, pos // PAGE_SIZE], pos % PAGE_SIZE, kv_head].astype(np.float64)  # (HD,)

    # a lane's value before and after each shuffle round: the dot product over 8, 16, then 32 dims
    assert [bp.hits for bp in bps[:2]] == [1, 2]
    pos, g, d0, s = seen["partial"][0]
    assert (pos, g, d0) == (2, 0, 8)
    np.testing.assert_allclose(s, qs[g, 8:16] @ k_row(pos)[8:16], rtol=1e-5)
    assert [offset for offset, _ in seen["rounds"]] == [1, 2]
    np.testing.assert_allclose(seen["rounds"][0][1], qs[g, :16] @ k_row(pos)[:16], rtol=1e-5)  # lanes 8, 9
    np.testing.assert_allclose(seen["rounds"][1][1], qs[g] @ k_row(pos), rtol=1e-5)  # lanes 8-11: the score

    # every score the lane computed: its token slot of each load of the steps of warp 0
    sizes = seen["sizes"]
    assert sorted({p for p, _, _ in seen["scores"]}) == [p for p in range(2, 48, 8) if (p // 16) % sizes["warps"] == 0]
    for pos, g, s in seen["scores"]:
        if pos < n:  # past the context the kernel masks the score to -inf afterwards
            np.testing.assert_allclose(s, qs[g] @ k_row(pos), rtol=1e-5, atol=1e-6)

    # shared memory after the syncthreads: one partial softmax per (warp, token slot)
    tpl, step = sizes["tokens_per_load"], sizes["step"]
    for part in range(sizes["warps"] * tpl):
        warp, slot = divmod(part, tpl)
        tokens = [p for p in range(slot, n, tpl) if (p // step) % sizes["warps"] == warp]
        if not tokens:
            assert np.all(seen["part_m"][part] == -np.inf)
            continue
        k = np.stack([k_row(p) for p in tokens])  # (t, HD)
        v = np.stack([v_pool[tables[seq, p // PAGE_SIZE], p % PAGE_SIZE, kv_head] for p in tokens]).astype(np.float64)
        scores = k @ qs.T  # (t, group)
        m = scores.max(axis=0)
        p = np.exp(scores - m)
        np.testing.assert_allclose(seen["part_m"][part], m, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(seen["part_sum"][part], p.sum(axis=0), rtol=1e-5)
        np.testing.assert_allclose(seen["part_acc"][part], p.T @ v, rtol=1e-4, atol=1e-5)


# ---- prefill attention on wgmma (docs/stepping_through_kernels.md's example) -------------------------


def test_wgmma_prefill_thread_holds_its_rows_p_at_each_key_tile():
    """Thread 5 (warp 0, g 1, q 1) of warpgroup 0, stopped where each key tile's stage is released:
    its acc_s holds P of row 1 (token 0, head 1, position 40) at keys 8j + 2, 8j + 3 of the tile
    (``acc_s[4j + e]``), exp2((s - m) c) against the running max, zero past position 40; after the
    loop, m is the row's max over its 41 keys."""
    rng = np.random.default_rng(0)
    start, new, group, head_dim = 40, 24, 4, 64
    cache = PagedCache(rng, [start + new], 1, head_dim)
    q = rng.standard_normal((new, group, head_dim)).astype(np.float32)
    k_cache, v_cache, block_tables = cache.device()
    tiling = Tiling(2, 32, 2)
    scores = q.astype(BF16).astype(np.float64)[0, 1] @ cache.k[0][:, 0].astype(np.float64).T  # row 1's q . k
    c = np.log2(np.e) / 8
    seen = []

    def tile_p(frame):
        f = frame.f_locals
        keys = [int(f["key0"]) + 8 * j + 2 + e for j in range(4) for e in range(2)]
        p = np.array(f["acc_s"])[[4 * j + e for j in range(4) for e in range(2)]]
        want = [np.exp2((scores[k] - float(f["row_max"][0])) * c) if k <= start else 0.0 for k in keys]
        np.testing.assert_allclose(p, want, rtol=1e-5, atol=1e-7)
        seen.append(keys[0])

    def end(frame):
        assert float(frame.f_locals["row_max"][0]) == pytest.approx(scores[: start + 1].max(), rel=1e-6)
        seen.append("end")

    kernel = prefill_attention_wgmma_kernel_for(group, head_dim, tiling)
    with break_in(kernel, "if tw == 0:", thread=5, on_hit=tile_p), break_in(kernel, "if active:", thread=5, on_hit=end):
        prefill_attention_wgmma(cuda.to_device(q), k_cache, v_cache, block_tables, cuda.to_device(np.array([0, new], np.int32)),
                                cuda.to_device(np.array([start], np.int32)), 1 / 8, cuda.device_array(q.shape, np.float32),
                                tiling=tiling)  # fmt: skip
    assert seen == [2, 34, "end"]  # keys 0..63 in two 32-key tiles


# ---- the helper itself ---------------------------------------------------------------------------


def test_only_the_chosen_thread_stops_and_max_hits_and_disarm():
    x, weight = _rms_inputs()
    seen = []

    def hit(frame):
        seen.append((tuple(_f(frame).blockIdx), tuple(_f(frame).threadIdx), frame.f_locals["c"]))

    # a line inside a loop (4 columns a thread): stops at most twice
    with break_in(rms_norm_kernel, "sum_sq += xs[c] * xs[c]", block=(0, 0, 0), thread=(64,), on_hit=hit, max_hits=2) as bp:
        _run_rms_norm(x, weight)
    assert bp.hits == 2
    assert seen == [((0, 0, 0), (64, 0, 0), 0), ((0, 0, 0), (64, 0, 0), 1)]
    _run_rms_norm(x, weight)  # disarmed after the with
    assert len(seen) == 2 and stepping._breakpoints == []

    with break_in(rms_norm_kernel, block=5, on_hit=hit) as bp:  # the grid has 2 blocks
        _run_rms_norm(x, weight)
    assert bp.hits == 0


def test_pdb_stops_steps_over_the_block_reduction_and_continues(monkeypatch, capsys):
    x, weight = _rms_inputs()
    monkeypatch.setattr("sys.stdin", io.StringIO("p cuda.threadIdx.x, cuda.blockIdx.x\np sum_sq\nn\np total\nc\n"))
    timeout = sim_blocks.hang_timeout_s
    with break_in(rms_norm_kernel, "total = block_sum", block=1, thread=37, intro="CHEAT SHEET") as bp:
        assert sim_blocks.hang_timeout_s >= stepping.DEBUG_HANG_TIMEOUT_S  # the other threads wait for pdb
        out = _run_rms_norm(x, weight)
    assert sim_blocks.hang_timeout_s == timeout
    text = capsys.readouterr().out
    assert bp.hits == 1
    assert "break_in: block (1, 0, 0) thread (37, 0, 0) stopped in rms_norm_kernel" in text
    assert "CHEAT SHEET" in text and "-> total = block_sum(sum_sq, scratch)" in text
    assert "(Pdb) (37, 1)" in text
    assert f"(Pdb) {_thread_partials(x[1])[37]!r}" in text  # np.float32(...): sum_sq
    assert "-> inv_rms = " in text  # `n` ran block_sum, its shuffles and barriers, with the other threads
    total = float(text.split("(Pdb) np.float32(")[2].split(")")[0])
    np.testing.assert_allclose(total, (x[1].astype(np.float64) ** 2).sum(), rtol=1e-6)
    assert not np.isnan(out).any()


def test_pdb_quit_aborts_the_launch(monkeypatch, capsys):
    x, weight = _rms_inputs()
    monkeypatch.setattr("sys.stdin", io.StringIO("q\n"))
    with break_in(rms_norm_kernel, "total = block_sum", thread=3), pytest.raises(KernelError, match="BdbQuit") as e:
        _run_rms_norm(x, weight)
    assert type(e.value.__cause__).__name__ == "BdbQuit"


def test_bad_arguments_and_simulator_off(monkeypatch):
    with pytest.raises(ValueError, match="on lines"), break_in(rms_norm_kernel, "for c in range"):
        pass
    with pytest.raises(ValueError, match="on no line with code"), break_in(rms_norm_kernel, "Block t handles row t"):
        pass  # the docstring runs no code
    with pytest.raises(ValueError, match="has no code"), break_in(rms_norm_kernel, 1):
        pass
    with pytest.raises(ValueError, match="thread must be"), break_in(rms_norm_kernel, thread=(1, 2, 3, 4)):
        pass
    with pytest.raises(TypeError, match="not a kernel"), break_in(42):
        pass
    monkeypatch.setattr(simulator, "simulator_enabled", lambda: False)
    with pytest.raises(RuntimeError, match="NUMBA_ENABLE_CUDASIM=1"), break_in(rms_norm_kernel):
        pass
