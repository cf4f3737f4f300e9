"""Tiny random Llamas whose logits were computed by Hugging Face transformers (see tests/data/).

`tests/data/tiny_llama_configs.json` holds three transformers-written configs and the exact recipe
that drew their weights from a seeded NumPy generator; `tiny_llama_hf_logits.npz` holds the logits
transformers' LlamaForCausalLM (float32, eager attention) computed for 37 tokens drawn after the
weights. Rebuilding the weights here lets tests compare our models with an independent
implementation without torch installed.
"""

from __future__ import annotations

import json
import math

import numpy as np

from numba_vllm.model.config import ModelConfig
from tests.helpers import DATA

SEQ_LEN = 37
_LAYER_ORDER = (
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "post_attention_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def hf_tiny_case(key: str) -> tuple[dict, ModelConfig, dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """(config dict, ModelConfig, weights, token ids (37,), HF logits (37, V)) of case 'a', 'b' or 'c'."""
    meta = json.loads((DATA / "tiny_llama_configs.json").read_text())["configs"][key]
    cfg = meta["config"]
    config = ModelConfig.from_dict(cfg)
    rng = np.random.default_rng(meta["seed"])
    shapes = config.tensor_shapes()

    def draw(name: str) -> np.ndarray:
        shape = shapes[name]
        if len(shape) == 1:
            return (1.0 + rng.normal(0.0, 0.1, size=shape)).astype(np.float32)
        return rng.normal(0.0, 0.5 / math.sqrt(shape[1]), size=shape).astype(np.float32)

    names = ["model.embed_tokens.weight"]
    names += [f"model.layers.{i}.{n}.weight" for i in range(config.num_hidden_layers) for n in _LAYER_ORDER]
    names += ["model.norm.weight"] + ([] if config.tie_word_embeddings else ["lm_head.weight"])
    weights = {name: draw(name) for name in names}
    tokens = rng.integers(0, config.vocab_size, SEQ_LEN)
    logits = np.load(DATA / "tiny_llama_hf_logits.npz")
    assert np.array_equal(tokens, logits[f"tokens_{key}"]), "weight recipe out of step with the saved tokens"
    return cfg, config, weights, tokens, logits[key]
