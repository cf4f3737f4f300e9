"""Paged decode attention on a GPU: the tensor-core kernel (``decode_attention_tc``, the model's) and
the CUDA-core bandwidth kernel (``decode_attention_fast``) checked against NumPy and timed beside the
readable reference (``decode_attention``, "current") and torch, at Llama 3.2 1B's attention shapes
(32 query heads, 8 kv heads, head dim 64, bf16 K/V in 16-token pages with shuffled page ids).

Correctness (every variant timed): per sequence, float64 NumPy attention on the same bf16 K/V
(``tests/helpers/attention.py``), with NaN in every cache slot no sequence owns and NaN-poisoned
outputs: ``fast`` within rtol = atol = 1e-5; ``tc`` (q and P in bf16) within the per-element bound
of ``tests/test_decode_attention_tc.py`` against the reference on bf16 q. Batches of random lengths
(64 up to 1,024 tokens, 3 of up to 3,000, 1 of 16,384), and batches whose block table is padded to
the next power of two, which must give the same bits (CUDA graphs pad tables).

Timing: before every call an L2 flush (a 256 MB write, as ``bench kernels`` does) and a 1 ms
sleeping kernel, then CUDA events around the call: the GPU is busy while the host enqueues it, so
the events time the GPU's work only (launch gaps between a split's two kernels included). Median of
``--iters``. torch: ``scaled_dot_product_attention`` in bf16 with ``enable_gqa`` on K/V gathered
into contiguous tensors beforehand (the best case a paged kernel is compared with). TB/s counts
the K/V bytes.

    python benchmarks/decode_attention_gpu.py [--json out.json]   # checks, then the table (~1 min)
    python benchmarks/decode_attention_gpu.py --sweep             # also the tuning variants
    python benchmarks/decode_attention_gpu.py --variants tc_p1,tc_s64   # some of them

(On the H200 machine, from a copy of the checkout with numpy < 2.5 first on the path, as for any
kernel there.) The GPU tests of the same kernels: ``NUMBA_VLLM_TEST_GPU=1 python -m pytest -m gpu
tests/test_decode_attention_tc.py tests/test_decode_attention_fast.py``.

Variants (``--sweep``) set a module's knobs: ``tc_p1`` one page a step at 128 registers (4 blocks per
SM) whatever the grid; ``tc_w4`` full grids in blocks of 4 warps whatever their size (not as many
as fit one wave: ``full_grid_warps``); ``tc_full2`` full grids on two pages a step at 168 registers
like the rest; ``tc_nocap`` no register cap; ``tc_kvh_blocks`` full grids of one-warp blocks as a
block per (kv head, sequence), not a block per sequence of a warp per kv head; ``tc_s64`` /
``tc_s16`` at most 64 / 16 ranges per sequence (``MAX_SPLITS`` is 32; it matters past 4,096 tokens
at batch 1, e.g. 1 x 16,384).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's numba_vllm and tests

from numba_vllm.bench.attention_cases import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, _gathered_torch, _random_cache  # noqa: E402
from numba_vllm.bench.kernels import L2Flusher, kernel_times_behind_sleep, torch_or_none  # noqa: E402
from numba_vllm.kernels import decode_attention_fast as fast  # noqa: E402
from numba_vllm.kernels import decode_attention_tc as tc  # noqa: E402
from numba_vllm.kernels.decode_attention import decode_attention  # noqa: E402
from numba_vllm.loading.bf16 import BF16  # noqa: E402
from numba_vllm.model.config import PAGE_SIZE  # noqa: E402
from tests.helpers.attention import ATOL, RTOL, PagedCache, nan_device, reference_attention  # noqa: E402
from tests.test_decode_attention_tc import ATOL as TC_ATOL  # noqa: E402
from tests.test_decode_attention_tc import P_BOUND  # noqa: E402

SCALE = 1.0 / np.sqrt(HEAD_DIM)
GROUP = NUM_HEADS // NUM_KV_HEADS
SHAPES = [(1, 256), (1, 1024), (1, 16384), (4, 4096), (32, 4096), (64, 1024), (256, 512)]  # (batch, context)
KNOBS = {fast: ("PREFETCH", "MAX_REGISTERS", "BLOCKS_PER_SM", "SPLIT_REF_BLOCKS", "NUM_WARPS", "MAX_SPLITS"),
         tc: ("MAX_REGISTERS", "PAGES_PER_STEP", "NUM_WARPS", "FULL_GRID_PAGES_PER_STEP", "FULL_GRID_MAX_REGISTERS",
              "FULL_GRID_WARP_SLOTS", "FULL_GRID_HEAD_WARPS")}
DEFAULTS = {module: {name: getattr(module, name) for name in names} for module, names in KNOBS.items()}
VARIANTS = {  # name: (the module whose launcher runs, {module: knobs})
    "fast": (fast, {}),
    "tc": (tc, {}),
    "tc_p1": (tc, {tc: {"PAGES_PER_STEP": 1, "MAX_REGISTERS": 128}}),
    "tc_w4": (tc, {tc: {"FULL_GRID_WARP_SLOTS": 1 << 30}}),  # full grids in blocks of 4 warps, however many
    "tc_full2": (tc, {tc: {"FULL_GRID_PAGES_PER_STEP": 2, "FULL_GRID_MAX_REGISTERS": 168}}),  # full grids as the others
    "tc_nocap": (tc, {tc: {"MAX_REGISTERS": None}}),
    "tc_kvh_blocks": (tc, {tc: {"FULL_GRID_HEAD_WARPS": False}}),  # one-warp full grids: a block per (kv head, seq)
    "tc_s64": (tc, {fast: {"MAX_SPLITS": 64}}),  # the split rule lives in decode_attention_fast
    "tc_s16": (tc, {fast: {"MAX_SPLITS": 16}}),
}


def use_variant(name: str):
    """Set the knobs of variant ``name`` (every other knob back to its default); its launcher."""
    module, knobs = VARIANTS[name]
    for mod, defaults in DEFAULTS.items():
        for key, value in {**defaults, **knobs.get(mod, {})}.items():
            setattr(mod, key, value)
    return fast.decode_attention_fast if module is fast else tc.decode_attention_tc


def check(attention, rng, seq_lens, extra_columns=0):
    """Run ``attention`` on a NaN-poisoned paged cache; assert against NumPy (the tensor-core kernel
    within its bf16 bound); return the output, the largest error, and the split."""
    cache = PagedCache(rng, seq_lens, NUM_KV_HEADS, HEAD_DIM)
    width = cache.block_tables.shape[1]
    cache.block_tables = np.pad(cache.block_tables, ((0, 0), (0, extra_columns)))
    q = rng.standard_normal((len(seq_lens), NUM_HEADS, HEAD_DIM)).astype(np.float32)
    out = nan_device(q.shape)
    k_cache, v_cache, block_tables = cache.device()
    workspace = nan_device(fast.split_workspace_floats(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM))
    lens = cuda.to_device(np.array(seq_lens, np.int32))
    attention(cuda.to_device(q), k_cache, v_cache, block_tables, lens, SCALE, out, workspace)
    got = out.copy_to_host()
    worst = 0.0
    bf16_q = attention is tc.decode_attention_tc
    if bf16_q:
        q = q.astype(BF16).astype(np.float32)
    for s, n in enumerate(seq_lens):
        want = reference_attention(q[s : s + 1], cache.k[s], cache.v[s], [n - 1], SCALE)
        err = np.abs(got[s : s + 1] - want)
        if bf16_q:
            bound = P_BOUND * reference_attention(q[s : s + 1], cache.k[s], np.abs(cache.v[s]), [n - 1], SCALE) + TC_ATOL
            assert (err <= bound).all(), f"sequence {s} of {n} tokens: error {err.max():.3g} past the bf16 bound"
        else:
            np.testing.assert_allclose(got[s : s + 1], want, rtol=RTOL, atol=ATOL, err_msg=f"sequence {s} of {n} tokens")
        worst = max(worst, float(err.max()))
    min_pages = fast.min_split_pages(HEAD_DIM) if not bf16_q else tc.NUM_WARPS * tc.pages_per_step(HEAD_DIM)
    splits = fast.pick_split(len(seq_lens) * NUM_KV_HEADS, width + extra_columns, min_pages)
    return got, worst, splits


def check_all(attention, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    lines = []
    for seq_lens in ([1024, 1, 16, 17, *rng.integers(1, 1025, 60)], [3000, 1000, 17], [16384]):
        _, worst, splits = check(attention, rng, [int(n) for n in seq_lens])
        lines.append(f"  {len(seq_lens)} seqs up to {max(seq_lens)}: max |err| {worst:.2e}, (splits, pages) {splits}")
    for seq_lens in ([1100, 33], [2500], [300]):  # a table padded to the next power of two: the same bits
        width = max(-(-n // PAGE_SIZE) for n in seq_lens) + 1  # PagedCache's tables have a padding column
        narrow, _, s0 = check(attention, np.random.default_rng(seed), seq_lens)
        wide, _, s1 = check(attention, np.random.default_rng(seed), seq_lens, (1 << (width - 1).bit_length()) - width)
        assert np.array_equal(narrow, wide), f"padded table {s1} differs from {s0}"
        lines.append(f"  padded table {seq_lens}: bit-identical, (splits, pages) {s0} -> {s1}")
    return lines


SLEEP_US = 1000  # longer than the host takes to enqueue a split launch and its merge (~200 us measured)


def time_events(fn, flush, iters: int) -> float:
    """Median GPU time (us) of ``fn`` after an L2 flush, the host's launches hidden behind a sleep."""
    return kernel_times_behind_sleep(fn, flush, iters, SLEEP_US) * 1e6


def time_shape(batch: int, context: int, names, torch, flush, iters: int) -> dict:
    """Times (us) of the current kernel, the fast one's variants and torch at one shape."""
    rng = np.random.default_rng(0)
    k_cache, v_cache, tables = _random_cache(rng, [context] * batch)
    q = cuda.to_device(rng.standard_normal((batch, NUM_HEADS, HEAD_DIM), np.float32))
    out = cuda.device_array((batch, NUM_HEADS, HEAD_DIM), np.float32)
    block_tables = cuda.to_device(tables)
    lens = cuda.to_device(np.full(batch, context, np.int32))
    workspace = cuda.device_array(fast.split_workspace_floats(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM), np.float32)
    kv = (q, k_cache, v_cache, block_tables, lens, SCALE, out)
    row = {"case": f"{batch}x{context}", "kv_bytes": 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2}
    row["current"] = time_events(lambda: decode_attention(*kv), flush, iters)
    for name in names:
        attention = use_variant(name)
        try:
            row[name] = time_events(lambda: attention(*kv, workspace), flush, iters)  # noqa: B023
        except Exception as e:  # a variant that fails to build or run: say so, time the others
            print(f"{name} at {batch}x{context}: {type(e).__name__}: {str(e)[:300]}")
            row[name] = float("nan")
    use_variant("tc")
    row["torch"] = float("nan")
    if torch is not None:
        kt, vt = _gathered_torch(torch, k_cache, v_cache, tables, context)
        qt = torch.randn(batch, NUM_HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        row["torch"] = time_events(lambda: sdpa(qt, kt, vt, scale=SCALE, enable_gqa=True), flush, iters)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also time the fast kernel's tuning variants")
    parser.add_argument("--variants", help="comma-separated variants to check and time (default: fast,tc; --sweep: all)")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args()
    names = list(VARIANTS) if args.sweep else ["fast", "tc"]
    if args.variants:
        names = list(dict.fromkeys(["fast", "tc", *args.variants.split(",")]))  # the table's ratios need both
        unknown = [n for n in names if n not in VARIANTS]
        if unknown:
            parser.error(f"unknown variants {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    seed = int(np.random.SeedSequence().entropy % 2**32)
    name = cuda.get_current_device().name
    print(f"device: {name.decode() if isinstance(name, bytes) else name}, seed {seed}")
    for name in names:
        attention = use_variant(name)
        print(f"check {name}:")
        try:
            for line in check_all(attention, seed):
                print(line)
        except Exception as e:  # report and go on to the timings
            print(f"  FAILED: {type(e).__name__}: {str(e)[:1000]}")
    use_variant("tc")

    torch = torch_or_none()
    flush = L2Flusher()
    rows = []
    print(f"{'case':>12} {'current':>9} " + " ".join(f"{n:>9}" for n in names)
          + f" {'torch':>9} {'tc TB/s':>9} {'torch TB/s':>10} {'tc/torch':>9} {'fast/torch':>10}")  # fmt: skip
    for batch, context in SHAPES:
        row = time_shape(batch, context, names, torch, flush, args.iters)
        rows.append(row)
        tbs, torch_tbs = row["kv_bytes"] / row["tc"] * 1e-6, row["kv_bytes"] / row["torch"] * 1e-6
        print(f"{row['case']:>12} {row['current']:9.1f} " + " ".join(f"{row[n]:9.1f}" for n in names)
              + f" {row['torch']:9.1f} {tbs:9.2f} {torch_tbs:10.2f} {row['tc'] / row['torch']:9.2f}"
              + f" {row['fast'] / row['torch']:10.2f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
