"""What `LLM`'s arguments mean here: vLLM's constructor keywords, and the prompt forms of `generate`.

`LLM(...)` takes vLLM's common keywords. Those that mean something here become `EngineConfig`
fields; those that only have one possible value here (one GPU, the model's own tokenizer, the
backend's compute dtype) are accepted at that value and refused at any other, and an unknown
keyword is refused: each refusal is one line naming `LLM` and the keyword.

`generate` takes what vLLM's does: a text, a list of token ids, a `{"prompt": text}` or
`{"prompt_token_ids": [...]}` dict, or a list of any of these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from numba_vllm.engine.config import EngineConfig

# vLLM keywords with the same meaning here: passed to EngineConfig as they are.
ENGINE_KEYWORDS = (
    "max_model_len", "gpu_memory_utilization", "enforce_eager", "max_num_seqs", "max_num_batched_tokens",
    "enable_prefix_caching", "generation_config",
)  # fmt: skip
# numba-vllm's own EngineConfig fields, also taken by LLM.
OWN_KEYWORDS = tuple(
    name for name in EngineConfig.__dataclass_fields__ if name not in ENGINE_KEYWORDS and name != "backend"
)
# vLLM keywords that have one possible value here, and that value ("any": every value is fine, as
# nothing here depends on it; trust_remote_code: no code from a model is ever run).
FIXED_KEYWORDS: dict[str, Any] = {
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "data_parallel_size": 1,
    "quantization": None,
    "kv_cache_dtype": "auto",
    "tokenizer_mode": "auto",
    "skip_tokenizer_init": False,
    "revision": None,
    "tokenizer_revision": None,
    "trust_remote_code": "any",
    "disable_log_stats": "any",
    "swap_space": "any",
}
_DTYPE_NAMES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def llm_engine_config(model: str | None, backend: str, resolved_backend: str, kwargs: dict[str, Any]) -> EngineConfig:
    """The EngineConfig of `LLM(model, backend=backend, **kwargs)`; TypeError for an unknown keyword,
    ValueError for a value that cannot be honoured (both name `LLM` and the keyword)."""
    fields: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name in ENGINE_KEYWORDS or name in OWN_KEYWORDS:
            fields[name] = value
        elif name == "seed":
            continue  # LLM keeps it (requests without a seed draw one from it)
        elif name == "tokenizer":
            if value is not None and str(value) != str(model):
                raise ValueError(f"LLM: tokenizer={value!r} is not supported: the model's own tokenizer is used (leave it out)")
        elif name == "dtype":
            check_dtype(value, resolved_backend)
        elif name in FIXED_KEYWORDS:
            allowed = FIXED_KEYWORDS[name]
            if allowed != "any" and value != allowed:
                why = ": numba-vllm runs on one GPU" if name.endswith("parallel_size") else ""
                raise ValueError(f"LLM: {name}={value!r} is not supported (only {allowed!r}{why})")
        else:
            raise TypeError(f"LLM: unknown keyword argument {name!r}")
    try:
        return EngineConfig(backend=backend, **fields)
    except ValueError as e:  # ConfigError names the field
        raise ValueError(f"LLM: {e}") from None


def check_dtype(dtype: Any, backend: str) -> None:
    """`dtype`: "auto", or the dtype the backend computes in (bfloat16 on cuda and sim, float32 on numpy)."""
    computes = "float32" if backend == "numpy" else "bfloat16"
    name = _DTYPE_NAMES.get(str(dtype), str(dtype))
    if name not in ("auto", computes):
        raise ValueError(f"LLM: dtype={dtype!r} is not supported on the {backend} backend (only 'auto' or {computes!r})")


def normalize_prompts(prompts: Any) -> list[str | list[int]]:
    """`generate`'s prompts as a list of texts and token-id lists; ValueError for another form."""
    if isinstance(prompts, (str, Mapping)) or (isinstance(prompts, Sequence) and prompts and _is_id(prompts[0])):
        prompts = [prompts]
    if not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a string, token ids, a prompt dict, or a list of these; got {type(prompts).__name__}")
    return [_one_prompt(p, i) for i, p in enumerate(prompts)]


def _one_prompt(prompt: Any, i: int) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        keys = set(prompt)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"]
        if keys == {"prompt_token_ids"}:
            return _ids(prompt["prompt_token_ids"], i)
        want = "'prompt' (a string) or 'prompt_token_ids' (token ids) alone"
        raise ValueError(f"prompt {i}: a prompt dict holds {want}; got keys {sorted(keys)}")
    return _ids(prompt, i)


def _ids(ids: Any, i: int) -> list[int]:
    if isinstance(ids, Sequence) and not isinstance(ids, str) and all(_is_id(t) for t in ids):
        return [int(t) for t in ids]
    raise ValueError(f"prompt {i}: expected a string, a list of token ids or a prompt dict, got {ids!r:.60}")


def _is_id(x: Any) -> bool:
    return hasattr(x, "__index__") and not isinstance(x, bool)
