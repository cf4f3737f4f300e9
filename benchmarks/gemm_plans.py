"""The Hopper GEMM's plans on a GPU: every tiling and K split of ``gemm_wgmma`` timed on Llama 3.2 1B's
weights, beside cuBLAS and the plan ``pick_plan`` chooses. How its rules were found, and how to check
them after a kernel change or on another Hopper GPU. Needs an H100 or H200 (sm_90a).

    python benchmarks/gemm_plans.py                                   # M = 32 .. 512, splits 1-8 (~2 min)
    python benchmarks/gemm_plans.py --tokens 1024 2048 --splits 1 2   # prefill chunks
    python benchmarks/gemm_plans.py --extra 1x64x12 1x128x9           # more tilings: consumers x block_n x stages
    python benchmarks/gemm_plans.py --silu --json plans.json          # + the gate/up product with SwiGLU
    python benchmarks/gemm_plans.py --accumulate                      # out += x @ w.T (o, down: the residual)
    python benchmarks/gemm_plans.py --clusters                        # + splits summed in a cluster ("/c2", "/c4")
    python benchmarks/gemm_plans.py --multicast                       # + clusters sharing tiles' copies ("/1m2x1")

Each product runs as the model runs it: x's bf16 copy already in the workspace (``x_copy``), split
parts and counters in a workspace. Timing: an L2 flush, a sleeping kernel, then CUDA events around
the call (``bench.kernels.kernel_times_behind_sleep``), median of ``--iters``; torch (cuBLAS bf16
``matmul`` on bf16 x) the same way. A tiling and split is tried where each part keeps at least 4
slices of 64 of K and the grid fits twice the SMs' blocks. Before timing a shape, the picked plan's
output is checked against float64 NumPy on the bf16 inputs (a few rows, the tests' bound). One line per shape: cuBLAS, the picked
plan, the fastest one, then every time (``--all``: each on its own line).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # the package, gemm_bounds

from gemm_bounds import tiling_names  # noqa: E402

from numba_vllm.kernels import gemm_wgmma as gw  # noqa: E402

WEIGHTS = [(2048, 2048), (2048, 8192), (8192, 2048), (128256, 2048), (16384, 2048)]  # (N, K): q/o, down, gate, head, gate/up
NAMES = tiling_names(gw)  # {TileConfig: 'LARGE', ...}: every tiling the launcher picks
MIN_PART_SLICES = 4  # a split's parts keep at least this many BLOCK_K slices
CHECKED_ROWS = 8  # rows of the picked plan's output checked against float64 NumPy
ERROR_BOUND = 1e-5  # |out - want| <= ERROR_BOUND * (|x| @ |w|.T), as the tests hold it (fp32 sums of exact products)


def parse_tiling(spec: str) -> gw.TileConfig:
    """'1x64x12' -> TileConfig(consumers=1, block_n=64, stages=12); it must fit an SM's shared memory."""
    try:
        consumers, block_n, stages = (int(v) for v in spec.lower().split("x"))
        config = gw.TileConfig(consumers=consumers, block_n=block_n, stages=stages)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"{spec!r}: want CONSUMERSxBLOCK_NxSTAGES, e.g. 1x64x12") from e
    if consumers < 1 or block_n % 16 or not 16 <= block_n <= 256 or stages < 2 or config.shared_bytes > 227 * 1024:
        raise argparse.ArgumentTypeError(f"{spec}: block_n a multiple of 16 up to 256, 2+ stages, within 227 KB of shared memory")
    return config


def parse_weight(spec: str) -> tuple[int, int]:
    """'2048x8192' -> (2048, 8192): a weight's rows N and columns K."""
    try:
        n, k = (int(v) for v in spec.lower().split("x"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{spec!r}: want NxK, e.g. 2048x8192") from e
    if n < 2 or k < 8 or n % 2 or k % 8:
        raise argparse.ArgumentTypeError(f"{spec}: N even and K a multiple of 8 (the Hopper GEMM's shapes)")
    return n, k


def parse_multicast(spec: str) -> tuple[int, int]:
    """'2x1' -> (2, 1): a cluster of 2 M tiles sharing w (one of ``gw.MULTICASTS``)."""
    try:
        shape = tuple(int(v) for v in spec.lower().split("x"))
    except ValueError:
        shape = ()
    if shape not in gw.MULTICASTS[1:]:
        raise argparse.ArgumentTypeError(f"{spec!r}: want one of {', '.join(f'{a}x{b}' for a, b in gw.MULTICASTS[1:])}")
    return shape


def positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: want an integer of at least 1")
    return value


def name_of(config: gw.TileConfig) -> str:
    return NAMES.get(config, f"{config.consumers}x{config.block_n}x{config.stages}")


def candidates(m: int, n: int, k: int, tilings, splits, num_sms: int, parts_floats: int, clusters: bool,
               multicasts=()):  # fmt: skip
    """The (tiling, split, in_cluster, multicast) worth timing at (M, N, K): parts of at least
    MIN_PART_SLICES slices, at most twice the blocks the SMs hold at once, split parts within
    ``parts_floats``; with ``clusters`` also every split of ``gw.CLUSTER_SPLITS`` summed in a cluster
    (tilings whose parts fit beside their stages); every unsplit tiling in clusters of each of
    ``multicasts`` (shapes of ``gw.MULTICASTS``) that share its tiles' copies, where the matrix has the tiles."""
    slices = -(-k // gw.BLOCK_K)
    for config, split in itertools.product(tilings, splits):
        tiles = gw.tile_count(config, m, n)
        if split > 1 and slices // split < MIN_PART_SLICES:
            continue
        if clusters and split in gw.CLUSTER_SPLITS[1:] and config.shared_bytes_for(split) <= gw.SHARED_BYTES_PER_SM - 1024:
            yield config, split, True, gw.NO_MULTICAST
        if split == 1:
            for mc in multicasts:
                if gw.multicast_fits(config, mc) and -(-m // config.block_m) >= mc[0] and -(-n // config.block_n) >= mc[1]:
                    yield config, 1, False, mc
        if split > 1 and (tiles * split > 2 * num_sms * gw.blocks_per_sm(config)
                          or split * tiles * config.block_m * config.block_n > parts_floats
                          or tiles > gw.TILE_COUNTERS):  # fmt: skip
            continue
        yield config, split, False, gw.NO_MULTICAST


def plan_name(config: gw.TileConfig, split: int, in_cluster: bool, multicast=gw.NO_MULTICAST) -> str:
    """'TINY/4' (a split through global memory), 'TINY/c4' (summed in a cluster of 4), 'TINY/1m2x1'
    (a cluster of two M tiles sharing each w tile's copy)."""
    shared = "" if tuple(multicast) == gw.NO_MULTICAST else f"m{multicast[0]}x{multicast[1]}"
    return f"{name_of(config)}/{'c' if in_cluster else ''}{split}{shared}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=positive, nargs="+", default=[32, 64, 128, 256, 512], help="rows of x (M)")
    parser.add_argument("--weights", type=parse_weight, nargs="+", default=WEIGHTS,
                        help="weights NxK (default: Llama 3.2 1B's five)")  # fmt: skip
    parser.add_argument("--splits", type=positive, nargs="+", default=[1, 2, 3, 4, 8])
    parser.add_argument("--tilings", nargs="+", choices=list(NAMES.values()), default=list(NAMES.values()),
                        help="which of the launcher's tilings to try (default: all)")  # fmt: skip
    parser.add_argument("--extra", type=parse_tiling, nargs="*", default=[], help="more tilings, CONSUMERSxBLOCK_NxSTAGES")
    parser.add_argument("--silu", action="store_true", help="also the gate/up products with SwiGLU in the epilogue")
    parser.add_argument("--accumulate", action="store_true", help="out += x @ w.T (the o and down products), torch too")
    parser.add_argument("--clusters", action="store_true", help="also splits summed in a thread-block cluster")
    parser.add_argument("--multicast", nargs="*", type=parse_multicast, default=None,
                        help="also clusters whose blocks share their tiles' copies: these MC_MxMC_N shapes (none given: all)")
    parser.add_argument("--iters", type=positive, default=15)
    parser.add_argument("--all", action="store_true", help="print every tiling and split's time")
    parser.add_argument("--json", help="write every time here")
    args = parser.parse_args()

    from numba import cuda

    from numba_vllm.bench.kernels import L2Flusher, kernel_times_behind_sleep, require_gpu, torch_or_none
    from numba_vllm.bench.matmul_cases import torch_linear, wgmma_operands
    from numba_vllm.kernels._launch import num_sms
    from numba_vllm.loading.bf16 import to_bf16

    require_gpu()
    torch = torch_or_none()
    flush = L2Flusher()
    sms = num_sms()
    tilings = [config for config, name in NAMES.items() if name in args.tilings] + list(args.extra)
    rows = []
    for (n, k), m in itertools.product(args.weights, args.tokens):
        ops, workspace, x_copy = wgmma_operands(m, n, k, seed=n + k + m)
        parts_floats = workspace.partials.shape[0]
        plan = gw.pick_plan(m, n, k, sms)

        def product(config, split, in_cluster, multicast, ops=ops, workspace=workspace, x_copy=x_copy):
            gw.gemm_wgmma(ops.x, ops.w, ops.out, args.accumulate, config=config, split=split, workspace=workspace,
                          x_copy=x_copy, in_cluster=in_cluster, multicast=multicast)  # fmt: skip

        checked = np.arange(0, m, max(1, m // CHECKED_ROWS))  # a few rows, float64
        x64, w64 = to_bf16(ops.x_host[checked]).astype(np.float64), ops.w_host.astype(np.float64)

        def relative_error(config, split, in_cluster, multicast, ops=ops, checked=checked, x64=x64, w64=w64):
            ops.out.copy_to_device(np.zeros(ops.out.shape, np.float32))  # (accumulate: 0 + the product)
            product(config, split, in_cluster, multicast)
            err = np.abs(ops.out.copy_to_host()[checked] - x64 @ w64.T) / (np.abs(x64) @ np.abs(w64).T + 1e-30)
            return float(err.max())

        multicasts = () if args.multicast is None else args.multicast or gw.MULTICASTS[1:]
        plans = list(candidates(m, n, k, tilings, args.splits, sms, parts_floats, args.clusters, multicasts))
        clustered = [p for p in plans if p[2] or p[3] != gw.NO_MULTICAST]
        errors = {plan_name(*p): relative_error(*p) for p in [plan, *clustered]}  # the plan and every cluster
        row = {"m": m, "n": n, "k": k, "plan": plan_name(*plan), "relative_error": max(errors.values()), "us": {},
               "wrong": [name for name, error in errors.items() if not error <= ERROR_BOUND]}  # fmt: skip
        if torch is not None:
            torch_product = torch_linear(torch, ops, torch.bfloat16, args.accumulate)
            row["torch_us"] = kernel_times_behind_sleep(torch_product, flush, args.iters) * 1e6
        for p in plans:
            seconds = kernel_times_behind_sleep(lambda: product(*p), flush, args.iters)  # noqa: B023
            row["us"][plan_name(*p)] = seconds * 1e6
        if args.silu and n == 2 * 8192:
            act = cuda.device_array((m, n // 2), np.uint16)
            silu_splits = [s for s in args.splits if s <= 4]
            for config, split, _, _ in candidates(m, n, k, tilings, silu_splits, sms, parts_floats, False):
                def silu(config=config, split=split, act=act, ops=ops, workspace=workspace, x_copy=x_copy):
                    gw.gemm_wgmma_silu_mul(ops.x, ops.w, act, config=config, workspace=workspace, x_copy=x_copy, split=split)

                row["us"][f"silu:{name_of(config)}/{split}"] = kernel_times_behind_sleep(silu, flush, args.iters) * 1e6
        rows.append(row)
        report(row, args.all)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def report(row: dict, every: bool) -> None:
    """One line: the shape, cuBLAS, the picked plan and the fastest (each with its ratio to cuBLAS)."""
    plain = {key: t for key, t in row["us"].items() if not key.startswith("silu:")}
    fastest = min(plain, key=plain.get)
    torch_us = row.get("torch_us")

    def ratio(t):
        return "" if torch_us is None else f" ({t / torch_us:.2f}x)"

    picked = plain.get(row["plan"], float("nan"))
    line = f"M={row['m']:5d} N={row['n']:6d} K={row['k']:5d}  torch {torch_us or float('nan'):7.1f} us"
    line += f"  picked {row['plan']:<15s} {picked:7.1f}{ratio(picked)}"
    line += f"  fastest {fastest:<15s} {plain[fastest]:7.1f}{ratio(plain[fastest])}"
    line += "  checked" if not row["wrong"] else f"  WRONG: {', '.join(row['wrong'])} (error {row['relative_error']:.1e})"
    print(line, flush=True)
    if every:
        for key, t in sorted(row["us"].items(), key=lambda kv: kv[1]):
            print(f"    {key:<22s} {t:8.1f} us{ratio(t)}")


if __name__ == "__main__":
    from numba_vllm.bench.common import BenchError

    try:
        main()
    except BenchError as e:  # no usable GPU: one line, not a traceback
        sys.exit(f"gemm_plans: {e}")
