"""Benchmark cases for the pointwise and row kernels at Llama 3.2 1B sizes (needs a GPU).

``cases()`` returns one dict per (kernel, size):

    name   "rms_norm T=64"
    shape  the sizes, e.g. {"T": 64, "D": 2048}
    run    zero-argument callable: one launch (through the public launcher, so its argument checks
           are included) on preallocated device arrays holding random data
    bytes  the minimum bytes the operation must move to and from device memory (each input read
           once, each output written once), for an achieved-bandwidth figure
    flops  floating-point operations (0 for a pure copy; transcendental calls count as one)
    torch  zero-argument callable doing the same operation with PyTorch on the GPU, on its own
           random tensors of the same shapes and dtypes, or None when torch (with CUDA) is missing

The timing harness (warm-up, synchronisation, repetitions) is the caller's. Every kernel here is
memory-bound: compare bytes / time with the H200's ~4.8 TB/s (a device copy reaches ~4.2).
Sizes: T = 1 (decode), 64 (a decode batch or short prompt), 4096 (a long prefill) rows; the
samplers use B = 1, 64 and 256 rows of the full vocabulary (decode batches, where sampling runs);
logprobs (top LOGPROBS_K) B = 1 and 32 rows, the cost a batch pays when every request asks for them.
Some runs update their inputs in place (add_rms_norm keeps adding to the residual); values stay
bounded over any practical number of repetitions.
"""

from __future__ import annotations

import time

import numpy as np

from numba_vllm.bench.kernels import torch_or_none

D = 2048  # hidden size
F = 8192  # MLP width
H = 32  # query heads
KVH = 8  # key/value heads
HD = 64  # head dim
V = 128256  # vocabulary
EPS = 1e-5
ROWS = (1, 64, 4096)
LLAMA_3_2_1B_ROPE = {  # the parts of Llama 3.2 1B's config.json that rope_inv_freq reads
    "hidden_size": D,
    "num_hidden_layers": 16,
    "num_attention_heads": H,
    "num_key_value_heads": KVH,
    "head_dim": HD,
    "intermediate_size": F,
    "vocab_size": V,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}
SAMPLE_ROWS = (1, 64, 256)
LOGPROBS_ROWS = (1, 32)
LOGPROBS_K = 5


def cases() -> list[dict]:
    from numba import cuda

    from numba_vllm.kernels.activation import silu_and_mul
    from numba_vllm.kernels.embedding import embedding
    from numba_vllm.kernels.logprobs import logprobs
    from numba_vllm.kernels.rmsnorm import add_rms_norm, rms_norm
    from numba_vllm.kernels.rope import rope_and_cache_write
    from numba_vllm.kernels.sample import argmax, sample_gumbel
    from numba_vllm.loading.bf16 import BF16, empty_bf16_device, upload_bf16
    from numba_vllm.model.config import ModelConfig
    from numba_vllm.model.rope_scaling import rope_inv_freq

    rng = np.random.default_rng(0)
    torch = torch_or_none()

    def randn(*shape):
        return cuda.to_device(rng.standard_normal(shape, dtype=np.float32))

    def trandn(*shape, dtype=None):
        return torch.randn(*shape, device="cuda", dtype=dtype or torch.float32)

    out = []

    # embedding: the table's content does not matter to a gather; random bits of finite bf16 numbers
    # (exponents 2**-31 .. 2**0, random signs) are quicker to make than 262M normal draws.
    bits = rng.integers(0x3000, 0x4000, (V, D), dtype=np.uint16) | (rng.integers(0, 2, (V, D), dtype=np.uint16) << 15)
    table = upload_bf16(bits.view(BF16))  # (V, D) bf16
    torch_table = trandn(V, D, dtype=torch.bfloat16) if torch else None
    for t in ROWS:
        ids = cuda.to_device(rng.integers(0, V, t, dtype=np.int32))  # (T,)
        x = cuda.device_array((t, D), np.float32)
        torch_ids = torch.randint(0, V, (t,), device="cuda") if torch else None
        out.append(
            {
                "name": f"embedding T={t}",
                "shape": {"T": t, "V": V, "D": D},
                "run": lambda ids=ids, x=x: embedding(ids, table, x),
                "bytes": t * D * (2 + 4) + t * 4,
                "flops": 0,
                "torch": (lambda i=torch_ids: torch.nn.functional.embedding(i, torch_table).float()) if torch else None,
            }
        )

    # rms_norm and add_rms_norm
    weight = upload_bf16(1.0 + 0.1 * rng.standard_normal(D).astype(np.float32))  # (D,) bf16
    torch_weight = (1.0 + 0.1 * trandn(D)) if torch else None
    for t in ROWS:
        x, residual, y = randn(t, D), randn(t, D), cuda.device_array((t, D), np.float32)
        tx, tres = (trandn(t, D), trandn(t, D)) if torch else (None, None)
        out.append(
            {
                "name": f"rms_norm T={t}",
                "shape": {"T": t, "D": D},
                "run": lambda x=x, y=y: rms_norm(x, weight, y, EPS),
                "bytes": 2 * t * D * 4 + D * 2,
                "flops": 4 * t * D,
                "torch": (lambda x=tx: torch.nn.functional.rms_norm(x, (D,), torch_weight, EPS)) if torch else None,
            }
        )
        out.append(
            {
                "name": f"add_rms_norm T={t}",
                "shape": {"T": t, "D": D},
                "run": lambda x=x, r=residual, y=y: add_rms_norm(x, r, weight, y, EPS),
                "bytes": 4 * t * D * 4 + D * 2,
                "flops": 5 * t * D,
                "torch": (lambda x=tx, r=tres: torch.nn.functional.rms_norm(r.add_(x), (D,), torch_weight, EPS))
                if torch
                else None,
            }
        )

    # rope on the fused q/k/v product, k and v stored into a paged bf16 cache, with Llama 3.2's scaled frequencies
    inv_freq_host = rope_inv_freq(ModelConfig.from_dict(LLAMA_3_2_1B_ROPE))  # (HD/2,) float32
    inv_freq = cuda.to_device(inv_freq_host)
    for t in ROWS:
        qkv, q = randn(t, H + 2 * KVH, HD), cuda.device_array((t, H, HD), np.float32)
        num_pages = 1 + -(-t // 16)
        k_cache, v_cache = (empty_bf16_device((num_pages, 16, KVH, HD)) for _ in range(2))
        kv_indices = cuda.to_device(np.arange(16, 16 + t, dtype=np.int32))
        positions = cuda.to_device(rng.integers(0, 131072, t, dtype=np.int32))
        torch_rope = None
        if torch:
            tq, tk = trandn(t, H, HD), trandn(t, KVH, HD)
            tpos = torch.randint(0, 131072, (t,), device="cuda", dtype=torch.int32)
            tinv = torch.as_tensor(inv_freq_host, device="cuda")

            def torch_rope(q=tq, k=tk, p=tpos, f=tinv):
                return _torch_rope(torch, q, k, p, f)

        out.append(
            {
                "name": f"rope+cache_write T={t}",
                "shape": {"T": t, "H": H, "KVH": KVH, "HD": HD},
                "run": lambda qkv=qkv, q=q, p=positions, i=kv_indices, kc=k_cache, vc=v_cache: rope_and_cache_write(
                    qkv, p, inv_freq, i, q, kc, vc
                ),
                "bytes": t * (H + 2 * KVH) * HD * 4 + t * H * HD * 4 + 2 * t * KVH * HD * 2 + 2 * t * 4 + HD // 2 * 4,
                "flops": 3 * t * (H + KVH) * HD,  # 4 multiplies and 2 adds per rotated channel pair
                "torch": torch_rope,  # rotation only (no cache store)
            }
        )

    # silu_and_mul on the fused (T, 2F) gate/up product
    for t in ROWS:
        gate_up, y = randn(t, 2 * F), cuda.device_array((t, F), np.float32)
        tgu = trandn(t, 2 * F) if torch else None
        out.append(
            {
                "name": f"silu_and_mul T={t}",
                "shape": {"T": t, "F": F},
                "run": lambda g=gate_up, y=y: silu_and_mul(g, y),
                "bytes": 3 * t * F * 4,
                "flops": 5 * t * F,  # negate, exp, add, divide, multiply
                "torch": (lambda g=tgu: torch.nn.functional.silu(g[:, :F]) * g[:, F:]) if torch else None,
            }
        )

    # greedy argmax and Gumbel-max sampling over the full vocabulary
    for b in SAMPLE_ROWS:
        logits, token_ids = randn(b, V), cuda.device_array(b, np.int32)
        temperatures = cuda.to_device(np.full(b, 0.8, np.float32))
        seeds = cuda.to_device(rng.integers(0, 2**32, b, dtype=np.uint32))
        steps = cuda.to_device(np.arange(b, dtype=np.int32))
        tlogits = trandn(b, V) if torch else None
        out.append(
            {
                "name": f"argmax B={b}",
                "shape": {"B": b, "V": V},
                "run": lambda x=logits, y=token_ids: argmax(x, y),
                "bytes": b * V * 4 + b * 4,
                "flops": b * V,  # one comparison per logit
                "torch": (lambda x=tlogits: torch.argmax(x, dim=-1)) if torch else None,
            }
        )
        out.append(
            {
                "name": f"sample_gumbel B={b}",
                "shape": {"B": b, "V": V},
                "run": lambda x=logits, t=temperatures, s=seeds, st=steps, y=token_ids: sample_gumbel(x, t, s, st, y),
                "bytes": b * V * 4 + b * 16,
                "flops": 5 * b * V,  # divide, two logs, negate-add, compare (hash: integer)
                "torch": (lambda x=tlogits: _torch_sample(torch, x, 0.8)) if torch else None,
            }
        )

    # logprobs: each row's token logprob and rank, and its top k (two passes over the row)
    for b in LOGPROBS_ROWS:
        logits, k = randn(b, V), LOGPROBS_K
        rows, token_ids = cuda.to_device(np.arange(b, dtype=np.int32)), cuda.to_device(rng.integers(0, V, b).astype(np.int32))
        out_logprobs, out_ids = cuda.device_array((b, k + 1), np.float32), cuda.device_array((b, k + 1), np.int32)
        tlogits = trandn(b, V) if torch else None
        out.append(
            {
                "name": f"logprobs B={b} k={k}",
                "shape": {"B": b, "V": V, "k": k},
                "run": lambda x=logits, r=rows, t=token_ids, lp=out_logprobs, i=out_ids: logprobs(x, r, t, LOGPROBS_K, lp, i),
                "bytes": b * V * 4 + b * (k + 1) * 8,
                "flops": 3 * b * V,  # max, exp-and-add, compare
                "torch": (lambda x=tlogits: _torch_logprobs(torch, x, LOGPROBS_K)) if torch else None,
            }
        )
    return out


def _torch_rope(torch, q, k, positions, inv_freq):
    """Hugging Face's rotate-half RoPE on q (T, H, HD) and k (T, KVH, HD); returns new tensors."""
    angles = positions.float()[:, None] * inv_freq[None, :]  # (T, HD/2)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :]  # (T, 1, HD)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :]

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _torch_sample(torch, logits, temperature):
    """vLLM's sampler without top-k/top-p: softmax, then argmax(p / Exp(1)) (Gumbel-max in disguise)."""
    probs = torch.softmax(logits / temperature, dim=-1)
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)


def _torch_logprobs(torch, logits, k):
    """vLLM's logprobs: log-softmax of the row, its top k, and the rank of token 0 (a stand-in)."""
    lp = torch.log_softmax(logits, dim=-1)
    top = lp.topk(k, dim=-1)
    rank = (lp >= lp[:, :1]).sum(dim=-1)
    return top, rank


def _seconds_per_call(fn, sync, repeats: int = 50) -> float:
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats


def _device_us_per_call(torch, fn, repeats: int = 20) -> float:
    """GPU time of one call (all its kernels), from the CUDA activity torch's profiler records."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0) / repeats


def main() -> None:
    """A quick look without the harness (needs a GPU): wall time per call, and with torch the GPU time."""
    from numba import cuda

    from numba_vllm.bench.kernels import require_gpu

    require_gpu()
    torch = torch_or_none()
    print("wall: per call, launch overhead included; gpu: kernel time from torch's profiler (if torch)")
    for case in cases():
        seconds = _seconds_per_call(case["run"], cuda.synchronize)
        line = f"{case['name']:22s} numba wall {seconds * 1e6:7.1f} us"
        if torch is not None:
            gpu_us = _device_us_per_call(torch, case["run"])
            torch_us = _device_us_per_call(torch, case["torch"])
            line += f" gpu {gpu_us:7.1f} us {case['bytes'] / gpu_us / 1e3:7.1f} GB/s"
            line += f" | torch gpu {torch_us:7.1f} us {case['bytes'] / torch_us / 1e3:7.1f} GB/s"
        print(line, flush=True)
