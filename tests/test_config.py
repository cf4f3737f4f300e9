"""ModelConfig: parsing real and transformers-written configs, both rope forms, and clear errors."""

import json
from pathlib import Path

import numpy as np
import pytest

from numba_vllm.model.config import ConfigError, ModelConfig
from numba_vllm.model.rope_scaling import rope_inv_freq

DATA = Path(__file__).parent / "data"
LLAMA_DIR = DATA / "llama-3.2-1b-instruct"  # the published config of Llama 3.2 1B Instruct


def llama_dict(**overrides):
    d = json.loads((LLAMA_DIR / "config.json").read_text())
    d.update(overrides)
    return d


def test_llama_3_2_1b_config():
    c = ModelConfig.from_dir(LLAMA_DIR)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (2048, 16, 32, 8)
    assert (c.head_dim, c.intermediate_size, c.vocab_size) == (64, 8192, 128256)
    assert c.rms_norm_eps == 1e-5 and c.rope_theta == 500000.0
    s = c.rope_scaling
    assert (s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings) == (32.0, 1.0, 4.0, 8192)
    assert c.tie_word_embeddings and c.bos_token_id == 128000
    assert c.eos_token_ids == (128001, 128008, 128009)
    assert c.generation.temperature == 0.6 and c.generation.top_p == 0.9
    assert c.gqa_group_size == 4 and c.dtype == "bfloat16"
    assert c.num_parameters() == 1_235_814_400  # the published 1.24 B


def test_transformers_saved_config():
    """A config.json written by transformers' save_pretrained (see tests/data/README)."""
    raw = json.loads((DATA / "hf_saved_config.json").read_text())
    c = ModelConfig.from_dict(raw)
    assert c.hidden_size == raw["hidden_size"] and c.num_key_value_heads == raw["num_key_value_heads"]
    assert c.rope_scaling is not None and c.rope_scaling.factor == 32.0


def test_rope_parameters_form_equals_classic_form():
    classic = ModelConfig.from_dict(llama_dict())
    d = llama_dict(dtype="bfloat16")
    scaling = d.pop("rope_scaling")
    d.pop("torch_dtype")
    d["rope_parameters"] = dict(scaling, rope_theta=d.pop("rope_theta"))
    new = ModelConfig.from_dict(d)
    assert new == classic


def test_llama3_scaling_matches_closed_form():
    """Bands: short wavelengths unscaled, long ones divided by factor, the middle blended."""
    c = ModelConfig.from_dict(llama_dict())
    plain = ModelConfig.from_dict(llama_dict(rope_scaling=None))
    f, f0 = rope_inv_freq(c).astype(np.float64), rope_inv_freq(plain).astype(np.float64)
    wavelen = 2 * np.pi / f0
    high = wavelen < 8192 / 4
    low = wavelen > 8192 / 1
    np.testing.assert_allclose(f[high], f0[high], rtol=1e-6)
    np.testing.assert_allclose(f[low], f0[low] / 32, rtol=1e-6)
    mid = ~high & ~low
    assert mid.any() and np.all(f[mid] <= f0[mid]) and np.all(f[mid] >= f0[mid] / 32)
    np.testing.assert_allclose(f0[:3], [1.0, 500000 ** (-2 / 64), 500000 ** (-4 / 64)], rtol=1e-6)


def test_round_trip_through_to_dict():
    c = ModelConfig.from_dict(llama_dict())
    assert ModelConfig.from_dict(c.to_dict(), c.generation_dict()) == c


def test_single_eos_and_defaults():
    c = ModelConfig.from_dict(
        {
            "hidden_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "intermediate_size": 128,
            "vocab_size": 100,
            "eos_token_id": 2,
        }
    )
    assert c.eos_token_ids == (2,) and c.num_key_value_heads == 4 and c.head_dim == 16 and c.rope_scaling is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"architectures": ["MistralForCausalLM"]}, "architectures: 'MistralForCausalLM' is not supported"),
        ({"model_type": "gemma"}, "model_type: 'gemma'"),
        ({"hidden_act": "gelu"}, "hidden_act: 'gelu'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type: 'yarn' is not supported"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor: missing"),
        ({"num_key_value_heads": 5}, "num_key_value_heads: 5 does not divide"),
        ({"hidden_size": -3}, "hidden_size: -3 must be a positive integer"),
        ({"hidden_size": None}, "hidden_size: missing"),
        ({"torch_dtype": "int8"}, "torch_dtype: 'int8' is not supported"),
        ({"eos_token_id": 999999}, "token id 999999 is outside the vocabulary"),
        ({"attention_bias": True}, "attention_bias: true is not supported"),
    ],
)
def test_errors_name_field_and_value(overrides, message):
    with pytest.raises(ConfigError, match=None) as e:
        ModelConfig.from_dict(llama_dict(**overrides))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_missing_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)
