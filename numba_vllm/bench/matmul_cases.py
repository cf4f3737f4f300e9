"""Benchmark cases for the matrix products (gemv, gemm, gemm_tc, gemm_wgmma), timed by `numba-vllm bench kernels`.

    numba-vllm bench kernels --only gemv           # the harness (kernels.py): CUPTI kernel time, L2 flushed
    python benchmarks/bench_matmul.py               # `main` below: same timing, plus the gemv/gemm crossover

Shapes are Llama 3.2 1B's (hidden 2048, MLP 8192, vocabulary 128256): W (N, K) = 2048x2048
(q/o_proj), 8192x2048 (gate/up), 2048x8192 (down_proj), 128256x2048 (the head), at batch 1, 8 and
32 for gemv, one prefill-sized product for gemm, gemm_tc and gemm_wgmma (M = 4096 tokens), and
gemm_tc and gemm_wgmma at 64, 128, 256 and 512 rows (decode batches past gemv, a short prefill) on
every weight shape and on the fused gate/up projection (16384x2048). ``bytes`` is the least a
kernel must move: the weights once, x once, out once. ``flops`` = 2 M N K.

The torch comparison does the nearest op torch has: ``F.linear`` on bf16 activations and bf16
weights for gemv, gemm_tc and gemm_wgmma (same weight bytes; cuBLAS picks its GEMV, or its
tensor-core GEMM, which skips the fp32 -> bf16 rounding of x that gemm_tc does in-kernel and
gemm_wgmma in a kernel of its own, counted in its time), and float32 x float32 for gemm (cuBLAS
SGEMM, the same FMA units our kernel uses).
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from numba_vllm.bench.kernels import torch_or_none
from numba_vllm.kernels.gemm import gemm
from numba_vllm.kernels.gemm_tc import gemm_tc
from numba_vllm.kernels.gemm_wgmma import gemm_wgmma
from numba_vllm.kernels.gemv import MAX_TOKENS as GEMV_MAX_ROWS
from numba_vllm.kernels.gemv import gemv
from numba_vllm.loading.bf16 import BF16, bf16_bits, to_bf16, upload_bf16

WEIGHT_SHAPES = [(2048, 2048), (2048, 8192), (8192, 2048), (128256, 2048)]  # (N, K)
GEMV_BATCHES = [1, 8, 32]
GEMM_SHAPE = (4096, 8192, 2048)  # (M, N, K)
CROSSOVER_SHAPE = (8192, 2048)  # (N, K) for gemv vs gemm at M = 8..64
CROSSOVER_TOKENS = [8, 16, 32, 64, 128]
TC_TOKENS = [64, 128, 256, 512]  # tensor-core GEMM rows on the weight shapes: decode batches past gemv, a short prefill
TC_WEIGHT_SHAPES = WEIGHT_SHAPES + [(16384, 2048)]  # + gate/up fused (N, K)
_WEIGHTS: dict = {}  # (N, K) -> (host bf16, device bf16): one upload per weight shape


class _Operands:
    """Device arrays for one product, random values; weights shared between cases of one shape."""

    def __init__(self, m: int, n: int, k: int, seed: int):
        rng = np.random.default_rng(seed)
        if (n, k) not in _WEIGHTS:
            w = (rng.standard_normal((n, k), dtype=np.float32) * 0.02).astype(BF16)
            _WEIGHTS[(n, k)] = (w, upload_bf16(w))
        self.w_host, self.w = _WEIGHTS[(n, k)]  # (N, K) bf16
        self.x_host = rng.standard_normal((m, k), dtype=np.float32)
        self.x = cuda.to_device(self.x_host)  # (M, K) f32
        self.out = cuda.to_device(np.zeros((m, n), np.float32))  # (M, N) f32


def torch_linear(torch, ops: _Operands, dtype, accumulate: bool = False):
    """A zero-arg callable computing the same product in torch with `dtype` operands (``accumulate``:
    out += x @ w.T, cuBLAS reading out in its epilogue, as the residual products do)."""
    x = torch.from_numpy(ops.x_host).to("cuda", dtype)
    w = torch.from_numpy(ops.w_host.view(np.int16)).to("cuda").view(torch.bfloat16).to(dtype)
    out = torch.zeros((x.shape[0], w.shape[0]), device="cuda", dtype=dtype)
    if accumulate:
        return lambda: out.addmm_(x, w.T)
    return lambda: torch.matmul(x, w.T, out=out)


def _case(name: str, launcher, m: int, n: int, k: int, torch, torch_dtype, seed: int) -> dict:
    ops = _Operands(m, n, k, seed)
    return {
        "name": name,
        "shape": f"M={m} N={n} K={k}",
        "run": lambda: launcher(ops.x, ops.w, ops.out),
        "bytes": n * k * 2 + m * k * 4 + m * n * 4,
        "flops": 2 * m * n * k,
        "torch": None if torch is None else torch_linear(torch, ops, torch_dtype),
    }


_WGMMA_PARTS: list = []  # one split-K workspace for every gemm_wgmma case (made at the first)


def wgmma_operands(m: int, n: int, k: int, seed: int):
    """(ops, workspace, x_copy): a product set up as the model runs gemm_wgmma, x's bf16 copy already
    written (by the norm or SwiGLU before the product: ``x_copy``, (M * K,) uint16), split-K parts
    and counters in ``workspace`` (shared by every call here). Call ``gemm_wgmma(ops.x, ops.w, ops.out,
    workspace=workspace, x_copy=x_copy)``: ops.x is read for its shape only."""
    from numba_vllm.kernels._launch import num_sms
    from numba_vllm.kernels.gemm_tc import split_workspace_floats
    from numba_vllm.kernels.gemm_wgmma import TILE_COUNTERS
    from numba_vllm.kernels.matmul import GemmWorkspace

    if not _WGMMA_PARTS:
        _WGMMA_PARTS.extend((cuda.device_array(split_workspace_floats(num_sms()), np.float32),
                             cuda.to_device(np.zeros(TILE_COUNTERS, np.int32))))  # fmt: skip
    ops = _Operands(m, n, k, seed)
    x_copy = cuda.to_device(bf16_bits(to_bf16(ops.x_host)).reshape(-1))
    return ops, GemmWorkspace(partials=_WGMMA_PARTS[0], x_bf16=x_copy, tile_counters=_WGMMA_PARTS[1]), x_copy


def _wgmma_case(name: str, m: int, n: int, k: int, torch, torch_dtype, seed: int) -> dict:
    """gemm_wgmma as the model runs it (``wgmma_operands``). The conversion pass that only the o
    product still needs is its own case (``x_to_bf16``)."""
    ops, workspace, x_copy = wgmma_operands(m, n, k, seed)
    return {
        "name": name,
        "shape": f"M={m} N={n} K={k}",
        "run": lambda: gemm_wgmma(ops.x, ops.w, ops.out, workspace=workspace, x_copy=x_copy),
        "bytes": n * k * 2 + m * k * 2 + m * n * 4,  # x read as bf16
        "flops": 2 * m * n * k,
        "torch": None if torch is None else torch_linear(torch, ops, torch_dtype),
    }


def cases() -> list[dict]:
    """gemv at batch 1/8/32 on the four weight shapes; gemm, gemm_tc and gemm_wgmma at M=4096, N=8192,
    K=2048; gemm_tc and gemm_wgmma at M = 64 .. 512 on the weight shapes and the gate/up projection."""
    torch = torch_or_none()
    bf16 = None if torch is None else torch.bfloat16
    f32 = None if torch is None else torch.float32
    out = []
    for n, k in WEIGHT_SHAPES:
        for m in GEMV_BATCHES:
            out.append(_case(f"gemv_b{m}", gemv, m, n, k, torch, bf16, seed=n + k + m))
    m, n, k = GEMM_SHAPE
    out.append(_case("gemm", gemm, m, n, k, torch, f32, seed=1))
    out.append(_case("gemm_tc", gemm_tc, m, n, k, torch, bf16, seed=1))
    out.append(_wgmma_case("gemm_wgmma", m, n, k, torch, bf16, seed=1))
    out.append(_conversion_case(m, k))
    for n, k in TC_WEIGHT_SHAPES:
        for m in TC_TOKENS:
            out.append(_case(f"gemm_tc_m{m}", gemm_tc, m, n, k, torch, bf16, seed=n + k + m))
            out.append(_wgmma_case(f"gemm_wgmma_m{m}", m, n, k, torch, bf16, seed=n + k + m))
    return out


def _conversion_case(m: int, k: int) -> dict:
    """x (M, K) f32 rounded to bf16 into gemm_wgmma's workspace: the pass a product pays when no kernel
    before it wrote x's bf16 copy (in a Llama layer, only the o product's)."""
    from numba_vllm.kernels._launch import launch, num_sms
    from numba_vllm.kernels.gemm_wgmma import CONVERT_THREADS, _default_x_workspace, _x_to_bf16_kernel, _x_views

    x = cuda.to_device(np.random.default_rng(m).standard_normal((m, k), dtype=np.float32))
    pairs = _x_views(_default_x_workspace(), m, k)[1]
    blocks = min(-(-pairs.size // CONVERT_THREADS), 8 * num_sms())
    return {
        "name": "x_to_bf16",
        "shape": f"M={m} K={k}",
        "run": lambda: launch(_x_to_bf16_kernel, blocks, CONVERT_THREADS, x, pairs),
        "bytes": m * k * 6,
        "flops": 0,
        "torch": None,
    }


def crossover_cases() -> list[dict]:
    """gemv, gemm and gemm_tc on one weight shape at M = 8..128: where matmul.GEMV_MAX_TOKENS should sit."""
    n, k = CROSSOVER_SHAPE
    out = []
    for m in CROSSOVER_TOKENS:
        if m <= GEMV_MAX_ROWS:
            out.append(_case(f"x_gemv_b{m}", gemv, m, n, k, None, None, seed=m))
        out.append(_case(f"x_gemm_b{m}", gemm, m, n, k, None, None, seed=m))
        out.append(_case(f"x_gemm_tc_b{m}", gemm_tc, m, n, k, None, None, seed=m))
    return out


def main() -> None:
    """Time every case and the crossover cases (needs a GPU), one line each."""
    from numba_vllm.bench import kernels

    kernels.require_gpu()
    torch = torch_or_none()
    flush = kernels.L2Flusher()
    for case in cases() + crossover_cases():
        for _ in range(3):
            case["run"]()
        cuda.synchronize()
        if torch is not None:
            t = kernels.kernel_times_cupti(torch, case["run"], flush, 20)
        else:
            t = kernels.kernel_times_events(case["run"], flush, 20)
        t_torch = kernels.torch_time(torch, case["torch"], flush, 20) if case["torch"] and torch else None
        print(
            f"{case['name']:<14} {case['shape']:<26} {t * 1e6:9.1f} us {case['bytes'] / t / 1e9:7.0f} GB/s "
            f"{case['flops'] / t / 1e12:6.2f} TFLOP/s" + ("" if t_torch is None else f"   torch {t_torch * 1e6:8.1f} us"),
            flush=True,
        )
