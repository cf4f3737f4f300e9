"""Capacity: how many KV-cache pages, how long a request may grow, how many tokens a step holds.

Decided once, by `plan_capacity`, after the weights are on the device and before the scheduler is
built; the engine, the scheduler, the runners and the server all read the result (`Capacity`).

- ``max_num_batched_tokens`` (the step's token budget) and ``long_prefill_token_threshold`` (the
  most prompt tokens one request may prefill in a step): `EngineConfig`'s if given, else the
  backend's (`step_budget`; a budget that is given is used whole unless a threshold is given too).
  On the GPU a 2048-token step takes milliseconds, and a prompt is prefilled in one chunk as large
  as the budget. On the CPU backends a step's time grows with its
  tokens (seconds for a few hundred on NumPy), and every request waits for the step in progress, so
  the budget is small (256) and one prompt takes at most half of it (128) per step: a short request
  that arrives while a long prompt is prefilled is admitted at the next step and runs beside the
  long prompt's chunks, instead of waiting for its whole prefill (a 4,000-token prompt takes over a
  minute on NumPy).
- ``max_step_tokens``: a full token budget of prefill chunks plus one decode token per batch slot.
- ``num_pages``: `EngineConfig.num_pages` if given. Otherwise, on the GPU, the share
  `gpu_memory_utilization` of the memory left once the weights *and every other device buffer a step
  uses* (`model.llama.buffer_bytes`: activations for ``max_step_tokens`` tokens, the kernels' split
  scratch) are accounted for; on the CPU backends, room for `HOST_CACHE_SEQUENCES` sequences of
  ``max_model_len`` tokens.
- ``max_model_len``: `EngineConfig.max_model_len` if given (it may not exceed the model's own
  limit, nor the whole cache: a request must fit the cache alone, or preempting everyone else would
  not let it proceed); otherwise the model's limit (capped at `DEFAULT_MAX_MODEL_LEN_CPU` on the CPU
  backends, where a long prompt would take minutes), shrunk to what the cache holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from numba_vllm.engine.config import EngineConfig
from numba_vllm.engine.kv_cache import pages_for_tokens
from numba_vllm.model.config import PAGE_SIZE, ConfigError, ModelConfig

HOST_CACHE_SEQUENCES = 4  # numpy / sim default: a cache that holds this many full-length sequences
DEFAULT_MAX_MODEL_LEN_CPU = 4096  # numpy / sim default length cap (the model's own may be 128k)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # cuda default token budget of a step
DEFAULT_MAX_NUM_BATCHED_TOKENS_CPU = 256  # numpy / sim default token budget of a step


@dataclass(frozen=True)
class Capacity:
    """What the device holds, decided once (see the module docstring)."""

    num_pages: int  # KV-cache pages of PAGE_SIZE tokens, the null page included
    max_model_len: int  # prompt + output tokens of one request, at most
    max_num_batched_tokens: int  # the token budget of a step (prefill chunks + decodes)
    long_prefill_token_threshold: int  # the most prompt tokens one request prefills in a step
    max_step_tokens: int  # tokens one step holds: the token budget plus one decode per slot
    buffer_bytes: int  # device bytes of the step's other buffers (activations, split scratch); 0 on numpy

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the whole cache holds (the null page excluded)."""
        return (self.num_pages - 1) * PAGE_SIZE


def step_budget(engine_config: EngineConfig, backend: str) -> tuple[int, int]:
    """(max_num_batched_tokens, long_prefill_token_threshold) on `backend` (see the module docstring)."""
    budget, threshold = engine_config.max_num_batched_tokens, engine_config.long_prefill_token_threshold
    if budget is None:
        budget = DEFAULT_MAX_NUM_BATCHED_TOKENS if backend == "cuda" else DEFAULT_MAX_NUM_BATCHED_TOKENS_CPU
        if threshold is None and backend != "cuda":
            threshold = DEFAULT_MAX_NUM_BATCHED_TOKENS_CPU // 2
    return budget, min(threshold or budget, budget)


def max_step_tokens(engine_config: EngineConfig, backend: str) -> int:
    """The most tokens one step can hold: a full token budget of prefill chunks plus decodes."""
    return step_budget(engine_config, backend)[0] + engine_config.max_num_seqs


def page_bytes(config: ModelConfig, kv_bytes_per_element: int = 2) -> int:
    """Device bytes of one page across all layers: K and V of PAGE_SIZE tokens, KVH heads, HD dims.

    ``num_hidden_layers * 2 * PAGE_SIZE * KVH * HD * kv_bytes_per_element`` (2 for bf16). For Llama
    3.2 1B (16 layers, 8 kv heads of 64) that is 512 KiB, i.e. 32 KiB per token.
    """
    return config.num_hidden_layers * 2 * PAGE_SIZE * config.num_key_value_heads * config.head_dim * kv_bytes_per_element


def num_pages_for_memory(free_bytes: int, config: ModelConfig, utilization: float) -> int:
    """How many pages (the null page included) fit in ``utilization`` of ``free_bytes``."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu memory utilization must be in (0, 1], got {utilization}")
    return max(0, math.floor(free_bytes * utilization / page_bytes(config)))


def plan_capacity(
    config: ModelConfig, engine_config: EngineConfig, backend: str, free_bytes: int | None = None, buffer_bytes: int = 0
) -> Capacity:
    """The capacity of an engine on `backend` ("cuda", "sim" or "numpy").

    `free_bytes`: device memory free once the weights are uploaded (cuda: required unless
    `num_pages` is given). `buffer_bytes`: device bytes of the step's other buffers
    (`model.llama.buffer_bytes` at `max_step_tokens`), which the cache must leave room for.
    Raises ConfigError for settings that cannot work, with one line saying why.
    """
    ec = engine_config
    model_limit = config.max_position_embeddings
    if ec.max_model_len is not None and ec.max_model_len > model_limit:
        raise ConfigError(
            f"max_model_len: {ec.max_model_len} exceeds the model's limit of {model_limit} tokens (max_position_embeddings)"
        )
    wanted = ec.max_model_len or (model_limit if backend == "cuda" else min(model_limit, DEFAULT_MAX_MODEL_LEN_CPU))
    if ec.num_pages is not None:
        num_pages = ec.num_pages
    elif backend == "cuda":
        if free_bytes is None:
            raise ValueError("plan_capacity: the cuda backend needs the free device memory")
        num_pages = num_pages_for_memory(free_bytes - buffer_bytes, config, ec.gpu_memory_utilization)
        if num_pages < 2:
            raise ConfigError(
                f"not enough GPU memory for a KV cache: {free_bytes / 2**30:.2f} GiB free after the weights, "
                f"{buffer_bytes / 2**30:.2f} GiB of it for the step's buffers (lower --max-num-batched-tokens "
                "or --max-num-seqs)"
            )
    else:
        num_pages = 1 + HOST_CACHE_SEQUENCES * pages_for_tokens(wanted)
    cache_tokens = (num_pages - 1) * PAGE_SIZE
    if cache_tokens < wanted:
        if ec.max_model_len is not None:
            raise ConfigError(
                f"max_model_len: {ec.max_model_len} tokens do not fit the KV cache of {num_pages - 1} pages "
                f"({cache_tokens} tokens); lower --max-model-len or give the cache more pages or memory"
            )
        wanted = cache_tokens
    if wanted < 2:
        raise ConfigError(f"num_pages: {num_pages} leaves no room for a request (one prompt token and one new token)")
    budget, threshold = step_budget(ec, backend)
    return Capacity(
        num_pages=num_pages, max_model_len=wanted, max_num_batched_tokens=budget, long_prefill_token_threshold=threshold,
        max_step_tokens=max_step_tokens(ec, backend), buffer_bytes=buffer_bytes,
    )  # fmt: skip
