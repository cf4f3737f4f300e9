"""Where a Hopper GEMM product's time goes: ``gemm_wgmma`` timed as it is, without its wgmma (copies and
barriers), without its copies (wgmma on whatever the stages hold, and barriers), and without either
(the barriers alone), beside cuBLAS. Needs an H100 or H200 (sm_90a).

    python benchmarks/gemm_bounds.py                                      # the decode shapes past 1.4x of cuBLAS
    python benchmarks/gemm_bounds.py --shapes 256x2048x8192 --tilings TINY SMALL

The three reduced builds are copies of ``kernels/gemm_wgmma.py`` with its source transformed: the
consumers' ``mma`` loop behind a constant that is false, or the producer arriving on a stage's full
barrier without the byte count and skipping its TMA copies. Their outputs are meaningless; the full
build's is checked against float64 NumPy (a few rows). If one kind of work alone takes as long as the
product, it is the bound; if the barriers alone come close, neither the copies nor the tensor cores
are, but the chain of waits and arrivals around them. Timing: an L2 flush, a sleeping kernel, CUDA
events around the call (``bench.kernels.kernel_times_behind_sleep``), median of ``--iters``.
"""

from __future__ import annotations

import argparse
import re
import sys
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from numba_vllm.kernels import gemm_wgmma as gw  # noqa: E402

KERNEL = ROOT / "numba_vllm" / "kernels" / "gemm_wgmma.py"
# The consumers' wgmma of one K step, and where the producer arrives with the stage's byte count.
MMA_LOOP = re.compile(r"^( +)for kk in range\(BLOCK_K // WGMMA_K\):\n +mma\(acc, smem, desc_a \+ kk \* DESC_K_STEP, "
                      r"desc_b \+ kk \* DESC_K_STEP\)\n", re.M)  # fmt: skip
COPY_ARRIVAL = re.compile(r"^( +)mbarrier_arrive_expect_tx\(barrier, stage_bytes\)", re.M)
MODES = {"product": (True, True), "copies": (False, True), "wgmma": (True, False), "barriers": (False, False)}
SHAPES = ["256x2048x2048", "512x2048x2048", "256x2048x8192"]
CHECKED_ROWS = 8


def reduced_source(source: str, mma: bool, copies: bool) -> str:
    """gemm_wgmma.py's source with its wgmma (``mma``) or its copies (``copies``) switched off."""
    if len(MMA_LOOP.findall(source)) != 1 or len(COPY_ARRIVAL.findall(source)) != 1:
        raise SystemExit(f"{KERNEL}: the K step's wgmma loop or the producer's arrival is not where this script "
                         "expects it (update MMA_LOOP / COPY_ARRIVAL)")  # fmt: skip
    if not mma:
        source = MMA_LOOP.sub(lambda m: f"{m.group(1)}if False:\n" + _indent(m.group(0)), source)
    if not copies:  # arrive without bytes and go on to the next step: the consumers find the stage full at once
        source = COPY_ARRIVAL.sub(lambda m: f"{m.group(1)}mbarrier_arrive(barrier)\n{m.group(1)}step += 1\n"
                                            f"{m.group(1)}continue", source)  # fmt: skip
    return source


def _indent(block: str) -> str:
    return "".join(f"    {line}\n" for line in block.splitlines())


def build(mode: str):
    """A module made from gemm_wgmma.py for ``mode`` (one of MODES), importable under its own name."""
    mma, copies = MODES[mode]
    name = f"numba_vllm.kernels.gemm_wgmma_{mode}"
    module = types.ModuleType(name)
    module.__file__ = str(KERNEL)
    sys.modules[name] = module
    exec(compile(reduced_source(KERNEL.read_text(), mma, copies), f"{KERNEL} ({mode})", "exec"), module.__dict__)
    return module


def tiling_names(module) -> dict:
    """{TileConfig: its name} of a gemm_wgmma module's named tilings (LARGE, SMALL, ...)."""
    return {value: name for name, value in vars(module).items() if isinstance(value, module.TileConfig)}


def plan_name(module, m: int, n: int, k: int, sms: int) -> str:
    """pick_plan's choice as 'TINY', 'TINY/2' (K split 2 ways) or 'MEDIUM/c2' (split in a cluster)."""
    config, split, in_cluster, _ = module.pick_plan(m, n, k, sms)
    return tiling_names(module).get(config, str(config)) + (f"/{'c' if in_cluster else ''}{split}" if split > 1 else "")


def parse_shape(spec: str) -> tuple[int, int, int]:
    """'256x2048x8192' -> (M, N, K)."""
    try:
        m, n, k = (int(v) for v in spec.lower().split("x"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{spec!r}: want MxNxK, e.g. 256x2048x8192") from e
    if min(m, n, k) < 1 or n % 2 or k % 8:
        raise argparse.ArgumentTypeError(f"{spec}: N even and K a multiple of 8 (the Hopper GEMM's shapes)")
    return m, n, k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=[parse_shape(s) for s in SHAPES])
    parser.add_argument("--tilings", nargs="*", default=[], choices=sorted(tiling_names(gw).values()),
                        help="tilings of gemm_wgmma to force (default: pick_plan's)")  # fmt: skip
    parser.add_argument("--iters", type=int, default=21)
    args = parser.parse_args()
    if args.iters < 1:
        parser.error(f"--iters {args.iters}: want at least 1")

    from numba_vllm.bench.kernels import L2Flusher, kernel_times_behind_sleep, require_gpu, torch_or_none
    from numba_vllm.bench.matmul_cases import torch_linear, wgmma_operands
    from numba_vllm.kernels._launch import num_sms
    from numba_vllm.loading.bf16 import to_bf16

    require_gpu()
    torch = torch_or_none()
    builds = {mode: build(mode) for mode in MODES}
    flush = L2Flusher()
    print("M x N x K, tiling: cuBLAS, then the product / copies and barriers / wgmma and barriers / barriers alone (us)")
    for m, n, k in args.shapes:
        ops, workspace, x_copy = wgmma_operands(m, n, k, seed=m + n + k)
        want = to_bf16(ops.x_host[:CHECKED_ROWS]).astype(np.float64) @ ops.w_host.astype(np.float64).T
        torch_us = kernel_times_behind_sleep(torch_linear(torch, ops, torch.bfloat16), flush, args.iters) * 1e6 if torch else None
        for tiling in args.tilings or [None]:
            times = []
            for mode, module in builds.items():
                config = getattr(module, tiling) if tiling else None
                forced = {"config": config, "split": 1, "in_cluster": False} if config else {}

                def product(module=module, forced=forced, ops=ops, workspace=workspace, x_copy=x_copy):
                    module.gemm_wgmma(ops.x, ops.w, ops.out, workspace=workspace, x_copy=x_copy, **forced)

                if mode == "product":
                    product()
                    error = np.abs(ops.out.copy_to_host()[:CHECKED_ROWS] - want).max()
                    if not error <= 1e-2:
                        raise SystemExit(f"{m}x{n}x{k} {tiling or 'plan'}: wrong product (max error {error:.3g})")
                times.append(kernel_times_behind_sleep(product, flush, args.iters) * 1e6)
            name = tiling or plan_name(builds["product"], m, n, k, num_sms())
            cublas = f"{torch_us:6.1f}" if torch_us else "   -  "
            print(f"{m}x{n}x{k:<6} {name:<14} {cublas}  " + " / ".join(f"{t:6.1f}" for t in times), flush=True)


if __name__ == "__main__":
    from numba_vllm.bench.common import BenchError

    try:
        main()
    except BenchError as e:  # no usable GPU: one line, not a traceback
        sys.exit(f"gemm_bounds: {e}")
