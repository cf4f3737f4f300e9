"""Benchmark cases for the attention kernels (paged decode, paged causal prefill), for `numba-vllm bench kernels`.

Shapes are Llama 3.2 1B's attention (32 query heads, 8 kv heads, head dim 64) over a bf16 paged
KV cache whose pages are a random permutation of the pool, as after a while of serving.

``bytes`` is the least a kernel must move: every cached K/V element of the sequences once (bf16),
q read and out written once (f32); the block tables are noise. ``flops``: 2 per multiply-add of
Q K^T and of P V (causal: only the visible keys). The ``torch`` callables run PyTorch's
``scaled_dot_product_attention`` (flash kernels, tensor cores) in bf16 on K/V gathered into
contiguous tensors beforehand (gather not timed): the best case a paged kernel is compared with.

Decode cases run each of ``DECODE_ATTENTIONS`` (``tensor_cores``: ``decode_attention_tc``, the
model's, named ``decode_attention_tc_*``; ``fast``: ``decode_attention_fast``, ``decode_attention_fast_*``;
``reference``: ``decode_attention``) on the same inputs, at batch 1 (256, 1,024 and 16,384 tokens),
32 x 4,096, 64 x 1,024 and 256 x 512.

Prefill cases run each of ``PREFILL_ATTENTIONS`` (``cuda_cores``: ``prefill_attention``;
``tensor_cores``: ``prefill_attention_tc``, named ``prefill_attention_tc_*``; ``wgmma``:
``prefill_attention_wgmma``, on an H100 or H200 only) on the same inputs:
prompts of 2048, 8 x 512 and 16384 tokens, and a 2048-token chunk after a 14,000-token cached
prefix (chunked prefill of a long prompt), for which torch attends with a lower-right causal mask
over K/V expanded to all 32 heads (``causal_lower_right`` with GQA is not a flash path in every
torch version).
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from numba_vllm.bench.kernels import torch_or_none
from numba_vllm.kernels._launch import hopper
from numba_vllm.loading.bf16 import bf16_from_bits, upload_bf16
from numba_vllm.model.config import PAGE_SIZE
from numba_vllm.model.llama import DECODE_ATTENTIONS, PREFILL_ATTENTIONS, attention_workspace_floats
from numba_vllm.sim.warp import simulator_enabled

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 64  # Llama 3.2 1B


def _random_cache(rng, seq_lens):
    """Device (k_cache, v_cache, block_tables) with random bf16 data and shuffled page ids."""
    pages = [-(-n // PAGE_SIZE) for n in seq_lens]
    num_pages = 1 + sum(pages)
    page_ids = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    block_tables = np.zeros((len(seq_lens), max(pages)), np.int32)
    used = 0
    for s, n in enumerate(pages):
        block_tables[s, :n] = page_ids[used : used + n]
        used += n
    shape = (num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    caches = []
    for _ in range(2):
        bits = (rng.standard_normal(shape, np.float32).view(np.uint32) >> 16).astype(np.uint16)  # truncated to bf16
        caches.append(upload_bf16(bf16_from_bits(bits)))
    return caches[0], caches[1], block_tables


def _gathered_torch(torch, k_cache, v_cache, block_tables, seq_len):
    """K/V of each sequence contiguous, (S, KVH, seq_len, HD) bf16 torch tensors (all of one length)."""

    def gather(cache):
        pool = torch.as_tensor(cache.view(np.uint16), device="cuda").view(torch.bfloat16)
        idx = torch.as_tensor(block_tables, device="cuda").long()  # (S, pages)
        seq = pool[idx].flatten(1, 2)[:, :seq_len]  # (S, seq_len, KVH, HD)
        return seq.transpose(1, 2).contiguous()

    return gather(k_cache), gather(v_cache)




def decode_case(batch: int, context: int, kernel: str = "tensor_cores", seed: int = 0) -> dict:
    """``batch`` sequences of ``context`` cached tokens, one query each, attended by ``kernel`` (one
    of ``DECODE_ATTENTIONS``)."""
    rng = np.random.default_rng(seed)
    k_cache, v_cache, tables = _random_cache(rng, [context] * batch)
    q = cuda.to_device(rng.standard_normal((batch, NUM_HEADS, HEAD_DIM), np.float32))
    out = cuda.device_array((batch, NUM_HEADS, HEAD_DIM), np.float32)
    block_tables = cuda.to_device(tables)
    context_lens = cuda.to_device(np.full(batch, context, np.int32))
    scale = 1.0 / np.sqrt(HEAD_DIM)
    workspace = cuda.device_array(attention_workspace_floats(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM), np.float32)

    attention = DECODE_ATTENTIONS[kernel]

    def run():
        attention(q, k_cache, v_cache, block_tables, context_lens, scale, out, workspace)

    torch_run = None
    torch = torch_or_none()
    if torch is not None:
        kt, vt = _gathered_torch(torch, k_cache, v_cache, tables, context)
        qt = torch.randn(batch, NUM_HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)

        def torch_run():
            torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, scale=scale, enable_gqa=True)

    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2
    return {
        "name": f"decode_attention{ {'tensor_cores': '_tc', 'fast': '_fast'}.get(kernel, '')}_{batch}x{context}",
        "shape": f"B{batch} ctx{context} H{NUM_HEADS}/{NUM_KV_HEADS} HD{HEAD_DIM}",
        "run": run,
        "bytes": kv_bytes + 2 * batch * NUM_HEADS * HEAD_DIM * 4,
        "flops": 4 * batch * NUM_HEADS * context * HEAD_DIM,
        "torch": torch_run,
    }


def prefill_case(num_seqs: int, prompt: int, start: int = 0, kernel: str = "cuda_cores", seed: int = 0) -> dict:
    """``num_seqs`` sequences of ``prompt`` new tokens each after ``start`` cached ones, attended by
    the ``kernel`` of ``PREFILL_ATTENTIONS``."""
    rng = np.random.default_rng(seed)
    context = start + prompt
    k_cache, v_cache, tables = _random_cache(rng, [context] * num_seqs)
    tokens = num_seqs * prompt
    q = cuda.to_device(rng.standard_normal((tokens, NUM_HEADS, HEAD_DIM), np.float32))
    out = cuda.device_array((tokens, NUM_HEADS, HEAD_DIM), np.float32)
    block_tables = cuda.to_device(tables)
    cu_seqlens = cuda.to_device(np.arange(0, tokens + 1, prompt, dtype=np.int32))
    start_pos = cuda.to_device(np.full(num_seqs, start, np.int32))
    scale = 1.0 / np.sqrt(HEAD_DIM)
    attention = PREFILL_ATTENTIONS[kernel]

    def run():
        attention(q, k_cache, v_cache, block_tables, cu_seqlens, start_pos, scale, out, max_new_tokens=prompt)

    torch_run = None
    torch = torch_or_none()
    if torch is not None:
        kt, vt = _gathered_torch(torch, k_cache, v_cache, tables, context)
        qt = torch.randn(num_seqs, NUM_HEADS, prompt, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if start == 0:

            def torch_run():
                sdpa(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)

        else:
            from torch.nn.attention.bias import causal_lower_right

            group = NUM_HEADS // NUM_KV_HEADS
            kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
            mask = causal_lower_right(prompt, context)

            def torch_run():
                sdpa(qt, kt, vt, attn_mask=mask, scale=scale)

    visible = num_seqs * (prompt * start + prompt * (prompt + 1) // 2)  # (query, key) pairs under the causal mask
    prefix = f"_after{start}" if start else ""
    name = {"cuda_cores": "prefill_attention", "tensor_cores": "prefill_attention_tc"}.get(kernel, f"prefill_attention_{kernel}")
    return {
        "name": f"{name}_{num_seqs}x{prompt}{prefix}",
        "shape": f"S{num_seqs} new{prompt} cached{start} H{NUM_HEADS}/{NUM_KV_HEADS} HD{HEAD_DIM}",
        "run": run,
        "bytes": 2 * num_seqs * context * NUM_KV_HEADS * HEAD_DIM * 2 + 2 * tokens * NUM_HEADS * HEAD_DIM * 4,
        "flops": 4 * NUM_HEADS * HEAD_DIM * visible,
        "torch": torch_run,
    }


# (sequences, cached tokens): batch 1 short and long (a chat; a 16K context, split over the GPU), a mid
# batch at 4K, full grids at 1K and 512
DECODE_SHAPES = [(64, 1024), (1, 1024), (1, 256), (1, 16384), (32, 4096), (256, 512)]
PREFILL_SHAPES = [(1, 2048, 0), (8, 512, 0), (1, 16384, 0), (1, 2048, 14000)]  # (sequences, new tokens, cached)


def cases() -> list[dict]:
    return [
        decode_case(*shape, kernel=kernel) for shape in DECODE_SHAPES for kernel in DECODE_ATTENTIONS
    ] + [prefill_case(*shape, kernel=kernel) for shape in PREFILL_SHAPES for kernel in PREFILL_ATTENTIONS
         if kernel != "wgmma" or hopper() or simulator_enabled()]  # fmt: skip
