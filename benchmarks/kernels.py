"""Per-kernel roofline table on an NVIDIA GPU: time, achieved GB/s or TFLOP/s, against measured ceilings.

    python benchmarks/kernels.py [--only NAME] [--iters 50] [--json out.json]

Each case (from bench_matmul.py, bench_attention.py, bench_pointwise.py) launches one operation on
preallocated device arrays holding random data. Kernel time is the GPU's own: when torch is
importable, its profiler (CUPTI) records every kernel's device duration, so the ~25-50 us a plain
numba launch costs on the host is not counted; without torch, CUDA events around a burst of launches
are used and the table says so. Before every timed launch the L2 cache is flushed by writing a buffer
larger than it, so weights are read from device memory as they are in a real decode step.

Ceilings are measured on the spot: device-to-device copy bandwidth (bytes read + written), and, with
torch, its bf16 matrix rate. A case is memory-bound when bytes / bandwidth exceeds flops / fp32 rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from numba import cuda  # noqa: E402

FP32_PEAK_TFLOPS = 67.0  # H100/H200 SXM datasheet fp32 (non-tensor) rate: the ceiling of FMA-based kernels
L2_FLUSH_BYTES = 256 * 1024 * 1024


def _torch():
    try:
        import torch

        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


class L2Flusher:
    """Overwrites a buffer four times the H200's 60 MB L2 so the next kernel reads from HBM."""

    def __init__(self):
        self.buf = cuda.device_array(L2_FLUSH_BYTES // 4, np.float32)

    def __call__(self):
        _fill_kernel[1024, 256](self.buf, np.float32(1.0))


@cuda.jit
def _fill_kernel(a, value):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < a.size:
        a[i] = value
        i += stride


FLUSH_NAME = "_fill_kernel"


def kernel_times_cupti(torch, fn, flush, iters: int) -> float:
    """Median per-iteration GPU time (s) of the kernels `fn` launches, from torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    per_iter = []
    for _ in range(iters):
        flush()
        cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            cuda.synchronize()
        total_us = sum(
            e.device_time_total
            for e in prof.events()
            if e.device_type.name == "CUDA" and FLUSH_NAME not in e.name and "Memcpy" not in e.name and "Memset" not in e.name
        )
        per_iter.append(total_us * 1e-6)
    return statistics.median(per_iter)


def kernel_times_events(fn, flush, iters: int) -> float:
    """Median per-iteration time (s) with CUDA events around each launch (includes host launch gaps)."""
    start, stop = cuda.event(), cuda.event()
    times = []
    for _ in range(iters):
        flush()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cuda.event_elapsed_time(start, stop) * 1e-3)
    return statistics.median(times)


def torch_time(torch, fn, flush, iters: int) -> float:
    """Median time (s) of a torch op with CUDA events (torch launches are ~5 us; ops here are longer)."""
    times = []
    for _ in range(iters):
        flush()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    return statistics.median(times)


def measure_ceilings(torch) -> dict:
    """Copy bandwidth (bytes read + written per second) and, with torch, the bf16 matmul rate."""
    n = 1 << 30  # 1 GiB each way
    src = cuda.to_device(np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8))
    dst = cuda.device_array(n, np.uint8)
    start, stop = cuda.event(), cuda.event()
    times = []
    for _ in range(5):
        start.record()
        dst.copy_to_device(src)
        stop.record()
        stop.synchronize()
        times.append(cuda.event_elapsed_time(start, stop) * 1e-3)
    ceilings = {"copy_GBps": 2 * n / statistics.median(times) / 1e9, "fp32_TFLOPs": FP32_PEAK_TFLOPS}
    del src, dst
    if torch is not None:  # torch's copy kernel reaches more of the bandwidth than cuMemcpy: use the higher
        a = torch.empty(n // 4, dtype=torch.float32, device="cuda").uniform_()
        b = torch.empty_like(a)
        for _ in range(3):
            b.copy_(a)
        t = torch_time(torch, lambda: b.copy_(a), lambda: None, 10)
        ceilings["copy_GBps"] = max(ceilings["copy_GBps"], 2 * n / t / 1e9)
        del a, b
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        t = torch_time(torch, lambda: a @ b, lambda: None, 10)
        ceilings["bf16_mma_TFLOPs"] = 2 * 8192**3 / t / 1e12
    return ceilings


def _shape_text(shape) -> str:
    """A case's shape as short text: cases give either a string or a dict of sizes."""
    if isinstance(shape, dict):
        return " ".join(f"{k}={v}" for k, v in shape.items())
    return str(shape)


def all_cases() -> list[dict]:
    import bench_attention
    import bench_matmul
    import bench_pointwise

    return bench_matmul.cases() + bench_attention.cases() + bench_pointwise.cases()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=None, help="run only cases whose name contains this")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default=None, help="write the table as JSON here")
    args = ap.parse_args()

    torch = _torch()
    dev = cuda.get_current_device()
    ceilings = measure_ceilings(torch)
    flush = L2Flusher()
    timing = "CUPTI kernel time" if torch is not None else "CUDA events per launch (includes launch overhead)"
    print(f"# {dev.name.decode() if isinstance(dev.name, bytes) else dev.name}; timing: {timing}")
    print(
        f"# ceilings: copy {ceilings['copy_GBps']:.0f} GB/s, fp32 {ceilings['fp32_TFLOPs']:.0f} TFLOP/s (datasheet)"
        + (f", torch bf16 matmul {ceilings['bf16_mma_TFLOPs']:.0f} TFLOP/s" if "bf16_mma_TFLOPs" in ceilings else "")
    )
    rows = []
    for case in all_cases():
        if args.only and args.only not in case["name"]:
            continue
        for _ in range(3):  # compile and warm up
            case["run"]()
        cuda.synchronize()
        t = (
            kernel_times_cupti(torch, case["run"], flush, args.iters)
            if torch
            else kernel_times_events(case["run"], flush, args.iters)
        )
        t_torch = kernel_times_cupti(torch, case["torch"], flush, args.iters) if torch is not None and case.get("torch") else None
        gbps = case["bytes"] / t / 1e9
        tflops = case["flops"] / t / 1e12
        memory_bound = case["bytes"] / (ceilings["copy_GBps"] * 1e9) >= case["flops"] / (FP32_PEAK_TFLOPS * 1e12)
        frac = gbps / ceilings["copy_GBps"] if memory_bound else tflops / FP32_PEAK_TFLOPS
        row = dict(
            name=case["name"],
            shape=_shape_text(case["shape"]),
            us=t * 1e6,
            GBps=gbps,
            TFLOPs=tflops,
            bound="memory" if memory_bound else "fp32",
            of_ceiling=frac,
            torch_us=None if t_torch is None else t_torch * 1e6,
        )
        rows.append(row)
        print(
            f"{row['name']:<28} {row['shape']:<30} {row['us']:9.1f} us {gbps:8.0f} GB/s {tflops:7.2f} TFLOP/s "
            f"{100 * frac:5.1f}% of {row['bound']:<6}" + ("" if t_torch is None else f"  torch {t_torch * 1e6:8.1f} us"),
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"device": str(dev.name), "timing": timing, "ceilings": ceilings, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
