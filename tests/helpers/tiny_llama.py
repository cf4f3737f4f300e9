"""Tiny random Llama checkpoints that tests build themselves (no download, no weights in git)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from numba_vllm.loading.bf16 import to_bf16
from numba_vllm.loading.weights import save_safetensors
from numba_vllm.model.config import ModelConfig

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "vocab_size": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def tiny_config_dict(**overrides) -> dict:
    """TINY with some entries replaced (hidden_size=..., num_key_value_heads=..., ...)."""
    d = dict(TINY)
    d.update(overrides)
    return d


def random_weights(config: ModelConfig, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """Weights of every expected shape: matrices ~ N(0, 1/in), norms ~ 1 + N(0, 0.1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in config.tensor_shapes().items():
        if len(shape) == 1:
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[1])
        w = w.astype(np.float32)
        out[name] = to_bf16(w) if dtype == "bf16" else w.astype(dtype)
    return out


def write_checkpoint(path: Path, config_dict: dict, weights: dict[str, np.ndarray]) -> Path:
    """A Hugging Face style directory: config.json + model.safetensors."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_dict))
    save_safetensors(path / "model.safetensors", weights, {"format": "pt"})
    return path


def tiny_checkpoint(path: Path, **overrides) -> Path:
    """A bf16 checkpoint of TINY (with `overrides`) and random_weights' seed-0 weights, written to `path`."""
    cfg = tiny_config_dict(**overrides)
    return write_checkpoint(path, cfg, random_weights(ModelConfig.from_dict(cfg), dtype="bf16"))


def write_chat_checkpoint(path: Path, **overrides) -> Path:
    """A tiny random checkpoint that takes text: test_tokenizer's byte-level BPE (268 ids, its ChatML
    template, <|im_end|> as EOS) and a model whose vocabulary matches it."""
    from tests.helpers.tokenizers import CHATML, byte_level_json

    cfg = tiny_config_dict(vocab_size=268, bos_token_id=262, eos_token_id=267, **overrides)
    write_checkpoint(path, cfg, random_weights(ModelConfig.from_dict(cfg), dtype="bf16"))
    (path / "tokenizer.json").write_text(byte_level_json())
    tokenizer_config = {"chat_template": CHATML, "bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path
