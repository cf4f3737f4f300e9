"""Write the new tokens' keys and values into the paged KV cache.

Each new token has a kv index ``kv_indices[t] = page_id * PAGE_SIZE + offset`` (int32), chosen by
the host when it allocated the sequence's pages. The kernel copies that token's K and V rows
(``(KVH, HD)`` float32 each) into ``k_cache[page_id, offset]`` and ``v_cache[page_id, offset]``,
rounding to bf16 (nearest even) on the store.

Thread mapping: a thread block per token (a grid-stride loop over tokens, so any number of tokens
fits a grid of at most ``MAX_BLOCKS``); its ``THREADS`` threads stride over the token's
``KVH * HD`` elements, so neighbouring threads write neighbouring bf16 elements of one cache row
(coalesced). No shared memory, no synchronisation: every element is written by one thread.

Why so plain: the traffic is tiny next to attention (a decode step writes ``B * KVH * HD * 4``
bytes per layer), so this kernel is latency-bound; a later issue fuses it into RoPE, which
already holds K in registers.

Every entry of ``kv_indices`` must be a valid kv index: a token that should not be stored
(padding) points at the null page 0, which attention never reads.
"""

from __future__ import annotations

from numba import cuda

from numba_vllm.bf16 import BF16
from numba_vllm.config import PAGE_SIZE
from numba_vllm.kernels.jit import kernel
from numba_vllm.kernels.launch import KernelError, check_array, launch

THREADS = 128  # threads per block: a token's K/V row is KVH * HD elements (512 for Llama 3.2 1B)
MAX_BLOCKS = 1024  # grid size cap; more tokens are covered by the grid-stride loop


@kernel
def cache_write_kernel(k, v, kv_indices, k_cache, v_cache):
    """k, v: (T, KVH, HD) f32; kv_indices: (T,) int32; k_cache, v_cache: (P, PAGE_SIZE, KVH, HD) bf16."""
    num_tokens, num_kv_heads, head_dim = k.shape
    row_size = num_kv_heads * head_dim
    t = cuda.blockIdx.x
    while t < num_tokens:
        slot = kv_indices[t]
        page = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        i = cuda.threadIdx.x
        while i < row_size:
            h = i // head_dim
            d = i % head_dim
            k_cache[page, offset, h, d] = k[t, h, d]  # float32 -> bf16, rounded to nearest even
            v_cache[page, offset, h, d] = v[t, h, d]
            i += cuda.blockDim.x
        t += cuda.gridDim.x


def cache_write(k, v, kv_indices, k_cache, v_cache) -> None:
    """Store k, v ``(T, KVH, HD)`` f32 at the kv indices ``kv_indices`` ``(T,)`` int32 of the
    bf16 cache pools ``k_cache``, ``v_cache`` ``(num_pages, PAGE_SIZE, KVH, HD)``."""
    check_array("k", k, "float32", ndim=3)
    num_tokens, num_kv_heads, head_dim = k.shape
    check_array("v", v, "float32", (num_tokens, num_kv_heads, head_dim))
    check_array("kv_indices", kv_indices, "int32", (num_tokens,))
    check_array("k_cache", k_cache, BF16, (None, PAGE_SIZE, num_kv_heads, head_dim))
    check_array("v_cache", v_cache, BF16, tuple(k_cache.shape))
    if num_tokens == 0:
        return
    if k_cache.shape[0] == 0:
        raise KernelError("k_cache: has no pages")
    launch(cache_write_kernel, min(num_tokens, MAX_BLOCKS), THREADS, k, v, kv_indices, k_cache, v_cache)
