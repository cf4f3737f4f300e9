"""Model configuration: a typed view of a checkpoint's `config.json` and `generation_config.json`.

Only the Llama family (`LlamaForCausalLM`: RMSNorm, RoPE, GQA, SwiGLU) is supported. Every field the
engine relies on is read here, validated, and given one name; the rest of the code never touches the
raw JSON. Bad or unsupported input raises `ConfigError` (a `ValueError`) with a one-line message that
names the field and the value.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PAGE_SIZE = 16  # tokens per KV-cache page (one page holds K and V of 16 positions of one layer)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
SUPPORTED_MODEL_TYPES = ("llama",)
SUPPORTED_ACTIVATIONS = ("silu",)
SUPPORTED_DTYPES = ("bfloat16", "float16", "float32")


# A layer's weights: short key -> Hugging Face name inside `model.layers.N.` (suffix `.weight`).
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def layer_tensor_name(layer: int, key: str) -> str:
    """The Hugging Face name of layer `layer`'s weight `key` (a LAYER_TENSORS key)."""
    return f"model.layers.{layer}.{LAYER_TENSORS[key]}.weight"


class ConfigError(ValueError):
    """A checkpoint's configuration is missing a field, has a bad value, or is unsupported."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 RoPE frequency scaling (`rope_type: "llama3"`).

    Wavelengths shorter than `original_max_position_embeddings / high_freq_factor` keep their
    frequency, longer than `original_max_position_embeddings / low_freq_factor` are divided by
    `factor`, and the band between is interpolated smoothly (see `rope_scaling.py`).
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults a checkpoint suggests (`generation_config.json`); None where it is silent.

    The values vLLM takes from the file (`do_sample` is not read, as in vLLM: a temperature the file
    gives is used as given)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def values(self) -> dict[str, float | int]:
        """The values the file sets, by SamplingParams field name."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family model."""

    hidden_size: int  # model width, D
    num_hidden_layers: int
    num_attention_heads: int  # query heads, H
    num_key_value_heads: int  # K/V heads, KVH (GQA: H % KVH == 0)
    head_dim: int  # per-head width, HD (usually D // H)
    intermediate_size: int  # MLP width, F
    vocab_size: int  # V
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # every id that ends a generation
    dtype: str = "bfloat16"  # the checkpoint's stored dtype
    architecture: str = "LlamaForCausalLM"
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        """Width of the query projection output, H * HD."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projection outputs, KVH * HD."""
        return self.num_key_value_heads * self.head_dim

    @property
    def gqa_group_size(self) -> int:
        """Query heads sharing one K/V head."""
        return self.num_attention_heads // self.num_key_value_heads

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight the model needs, by Hugging Face name, with its (out, in) shape."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
        for i in range(self.num_hidden_layers):
            layer = {
                "attn_norm": (d,),
                "mlp_norm": (d,),
                "q": (self.q_size, d),
                "k": (self.kv_size, d),
                "v": (self.kv_size, d),
                "o": (d, self.q_size),
                "gate": (f, d),
                "up": (f, d),
                "down": (d, f),
            }
            for key, shape in layer.items():
                shapes[layer_tensor_name(i, key)] = shape
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (v, d)
        return shapes

    def num_parameters(self) -> int:
        """Parameter count (a tied head counted once)."""
        return sum(math.prod(s) for s in self.tensor_shapes().values())

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` (required) and `generation_config.json` (optional) from a directory."""
        path = Path(path)
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"{path}: no config.json (expected a Hugging Face style model directory)")
        cfg = _read_json(cfg_path)
        gen_path = path / "generation_config.json"
        gen = _read_json(gen_path) if gen_path.is_file() else None
        return cls.from_dict(cfg, gen)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], gen: dict[str, Any] | None = None) -> ModelConfig:
        """Build and validate a config from parsed `config.json` (and `generation_config.json`)."""
        if not isinstance(cfg, dict):
            raise ConfigError("config.json: expected a JSON object")
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0] if isinstance(archs, list) and archs else archs
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"architectures: {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type: {model_type!r} is not supported (supported: llama)")
        act = cfg.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ConfigError(f"hidden_act: {act!r} is not supported (supported: silu)")
        for flag in ("attention_bias", "mlp_bias"):
            if cfg.get(flag, False):
                raise ConfigError(f"{flag}: true is not supported (Llama projections have no bias)")

        hidden = _int(cfg, "hidden_size")
        heads = _int(cfg, "num_attention_heads")
        kv_heads = _int(cfg, "num_key_value_heads", default=heads)
        head_dim = _int(cfg, "head_dim", default=hidden // heads if heads else 0)
        if heads % kv_heads:
            raise ConfigError(f"num_key_value_heads: {kv_heads} does not divide num_attention_heads ({heads})")
        if head_dim % 2:
            raise ConfigError(f"head_dim: {head_dim} must be even for RoPE")

        theta, scaling = _rope(cfg)
        dtype = cfg.get("torch_dtype", cfg.get("dtype", "bfloat16"))
        if dtype not in SUPPORTED_DTYPES:
            raise ConfigError(f"torch_dtype: {dtype!r} is not supported (supported: {', '.join(SUPPORTED_DTYPES)})")

        gen = gen or {}
        eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        for e in eos_ids:
            if not isinstance(e, int) or isinstance(e, bool):
                raise ConfigError(f"eos_token_id: {e!r} is not an integer token id")
        bos = gen.get("bos_token_id", cfg.get("bos_token_id"))
        if bos is not None and (not isinstance(bos, int) or isinstance(bos, bool)):
            raise ConfigError(f"bos_token_id: {bos!r} is not an integer token id")

        config = cls(
            hidden_size=hidden,
            num_hidden_layers=_int(cfg, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=_int(cfg, "intermediate_size"),
            vocab_size=_int(cfg, "vocab_size"),
            rms_norm_eps=_float(cfg, "rms_norm_eps", default=1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=_int(cfg, "max_position_embeddings", default=2048),
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            dtype=dtype,
            architecture=arch,
            generation=GenerationDefaults(
                temperature=_opt_float(gen, "temperature"),
                top_p=_opt_float(gen, "top_p"),
                top_k=gen.get("top_k") if isinstance(gen.get("top_k"), int) and not isinstance(gen.get("top_k"), bool) else None,
                min_p=_opt_float(gen, "min_p"),
                repetition_penalty=_opt_float(gen, "repetition_penalty"),
            ),
        )
        for tok in (*eos_ids, *(() if bos is None else (bos,))):
            if not 0 <= tok < config.vocab_size:
                raise ConfigError(f"token id {tok} is outside the vocabulary (vocab_size {config.vocab_size})")
        return config

    def to_dict(self) -> dict[str, Any]:
        """The Hugging Face `config.json` form of this config (what `convert` writes)."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": "llama",
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "torch_dtype": self.dtype,
        }
        if self.rope_scaling is not None:
            s = self.rope_scaling
            d["rope_scaling"] = {
                "rope_type": s.rope_type,
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }
        return d

    def generation_dict(self) -> dict[str, Any]:
        """The `generation_config.json` form of this config."""
        d: dict[str, Any] = {"bos_token_id": self.bos_token_id, "eos_token_id": list(self.eos_token_ids)}
        d.update(self.generation.values())
        return d


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def _int(cfg: dict[str, Any], name: str, default: int | None = None) -> int:
    value = cfg.get(name, default)
    if value is None:
        raise ConfigError(f"{name}: missing from config.json")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name}: {value!r} must be a positive integer")
    return value


def _float(cfg: dict[str, Any], name: str, default: float) -> float:
    value = cfg.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}: {value!r} must be a positive number")
    return float(value)


def _opt_float(cfg: dict[str, Any], name: str) -> float | None:
    value = cfg.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{name}: {value!r} must be a number")
    return float(value)


def _rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from either the classic fields or the newer `rope_parameters` form."""
    params = cfg.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"rope_parameters: {params!r} must be an object")
    if params:
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = params
        field_name = "rope_parameters"
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling")
        field_name = "rope_scaling"
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(f"rope_theta: {theta!r} must be a positive number")
    if scaling is None:
        return float(theta), None
    if not isinstance(scaling, dict):
        raise ConfigError(f"{field_name}: {scaling!r} must be an object")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ConfigError(f"{field_name}.rope_type: {rope_type!r} is not supported (supported: default, llama3)")
    try:
        s = RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ConfigError(f"{field_name}.{e.args[0]}: missing for rope_type 'llama3'") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{field_name}: bad llama3 value ({e})") from None
    if s.factor <= 0 or s.low_freq_factor <= 0 or s.high_freq_factor <= s.low_freq_factor:
        raise ConfigError(f"{field_name}: need factor > 0 and high_freq_factor > low_freq_factor > 0, got {scaling}")
    return float(theta), s
