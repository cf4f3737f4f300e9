"""Capacity planning: KV pages, max_model_len and the step's device buffers, decided in one function.

Figures are worked out by hand for Llama 3.2 1B (16 layers, hidden 2048, 32 heads, 8 kv heads of 64,
MLP 8192, vocabulary 128256, 131072 positions) on an H200-sized GPU (132 SMs).
"""

from pathlib import Path

import pytest

from numba_vllm.engine.config import EngineConfig
from numba_vllm.executor.capacity import (
    DEFAULT_MAX_MODEL_LEN_CPU,
    HOST_CACHE_SEQUENCES,
    max_step_tokens,
    num_pages_for_memory,
    page_bytes,
    plan_capacity,
    step_budget,
)
from numba_vllm.model.config import ConfigError, ModelConfig
from numba_vllm.model.llama import buffer_bytes

LLAMA_1B = ModelConfig.from_dir(Path(__file__).parent / "data" / "llama-3.2-1b-instruct")
GIB = 2**30


def test_page_bytes_and_pages_for_memory():
    # 16 layers * (K and V) * 16 tokens * 8 kv heads * 64 dims * 2 bytes (bf16) = 512 KiB
    assert page_bytes(LLAMA_1B) == 524288
    assert num_pages_for_memory(80 * GIB, LLAMA_1B, 0.9) == 147456  # 0.9 * 80 GiB / 512 KiB
    assert num_pages_for_memory(80 * GIB, LLAMA_1B, 1.0) == 163840
    assert num_pages_for_memory(10 * 2**20 + 1, LLAMA_1B, 0.5) == 10  # floor(5 MiB / 512 KiB)
    assert num_pages_for_memory(524287, LLAMA_1B, 1.0) == 0
    assert num_pages_for_memory(-1, LLAMA_1B, 0.9) == 0
    for utilization in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="utilization"):
            num_pages_for_memory(GIB, LLAMA_1B, utilization)


def test_step_buffers_include_the_kernels_split_workspaces():
    """Every device buffer a step uses, by hand: the activations, the three split scratch areas and
    the GEMM's split counters."""
    t, seqs = 2048 + 64, 64
    activations = t * (2048 + 2048 + 48 * 64 + 32 * 64 + 32 * 64 + 2 * 8192 + 8192) + seqs * (2048 + 128256)
    gemm_split = 4 * 132 * 128 * 256  # SPLIT_BLOCKS_PER_SM x SMs x the largest tile (128x256)
    # decode attention: the larger of the reference kernel's MAX_SPLITS x SMALL_GRID_BLOCKS blocks and the
    # fast/tensor-core kernels' MAX_SPLIT_BLOCKS (4096), each of group x (HD + m and sum) floats
    attention_split = max(64 * 264, 4096) * 4 * (64 + 2)
    sampler = 4096 * 2  # part winners: values and indices
    x_bf16 = t * 8192  # the widest x a product reads (the MLP's 8192), as bf16 for gemm_wgmma's TMA
    act_bf16 = t * 8192  # SwiGLU's bf16 output from the gate/up product's epilogue (the down product's x)
    tile_counters = 4096  # gemm_wgmma's K splits: an int32 count of parts per output tile
    want = 4 * (activations + gemm_split + attention_split + sampler + tile_counters) + 2 * (x_bf16 + act_bf16)
    assert buffer_bytes(LLAMA_1B, t, seqs, num_sms=132) == want


def test_gpu_cache_takes_what_the_weights_and_step_buffers_leave():
    ec = EngineConfig(gpu_memory_utilization=0.9)
    assert max_step_tokens(ec, "cuda") == 2048 + 64
    step = buffer_bytes(LLAMA_1B, max_step_tokens(ec, "cuda"), ec.max_num_seqs, num_sms=132)
    cap = plan_capacity(LLAMA_1B, ec, "cuda", free_bytes=100 * GIB, buffer_bytes=step)
    assert cap.num_pages == int((100 * GIB - step) * 0.9 // 524288)
    assert cap.buffer_bytes == step
    assert cap.max_model_len == 131072  # the model's own: the cache holds more than that
    small = plan_capacity(LLAMA_1B, ec, "cuda", free_bytes=step + 64 * 524288, buffer_bytes=step)
    assert small.num_pages == 57  # floor(0.9 * 64)
    assert small.max_model_len == 56 * 16  # a request must fit the cache alone: shrunk, as nothing was asked
    with pytest.raises(ConfigError, match="not enough GPU memory"):
        plan_capacity(LLAMA_1B, ec, "cuda", free_bytes=step, buffer_bytes=step)


def test_cpu_backends_hold_a_few_full_length_sequences():
    cap = plan_capacity(LLAMA_1B, EngineConfig(), "numpy")
    assert cap.max_model_len == DEFAULT_MAX_MODEL_LEN_CPU
    assert cap.num_pages == 1 + HOST_CACHE_SEQUENCES * DEFAULT_MAX_MODEL_LEN_CPU // 16
    cap = plan_capacity(LLAMA_1B, EngineConfig(max_model_len=100), "sim")
    assert (cap.max_model_len, cap.num_pages) == (100, 1 + 4 * 7)


def test_step_budget_is_small_on_the_cpu_backends_unless_set():
    for backend in ("numpy", "sim"):
        cap = plan_capacity(LLAMA_1B, EngineConfig(), backend)
        assert (cap.max_num_batched_tokens, cap.long_prefill_token_threshold) == (256, 128)
        assert cap.max_step_tokens == 256 + 64
    cap = plan_capacity(LLAMA_1B, EngineConfig(num_pages=1000), "cuda")
    assert (cap.max_num_batched_tokens, cap.long_prefill_token_threshold) == (2048, 2048)
    cap = plan_capacity(LLAMA_1B, EngineConfig(max_num_batched_tokens=512), "numpy")
    assert (cap.max_num_batched_tokens, cap.long_prefill_token_threshold) == (512, 512)
    ec = EngineConfig(max_num_batched_tokens=100, long_prefill_token_threshold=300, num_pages=1000)
    assert step_budget(ec, "cuda") == (100, 100)  # a chunk never exceeds the budget


def test_explicit_limits_that_cannot_hold_are_refused():
    with pytest.raises(ConfigError, match="exceeds the model's limit of 131072"):
        plan_capacity(LLAMA_1B, EngineConfig(max_model_len=200000), "numpy")
    with pytest.raises(ConfigError, match="do not fit the KV cache of 9 pages"):
        plan_capacity(LLAMA_1B, EngineConfig(max_model_len=1000, num_pages=10), "numpy")
    cap = plan_capacity(LLAMA_1B, EngineConfig(num_pages=10), "numpy")  # nothing asked: shrunk to the cache
    assert cap.max_model_len == 9 * 16
