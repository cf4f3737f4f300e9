"""GGUF import: a llama.cpp model file -> `ModelConfig`, float32 weights under Hugging Face names, tokenizer.

The file is parsed by `gguf_reader.py` (header, metadata, tensor table; tensors dequantized on
demand) and its vocabulary turned into a Hugging Face tokenizer by `gguf_tokenizer.py`. A llama.cpp
file differs from a Hugging Face checkpoint in three ways, all undone here:
- names: `blk.N.attn_q.weight` is `model.layers.N.self_attn.q_proj.weight`, and so on;
- shapes: GGUF lists dimensions fastest-varying first (`[in, out]`), the reverse of NumPy's `(out, in)`;
- rotary layout: llama.cpp's converter permutes the rows of q_proj and k_proj so that each head's
  rotary pairs sit side by side (interleaved) instead of half a head apart (HF's rotate-half).

`convert_gguf` writes everything out as a Hugging Face style directory with bf16 safetensors.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from numba_vllm.loading.gguf.reader import SUPPORTED_TYPES, GGUFError, GGUFFile, read_gguf
from numba_vllm.loading.gguf.tokenizer import make_tokenizer, tokenizer_fields
from numba_vllm.loading.tokenizer import Tokenizer
from numba_vllm.model.config import ConfigError, ModelConfig, RopeScaling, layer_tensor_name
from numba_vllm.model.rope_scaling import rope_inv_freq

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {  # llama.cpp's name inside `blk.N.` -> our key (config.LAYER_TENSORS)
    "attn_norm": "attn_norm",
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "ffn_norm": "mlp_norm",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1+ RoPE scaling, stored as per-frequency divisors

CONVERTED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
SOURCE_KEY = "source_gguf"  # safetensors metadata key marking a directory that convert_gguf wrote


# ---- the model -----------------------------------------------------------------------------------
@dataclass
class GGUFModel:
    """A Llama model read from GGUF: config, float32 weights under HF names, tokenizer parts."""

    config: ModelConfig
    weights: dict[str, np.ndarray]  # HF name -> float32, PyTorch layout (rows = output features)
    tokenizer_json: str | None  # a Hugging Face tokenizer.json, None if the file has no vocabulary
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    unk_token: str | None
    pad_token: str | None
    add_bos_token: bool  # whether a plain encode starts with BOS

    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer, or None when the file has no vocabulary."""
        return make_tokenizer(vars(self))


def load_gguf(path: str | Path) -> GGUFModel:
    """Read a Llama-architecture GGUF: config, dequantized weights (float32), tokenizer and template."""
    gf = read_gguf(path)
    config = _config(gf)
    return GGUFModel(config=config, weights=_weights(gf, config), **tokenizer_fields(gf))


def load_gguf_tokenizer(path: str | Path) -> Tokenizer | None:
    """Only the tokenizer of a GGUF file (no weights are read), or None if it has no vocabulary."""
    return make_tokenizer(tokenizer_fields(read_gguf(path)))


def _config(gf: GGUFFile) -> ModelConfig:
    arch = gf.metadata.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"{gf.path}: architecture {arch!r} is not supported (only 'llama')")
    hidden = gf.meta("llama.embedding_length", int, required=True)
    heads = gf.meta("llama.attention.head_count", int, required=True)
    head_dim = gf.meta("llama.attention.key_length", int) or gf.meta("llama.rope.dimension_count", int) or hidden // heads
    rope_dim = gf.meta("llama.rope.dimension_count", int, default=head_dim)
    if rope_dim != head_dim:
        raise GGUFError(
            f"{gf.path}: rope.dimension_count {rope_dim} differs from the head dim {head_dim} (partial RoPE is not supported)"
        )
    if gf.meta("llama.attention.value_length", int, default=head_dim) != head_dim:
        raise GGUFError(f"{gf.path}: attention.value_length differs from attention.key_length (not supported)")
    scaling_type = gf.meta("llama.rope.scaling.type", str, default="none")
    if scaling_type != "none":
        raise GGUFError(f"{gf.path}: rope.scaling.type {scaling_type!r} is not supported (only Llama 3 scaling via {ROPE_FREQS})")
    tokens = gf.metadata.get("tokenizer.ggml.tokens")
    vocab = gf.meta("llama.vocab_size", int) or (len(tokens) if isinstance(tokens, list) else None)
    if vocab is None and "token_embd.weight" in gf.tensors:
        vocab = gf.tensors["token_embd.weight"].shape[0]
    eos_ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        token_id = gf.meta(key, int)
        if token_id is not None and token_id not in eos_ids:
            eos_ids.append(token_id)
    cfg = {
        "hidden_size": hidden,
        "num_hidden_layers": gf.meta("llama.block_count", int, required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": gf.meta("llama.attention.head_count_kv", int, default=heads),
        "head_dim": head_dim,
        "intermediate_size": gf.meta("llama.feed_forward_length", int, required=True),
        "vocab_size": vocab,
        "rms_norm_eps": gf.meta("llama.attention.layer_norm_rms_epsilon", float, default=1e-5),
        "rope_theta": gf.meta("llama.rope.freq_base", float, default=10000.0),
        "max_position_embeddings": gf.meta("llama.context_length", int, default=2048),
        "tie_word_embeddings": "output.weight" not in gf.tensors,
        "torch_dtype": "float32",
    }
    gen: dict[str, Any] = {"bos_token_id": gf.meta("tokenizer.ggml.bos_token_id", int), "eos_token_id": eos_ids}
    for key, name, kind in (("temp", "temperature", float), ("top_p", "top_p", float), ("top_k", "top_k", int)):
        value = gf.meta(f"general.sampling.{key}", kind)
        if value is not None:
            gen[name] = value
    try:
        config = ModelConfig.from_dict(cfg, gen)
    except ConfigError as e:
        raise GGUFError(f"{gf.path}: {e}") from None
    return _with_rope_freqs(gf, config) if ROPE_FREQS in gf.tensors else config


def _with_rope_freqs(gf: GGUFFile, config: ModelConfig) -> ModelConfig:
    """Recover Llama 3 `rope_scaling` from llama.cpp's `rope_freqs` table (frequency divisors).

    The table is what Llama 3 scaling does to each frequency; its parameters are not stored. Every
    Llama 3.x model uses low_freq_factor 1, high_freq_factor 4 and an original context of 8192, with
    `factor` the largest divisor: rebuild that and accept it only if it reproduces the table.
    """
    divisors = gf.dequantize(ROPE_FREQS).reshape(-1)  # (head_dim // 2,) float32
    if divisors.shape != (config.head_dim // 2,):
        raise GGUFError(f"{gf.path}: {ROPE_FREQS} has {divisors.size} entries, expected head_dim / 2 = {config.head_dim // 2}")
    if np.all(divisors == 1.0):
        return config
    original = gf.meta("llama.rope.scaling.original_context_length", int, default=8192)
    scaling = RopeScaling(
        factor=float(divisors.max()), low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=original
    )
    scaled = replace(config, rope_scaling=scaling)
    expected = rope_inv_freq(config).astype(np.float64) / rope_inv_freq(scaled)
    if not np.allclose(divisors, expected, rtol=1e-4):
        params = f"factor {scaling.factor:g}, low 1, high 4, original context {original}"
        raise GGUFError(f"{gf.path}: {ROPE_FREQS} does not match Llama 3 RoPE scaling ({params}); no other table is supported")
    return scaled


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_TENSOR.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return layer_tensor_name(int(m.group(1)), _LAYER_NAMES[m.group(2)])


def _weights(gf: GGUFFile, config: ModelConfig) -> dict[str, np.ndarray]:
    expected = config.tensor_shapes()
    names: dict[str, str] = {}  # HF name -> GGUF name
    for gguf_name, t in gf.tensors.items():
        if gguf_name == ROPE_FREQS:
            continue
        hf_name = _hf_name(gguf_name)
        if hf_name not in expected:
            raise GGUFError(
                f"{gf.path}: unexpected tensor {gguf_name!r} (not part of a {config.num_hidden_layers}-layer Llama model)"
            )
        if t.shape != expected[hf_name]:
            raise GGUFError(f"{gf.path}: tensor {gguf_name!r} has shape {t.shape}, expected {expected[hf_name]}")
        if t.qtype not in SUPPORTED_TYPES:
            gf.dequantize(gguf_name)  # raises the unsupported-type error before any work is done
        names[hf_name] = gguf_name
    missing = [n for n in expected if n not in names]
    if missing:
        raise GGUFError(f"{gf.path}: the file has no tensor for {missing[0]} ({len(missing)} missing)")
    weights = {}
    for hf_name in expected:
        w = gf.dequantize(names[hf_name])
        if hf_name.endswith("q_proj.weight"):
            w = unpermute_rotary_rows(w, config.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            w = unpermute_rotary_rows(w, config.num_key_value_heads)
        weights[hf_name] = w
    return weights


def unpermute_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: interleaved rotary pairs -> HF rotate-half order.

    llama.cpp stores each head's rows as pairs (0, HD/2), (1, HD/2+1), ... side by side; that is,
    HF row `c * HD/2 + j` of a head sits at GGUF row `2 * j + c`. w: (num_heads * HD, in) float32.
    """
    out_features, in_features = w.shape
    half = out_features // num_heads // 2
    # (heads, HD/2, 2, in) -> (heads, 2, HD/2, in): GGUF row 2j+c goes back to HF row c*HD/2+j
    return np.ascontiguousarray(w.reshape(num_heads, half, 2, in_features).swapaxes(1, 2).reshape(out_features, in_features))


# ---- conversion ----------------------------------------------------------------------------------
def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write a GGUF model as a Hugging Face style directory: config, bf16 safetensors, tokenizer.

    `out_dir` must be new, empty, or an earlier output of this function (then it is overwritten).
    """
    from numba_vllm.loading.bf16 import to_bf16
    from numba_vllm.loading.weights import read_metadata, save_safetensors

    gguf_path, out = Path(gguf_path), Path(out_dir)
    if out.exists() and not out.is_dir():
        raise GGUFError(f"{out}: exists and is not a directory")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if entries:
        weights_file = out / "model.safetensors"
        ours = set(entries) <= set(CONVERTED_FILES) and weights_file.is_file() and SOURCE_KEY in read_metadata(weights_file)
        if not ours:
            listing = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise GGUFError(
                f"{out}: not empty and not an earlier GGUF conversion (holds {listing}); choose a new or empty directory"
            )
    model = load_gguf(gguf_path)
    config = replace(model.config, dtype="bfloat16")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: to_bf16(w) for name, w in model.weights.items()}  # (out, in) bf16
    save_safetensors(out / "model.safetensors", tensors, metadata={"format": "pt", SOURCE_KEY: gguf_path.name})
    _write_json(out / "config.json", config.to_dict())
    _write_json(out / "generation_config.json", config.generation_dict())
    if model.tokenizer_json is not None:
        (out / "tokenizer.json").write_text(model.tokenizer_json, encoding="utf-8")
        tok_config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": model.add_bos_token,
            "add_eos_token": False,
        }
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            if getattr(model, key) is not None:
                tok_config[key] = getattr(model, key)
        tok_config["model_max_length"] = config.max_position_embeddings
        tok_config["clean_up_tokenization_spaces"] = False
        if model.chat_template is not None:
            tok_config["chat_template"] = model.chat_template
        _write_json(out / "tokenizer_config.json", tok_config)
    else:  # a rewrite must not keep the tokenizer of an earlier model
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (out / name).unlink(missing_ok=True)
    return out


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
