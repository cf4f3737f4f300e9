"""How the engine runs a model: `EngineConfig` (backend, batch slots, token budget, KV-cache size,
prefix caching, kernel choices), validated once. No GPU import."""

from __future__ import annotations

from dataclasses import dataclass

from numba_vllm.model.config import ConfigError

BACKENDS = ("auto", "cuda", "sim", "numpy")
SCHEDULING_MODES = ("continuous", "static")
# auto: wgmma on compute capability 9.0, else tensor_cores; kernels/gemm_tc.py (bf16 mma.sync), kernels/gemm.py
# (fp32 FMA, the readable one), kernels/gemm_wgmma.py (bf16 wgmma, sm_90a only)
PREFILL_GEMMS = ("auto", "tensor_cores", "fp32", "wgmma")
# auto: wgmma on compute capability 9.0 (head dims 64 and 128), else tensor_cores; kernels/prefill_attention.py
# (readable), prefill_attention_tc.py (mma.sync), prefill_attention_wgmma.py (sm_90a only)
PREFILL_ATTENTIONS = ("auto", "cuda_cores", "tensor_cores", "wgmma")
# kernels/decode_attention.py (readable), decode_attention_fast.py (CUDA cores, tuned), decode_attention_tc.py
DECODE_ATTENTIONS = ("reference", "fast", "tensor_cores")
# auto: the model's generation_config.json sampling values are the requests' defaults; vllm: vLLM's neutral ones
GENERATION_CONFIGS = ("auto", "vllm")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model: where, how many requests at once, how much KV cache."""

    backend: str = "auto"  # cuda (kernels on the GPU), sim (the kernels in the simulator), numpy, auto
    max_num_seqs: int = 64  # batch slots: requests running at once
    max_num_batched_tokens: int | None = None  # tokens per step (prefill chunks + decodes); None: the backend's default
    long_prefill_token_threshold: int | None = None  # most prompt tokens one request prefills per step; None: the backend's
    max_model_len: int | None = None  # prompt + output cap; None: the model's, capped by the cache
    num_pages: int | None = None  # KV-cache pages (PAGE_SIZE tokens each, page 0 reserved); None: sized
    gpu_memory_utilization: float = 0.9  # fraction of free GPU memory the KV cache may take (cuda)
    verbose: bool = False  # print each step's slots and free pages
    enforce_eager: bool = False  # cuda: launch every step kernel by kernel instead of replaying CUDA graphs
    async_scheduling: bool = True  # schedule and launch step n+1 before collecting step n's tokens (overlap)
    scheduling: str = "continuous"  # continuous: refill free slots every step; static: batch by batch
    prefill_gemm: str = "auto"  # the GEMM of steps with more than GEMV_MAX_TOKENS tokens (PREFILL_GEMMS)
    prefill_attention: str = "auto"  # the attention kernel of prompt chunks (PREFILL_ATTENTIONS)
    decode_attention: str = "tensor_cores"  # the attention kernel of decoding sequences (DECODE_ATTENTIONS)
    enable_prefix_caching: bool = True  # reuse the K/V pages of prompts' shared prefixes (engine/prefix_cache.py)
    generation_config: str = "auto"  # where requests' sampling defaults come from (GENERATION_CONFIGS)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend: {self.backend!r} is not one of {', '.join(BACKENDS)}")
        for name, allowed in (
            ("scheduling", SCHEDULING_MODES), ("prefill_gemm", PREFILL_GEMMS), ("prefill_attention", PREFILL_ATTENTIONS),
            ("decode_attention", DECODE_ATTENTIONS), ("generation_config", GENERATION_CONFIGS),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}: {getattr(self, name)!r} is not one of {', '.join(allowed)}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold"):
            value = getattr(self, name)
            if value is None and name != "max_num_seqs":
                continue  # decided per backend (executor/capacity.py)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}: {value!r} must be a positive integer")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ConfigError(f"max_model_len: {self.max_model_len!r} must be an integer >= 2")
        if self.num_pages is not None and (not isinstance(self.num_pages, int) or self.num_pages < 2):
            raise ConfigError(f"num_pages: {self.num_pages!r} must be an integer >= 2 (page 0 is reserved)")
        for name in ("enable_prefix_caching", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: {getattr(self, name)!r} must be True or False")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization: {self.gpu_memory_utilization!r} must be in (0, 1]")
