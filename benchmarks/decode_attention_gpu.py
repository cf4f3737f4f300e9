"""Paged decode attention on a GPU: the bandwidth kernel (``decode_attention_fast``) checked against
NumPy and timed beside the reference kernel (``decode_attention``) and torch, at Llama 3.2 1B's
attention shapes (32 query heads, 8 kv heads, head dim 64, bf16 K/V in 16-token pages with shuffled
page ids).

Correctness (every variant timed): per sequence, float64 NumPy attention on the same bf16 K/V
(``tests/helpers/attention.py``; rtol = atol = 1e-5), with NaN in every cache slot no sequence owns
and NaN-poisoned outputs; batches of random lengths (64 up to 1,024 tokens, 3 of up to 3,000, 1 of
16,384); and the same batch with its block table padded to the next power of two and wider again,
which must give the same bits (CUDA graphs pad tables).

Timing: before every launch an L2 flush (a 256 MB write, as ``bench kernels`` does), then CUDA
events around one call; the flush keeps the GPU busy while the host enqueues the call, so the
events time the GPU's work only. Median of ``--iters``. torch: ``scaled_dot_product_attention`` in
bf16 with ``enable_gqa`` on K/V gathered into contiguous tensors beforehand (the best case a paged
kernel is compared with). TB/s counts the K/V bytes.

    python benchmarks/decode_attention_gpu.py               # checks, then the table
    python benchmarks/decode_attention_gpu.py --sweep       # also the tuning variants of the fast kernel

Variants (``--sweep``) set the fast module's knobs: ``nopf`` no L2 prefetch, ``noreg`` no register
cap (3 blocks per SM), ``ref8``/``ref32`` half/double ``SPLIT_REF_BLOCKS``, ``w8`` 8-warp blocks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's numba_vllm and tests

from numba_vllm.bench.attention_cases import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, _gathered_torch, _random_cache  # noqa: E402
from numba_vllm.bench.kernels import L2Flusher, torch_or_none  # noqa: E402
from numba_vllm.kernels import decode_attention_fast as fast  # noqa: E402
from numba_vllm.kernels.decode_attention import decode_attention  # noqa: E402
from numba_vllm.model.config import PAGE_SIZE  # noqa: E402
from tests.helpers.attention import ATOL, RTOL, PagedCache, nan_device, reference_attention  # noqa: E402

SCALE = 1.0 / np.sqrt(HEAD_DIM)
GROUP = NUM_HEADS // NUM_KV_HEADS
SHAPES = [(1, 256), (1, 1024), (1, 16384), (4, 4096), (32, 4096), (64, 1024), (256, 512)]  # (batch, context)
DEFAULTS = {name: getattr(fast, name) for name in ("PREFETCH", "MAX_REGISTERS", "BLOCKS_PER_SM", "SPLIT_REF_BLOCKS", "NUM_WARPS")}
VARIANTS = {
    "fast": {},
    "nopf": {"PREFETCH": False},
    "noreg": {"MAX_REGISTERS": None, "BLOCKS_PER_SM": 3},
    "ref8": {"SPLIT_REF_BLOCKS": 8},
    "ref32": {"SPLIT_REF_BLOCKS": 32},
    "w8": {"NUM_WARPS": 8, "BLOCKS_PER_SM": 2},
}


def use_variant(name: str) -> None:
    for key, value in {**DEFAULTS, **VARIANTS[name]}.items():
        setattr(fast, key, value)


def check(rng, seq_lens, extra_columns=0):
    """Run the fast kernel on a NaN-poisoned paged cache; assert against NumPy; return the output."""
    cache = PagedCache(rng, seq_lens, NUM_KV_HEADS, HEAD_DIM)
    width = cache.block_tables.shape[1]
    cache.block_tables = np.pad(cache.block_tables, ((0, 0), (0, extra_columns)))
    q = rng.standard_normal((len(seq_lens), NUM_HEADS, HEAD_DIM)).astype(np.float32)
    out = nan_device(q.shape)
    k_cache, v_cache, block_tables = cache.device()
    workspace = nan_device(fast.split_workspace_floats(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM))
    lens = cuda.to_device(np.array(seq_lens, np.int32))
    fast.decode_attention_fast(cuda.to_device(q), k_cache, v_cache, block_tables, lens, SCALE, out, workspace)
    got = out.copy_to_host()
    worst = 0.0
    for s, n in enumerate(seq_lens):
        want = reference_attention(q[s : s + 1], cache.k[s], cache.v[s], [n - 1], SCALE)
        np.testing.assert_allclose(got[s : s + 1], want, rtol=RTOL, atol=ATOL, err_msg=f"sequence {s} of {n} tokens")
        worst = max(worst, float(np.max(np.abs(got[s : s + 1] - want))))
    splits = fast.pick_split(len(seq_lens) * NUM_KV_HEADS, width + extra_columns, HEAD_DIM)
    return got, worst, splits


def check_all(seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    lines = []
    for seq_lens in ([1024, 1, 16, 17, *rng.integers(1, 1025, 60)], [3000, 1000, 17], [16384]):
        _, worst, splits = check(rng, [int(n) for n in seq_lens])
        lines.append(f"  {len(seq_lens)} seqs up to {max(seq_lens)}: max |err| {worst:.2e}, (splits, pages) {splits}")
    for seq_lens in ([1100, 33], [2500], [300]):  # a table padded to the next power of two: the same bits
        width = max(-(-n // PAGE_SIZE) for n in seq_lens) + 1  # PagedCache's tables have a padding column
        narrow, _, s0 = check(np.random.default_rng(seed), seq_lens)
        wide, _, s1 = check(np.random.default_rng(seed), seq_lens, (1 << (width - 1).bit_length()) - width)
        assert np.array_equal(narrow, wide), f"padded table {s1} differs from {s0}"
        lines.append(f"  padded table {seq_lens}: bit-identical, (splits, pages) {s0} -> {s1}")
    return lines


def time_events(fn, flush, iters: int) -> float:
    start, stop = cuda.event(), cuda.event()
    times = []
    for _ in range(iters + 3):
        flush()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cuda.event_elapsed_time(start, stop) * 1e3)  # us
    return statistics.median(times[3:])


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
        use_variant(name)
        row[name] = time_events(lambda: fast.decode_attention_fast(*kv, workspace), flush, iters)
    use_variant("fast")
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
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args()
    names = list(VARIANTS) if args.sweep else ["fast"]
    seed = int(np.random.SeedSequence().entropy % 2**32)
    name = cuda.get_current_device().name
    print(f"device: {name.decode() if isinstance(name, bytes) else name}, seed {seed}")
    for name in names:
        use_variant(name)
        print(f"check {name}:")
        for line in check_all(seed):
            print(line)
    use_variant("fast")

    torch = torch_or_none()
    flush = L2Flusher()
    rows = []
    print(f"{'case':>12} {'current':>9} " + " ".join(f"{n:>9}" for n in names)
          + f" {'torch':>9} {'fast TB/s':>9} {'torch TB/s':>10} {'fast/torch':>10}")  # fmt: skip
    for batch, context in SHAPES:
        row = time_shape(batch, context, names, torch, flush, args.iters)
        rows.append(row)
        tbs, torch_tbs = row["kv_bytes"] / row["fast"] * 1e-6, row["kv_bytes"] / row["torch"] * 1e-6
        print(f"{row['case']:>12} {row['current']:9.1f} " + " ".join(f"{row[n]:9.1f}" for n in names)
              + f" {row['torch']:9.1f} {tbs:9.2f} {torch_tbs:10.2f} {row['fast'] / row['torch']:10.2f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
