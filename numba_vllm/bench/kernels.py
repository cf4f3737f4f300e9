"""Per-kernel roofline table on an NVIDIA GPU: time, achieved GB/s or TFLOP/s, against measured ceilings.

Each case (from matmul_cases.py, attention_cases.py, pointwise_cases.py) launches one operation on
preallocated device arrays holding random data. Kernel time is the GPU's own: when torch is
importable, its profiler (CUPTI) records every kernel's device duration, so the ~25-50 us a plain
numba launch costs on the host is not counted; without torch, CUDA events around a burst of launches
are used and the table says so. Before every timed launch the L2 cache is flushed by writing a buffer
larger than it, so weights are read from device memory as they are in a real decode step.

Ceilings are measured on the spot: device-to-device copy bandwidth (bytes read + written), and, with
torch, its bf16 matrix rate. A case is memory-bound when bytes / bandwidth exceeds flops / fp32 rate.

numba.cuda is imported inside the functions only, so importing this module never touches a GPU.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import numpy as np

from numba_vllm.bench.common import BenchError

FP32_PEAK_TFLOPS = 67.0  # H100/H200 SXM datasheet fp32 (non-tensor) rate: the ceiling of FMA-based kernels
L2_FLUSH_BYTES = 256 * 1024 * 1024
FLUSH_NAME = "_fill_kernel"


def torch_or_none():
    """torch, if it is importable and sees a GPU; else None (torch is optional everywhere here)."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def require_gpu() -> None:
    from numba_vllm.executor.backend import gpu_available

    if not gpu_available():
        raise BenchError("the kernel benchmark needs an NVIDIA GPU with a working driver; none is usable here")


_FILL = None


def _fill_kernel():
    """The L2 flush kernel, compiled on first use (defining it needs numba.cuda)."""
    global _FILL
    if _FILL is None:
        from numba import cuda

        @cuda.jit
        def _fill_kernel(a, value):
            i = cuda.grid(1)
            stride = cuda.gridsize(1)
            while i < a.size:
                a[i] = value
                i += stride

        _FILL = _fill_kernel
    return _FILL


class L2Flusher:
    """Overwrites a buffer four times the H200's 60 MB L2 so the next kernel reads from HBM."""

    def __init__(self):
        from numba import cuda

        self.buf = cuda.device_array(L2_FLUSH_BYTES // 4, np.float32)
        self.kernel = _fill_kernel()

    def __call__(self):
        self.kernel[1024, 256](self.buf, np.float32(1.0))


def kernel_times_cupti(torch, fn, flush, iters: int) -> float:
    """Median per-iteration GPU time (s) of the kernels `fn` launches, from torch's profiler."""
    from numba import cuda
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
    from numba import cuda

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


_SLEEP = None


def _sleep_kernel():
    """A one-thread kernel that sleeps ``microseconds`` (``nanosleep``), compiled on first use."""
    global _SLEEP
    if _SLEEP is None:
        from numba import cuda

        @cuda.jit
        def _sleep_kernel(microseconds):
            for _ in range(microseconds):
                cuda.nanosleep(1000)

        _SLEEP = _sleep_kernel
    return _SLEEP


def kernel_times_behind_sleep(fn, flush, iters: int, sleep_us: int = 200) -> float:
    """Median GPU time (s) of ``fn`` (numba or torch launches on the default stream): an L2 flush, a
    kernel that sleeps ``sleep_us``, then CUDA events around ``fn``. The host enqueues ``fn`` while
    the GPU sleeps, so the events time the GPU's work, the gaps between ``fn``'s own kernels
    included, and not the host's launch cost. Three untimed rounds first."""
    from numba import cuda

    start, stop = cuda.event(), cuda.event()
    times = []
    for _ in range(iters + 3):
        flush()
        _sleep_kernel()[1, 1](sleep_us)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cuda.event_elapsed_time(start, stop) * 1e-3)
    return statistics.median(times[3:])


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
    from numba import cuda

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
    from numba_vllm.bench import attention_cases, matmul_cases, pointwise_cases

    return matmul_cases.cases() + attention_cases.cases() + pointwise_cases.cases()


def format_row(row: dict) -> str:
    return (
        f"{row['name']:<28} {row['shape']:<30} {row['us']:9.1f} us {row['GBps']:8.0f} GB/s {row['TFLOPs']:7.2f} TFLOP/s "
        f"{100 * row['of_ceiling']:5.1f}% of {row['bound']:<6}"
        + ("" if row["torch_us"] is None else f"  torch {row['torch_us']:8.1f} us")
    )


def run_kernels(only: str | None = None, iters: int = 30, emit: Callable[[str], None] = print) -> dict:
    """Time every case (or those whose name contains `only`); `emit` gets the header and each row as
    it is measured. Returns {device, timing, ceilings, rows}."""
    if iters < 1:
        raise BenchError(f"iterations must be >= 1, got {iters}")
    require_gpu()
    from numba import cuda

    torch = torch_or_none()
    dev = cuda.get_current_device()
    device = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    ceilings = measure_ceilings(torch)
    flush = L2Flusher()
    timing = "CUPTI kernel time" if torch is not None else "CUDA events per launch (includes launch overhead)"
    emit(f"# {device}; timing: {timing}")
    emit(
        f"# ceilings: copy {ceilings['copy_GBps']:.0f} GB/s, fp32 {ceilings['fp32_TFLOPs']:.0f} TFLOP/s (datasheet)"
        + (f", torch bf16 matmul {ceilings['bf16_mma_TFLOPs']:.0f} TFLOP/s" if "bf16_mma_TFLOPs" in ceilings else "")
    )
    cases = [c for c in all_cases() if not only or only in c["name"]]
    if not cases:
        raise BenchError(f"no kernel case name contains {only!r}")
    rows = []
    for case in cases:
        for _ in range(3):  # compile and warm up
            case["run"]()
        cuda.synchronize()
        t = kernel_times_cupti(torch, case["run"], flush, iters) if torch else kernel_times_events(case["run"], flush, iters)
        t_torch = kernel_times_cupti(torch, case["torch"], flush, iters) if torch is not None and case.get("torch") else None
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
        emit(format_row(row))
    return {"benchmark": "kernels", "device": device, "timing": timing, "iters": iters, "ceilings": ceilings, "rows": rows}
