"""GGUF import: synthetic files written with gguf.GGUFWriter, then the real SmolLM2-135M GGUF.

The synthetic model is a tiny Llama with known float32 weights, some stored quantized; loading must
give them back under Hugging Face names and shapes (within the quantization error), with llama.cpp's
q/k row permutation undone. The real model is skipped if it is not installed.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from numba_vllm.loading.bf16 import to_bf16
from numba_vllm.loading.gguf.importer import (
    GGUFError,
    convert_gguf,
    load_gguf,
    load_gguf_tokenizer,
    read_gguf,
    unpermute_rotary_rows,
)
from numba_vllm.loading.tokenizer import load_tokenizer
from numba_vllm.loading.weights import load_weights
from numba_vllm.model.config import ModelConfig
from numba_vllm.model.rope_scaling import rope_inv_freq
from tests.helpers.smollm2 import NOT_INSTALLED, smollm2_path

# ---- a tiny Llama -----------------------------------------------------------------------------------
D, F, H, KVH, HD, LAYERS = 64, 96, 4, 2, 16, 2  # row lengths (64, 96) are whole Q8_0/Q4_* blocks of 32
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ w", "Ġw o", "1 2", "12 3", "Ġ Ġ", "h i", "' t"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte value (index = byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


TOKENS = SPECIALS + byte_symbols() + [m.replace(" ", "") for m in MERGES]
V = len(TOKENS)


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF q/k rows: each head's two halves interleaved."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_config(**entries) -> ModelConfig:
    """The tiny model's config, with more (or other) config.json entries."""
    base = {"hidden_size": D, "intermediate_size": F, "num_attention_heads": H, "num_key_value_heads": KVH,
            "num_hidden_layers": LAYERS, "vocab_size": V}  # fmt: skip
    return ModelConfig.from_dict({**base, **entries})


def tiny_weights(seed: int = 0, tied: bool = True) -> dict[str, np.ndarray]:
    """HF-named float32 weights of the tiny model."""
    cfg = tiny_config(tie_word_embeddings=tied)
    rng = np.random.default_rng(seed)
    return {
        name: rng.standard_normal(shape).astype(np.float32) * (0.1 if len(shape) == 2 else 1.0)
        for name, shape in cfg.tensor_shapes().items()
    }


GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def write_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    qtypes: dict[str, Q] | None = None,
    arch: str = "llama",
    pre: str | None = "smollm",
    extra_tensors: dict[str, np.ndarray] | None = None,
    tokenizer: bool = True,
) -> Path:
    """Write HF-named float32 weights as llama.cpp would: GGUF names, q/k permuted, some quantized."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(KVH)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HD)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        if pre is not None:
            w.add_tokenizer_pre(pre)
        w.add_token_list(TOKENS)
        w.add_token_types([3] * len(SPECIALS) + [1] * (V - len(SPECIALS)))
        w.add_token_merges(MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_eot_token_id(0)
        w.add_add_bos_token(False)
        w.add_chat_template(CHATML)
    for hf, value in weights.items():
        if hf.endswith("q_proj.weight"):
            value = llama_cpp_permute(value, H)
        elif hf.endswith("k_proj.weight"):
            value = llama_cpp_permute(value, KVH)
        qtype = (qtypes or {}).get(hf, Q.F32)
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(gguf_name(hf), value.astype(np.float16 if qtype == Q.F16 else np.float32))
        else:
            w.add_tensor(gguf_name(hf), gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    for name, value in (extra_tensors or {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


QTYPES = {
    "model.embed_tokens.weight": Q.Q8_0,
    "model.layers.0.self_attn.v_proj.weight": Q.Q4_0,
    "model.layers.0.mlp.gate_proj.weight": Q.Q4_1,
    "model.layers.0.mlp.down_proj.weight": Q.Q8_0,
    "model.layers.1.self_attn.o_proj.weight": Q.BF16,
    "model.layers.1.mlp.up_proj.weight": Q.F16,
    "model.layers.1.self_attn.k_proj.weight": Q.Q4_1,  # permuted *and* quantized
}


def quant_tolerance(x: np.ndarray, qtype: Q) -> float:
    """Largest rounding error of a block quantization on x: half a step (blocks of 32 along rows).

    Q4_0 maps the block's largest magnitude to -8 steps, so values of the other sign clip at +7
    steps: a full step of error there.
    """
    blocks = x.reshape(-1, 32)
    amax, span = np.abs(blocks).max(), float(np.max(blocks.max(axis=1) - blocks.min(axis=1)))
    return {Q.Q8_0: amax / 127 / 2, Q.Q4_0: amax / 8, Q.Q4_1: span / 15 / 2}[qtype] + 1e-6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    weights = tiny_weights()
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", weights, QTYPES), weights


def test_tiny_config(tiny):
    cfg = load_gguf(tiny[0]).config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (D, F, LAYERS)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (H, KVH, HD, V)
    assert cfg.rope_theta == 50000.0 and cfg.rms_norm_eps == 1e-5  # f32 metadata read as the shortest decimal
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 256
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2, 0)  # EOS, then EOT
    assert cfg.rope_scaling is None


def test_tiny_weights_dequantize_to_originals(tiny):
    path, originals = tiny
    weights = load_gguf(path).weights
    assert set(weights) == set(originals)
    for name, want in originals.items():
        got = weights[name]
        assert got.dtype == np.float32 and got.shape == want.shape, name
        qtype = QTYPES.get(name, Q.F32)
        if qtype == Q.F32:
            np.testing.assert_array_equal(got, want, err_msg=name)  # includes the un-permuted q/k rows
        elif qtype in (Q.BF16, Q.F16):  # round to nearest: within half an ulp, relative
            np.testing.assert_allclose(got, want, rtol=2**-8 if qtype == Q.BF16 else 2**-11, atol=1e-7, err_msg=name)
        else:
            err = np.abs(got - want).max()
            assert 0 < err <= quant_tolerance(want, qtype), (name, qtype.name, err)


def test_unpermute_known_rows():
    # one head of width 4: HF rows (r0, r1 | r2, r3) are stored interleaved as (r0, r2, r1, r3)
    hf = np.arange(8, dtype=np.float32).reshape(4, 2)
    stored = llama_cpp_permute(hf, 1)
    np.testing.assert_array_equal(stored, hf[[0, 2, 1, 3]])
    np.testing.assert_array_equal(unpermute_rotary_rows(stored, 1), hf)
    many = np.random.default_rng(1).standard_normal((3 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rotary_rows(llama_cpp_permute(many, 3), 3), many)


def test_untied_model_has_lm_head(tmp_path):
    weights = tiny_weights(seed=2, tied=False)
    model = load_gguf(write_gguf(tmp_path / "untied.gguf", weights))
    assert not model.config.tie_word_embeddings
    np.testing.assert_array_equal(model.weights["lm_head.weight"], weights["lm_head.weight"])


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    base = tiny_config(rope_theta=50000.0, max_position_embeddings=256)
    scaled = ModelConfig.from_dict(
        {
            **base.to_dict(),
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    divisors = (rope_inv_freq(base).astype(np.float64) / rope_inv_freq(scaled)).astype(np.float32)  # what llama.cpp stores
    assert divisors.max() == pytest.approx(8.0) and divisors.min() == pytest.approx(1.0)
    cfg = load_gguf(write_gguf(tmp_path / "l3.gguf", tiny_weights(), extra_tensors={"rope_freqs.weight": divisors})).config
    assert cfg.rope_scaling == scaled.rope_scaling
    with pytest.raises(GGUFError, match="rope_freqs.weight does not match Llama 3"):
        load_gguf(
            write_gguf(
                tmp_path / "odd.gguf",
                tiny_weights(),
                extra_tensors={"rope_freqs.weight": np.linspace(1, 3, HD // 2, dtype=np.float32)},
            )
        )


# ---- errors: one line, naming the problem --------------------------------------------------------------
def test_wrong_architecture(tmp_path):
    with pytest.raises(GGUFError, match=r"architecture 'qwen2' is not supported \(only 'llama'\)"):
        load_gguf(write_gguf(tmp_path / "q.gguf", tiny_weights(), arch="qwen2"))


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "f64.gguf"
    weights = tiny_weights()
    del weights["model.layers.1.input_layernorm.weight"]
    write_gguf(path, weights, extra_tensors={"blk.1.attn_norm.weight": np.ones(D, dtype=np.float64)})
    with pytest.raises(GGUFError, match=r"tensor 'blk.1.attn_norm.weight' has type F64, which is not supported"):
        load_gguf(path)


def test_missing_and_unexpected_tensors(tmp_path):
    weights = tiny_weights()
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(GGUFError, match=r"no tensor for model.layers.1.mlp.up_proj.weight"):
        load_gguf(write_gguf(tmp_path / "missing.gguf", weights))
    with pytest.raises(GGUFError, match=r"unexpected tensor 'blk.0.attn_q.bias'"):
        load_gguf(
            write_gguf(tmp_path / "bias.gguf", tiny_weights(), extra_tensors={"blk.0.attn_q.bias": np.zeros(H * HD, np.float32)})
        )


def test_bad_files(tiny, tmp_path):
    with pytest.raises(GGUFError, match="no such file"):
        load_gguf(tmp_path / "absent.gguf")
    with pytest.raises(GGUFError, match="is a directory"):
        load_gguf(tmp_path)
    (tmp_path / "text.gguf").write_text("hello, not a model")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        load_gguf(tmp_path / "text.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        load_gguf(tmp_path / "empty.gguf")
    data = tiny[0].read_bytes()
    for cut in (6, 200, len(data) // 2, len(data) - 1):  # inside the version, the metadata, the tensor data
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="truncated") as e:
            load_gguf(tmp_path / "cut.gguf")
        assert "\n" not in str(e.value)


# ---- tokenizer from GGUF metadata ------------------------------------------------------------------
def tiny_tokenizer(tmp_path: Path, pre: str | None):
    return load_gguf_tokenizer(write_gguf(tmp_path / f"tok-{pre}.gguf", tiny_weights(), pre=pre))


def pieces(tok, text: str) -> list[str]:
    return [tok.id_to_token(i) for i in tok.encode(text)]


def test_tokenizer_from_gguf(tiny):
    model = load_gguf(tiny[0])
    assert (model.bos_token, model.eos_token, model.add_bos_token) == ("<|im_start|>", "<|im_end|>", False)
    tok = model.tokenizer()
    text = "hi wo 🚀 <|im_end|>"
    ids = tok.encode(text)
    assert tok.encode("<|im_start|>hi") == [1, TOKENS.index("hi")]  # special tokens match whole
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "hi wo 🚀 "
    assert pieces(tok, " wo") == ["Ġwo"]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids.count(2) == 1 and tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize(
    ("pre", "text", "want"),
    [
        ("smollm", "123", ["1", "2", "3"]),  # every digit alone
        ("gpt-2", "123", ["123"]),
        ("llama-bpe", "12345", ["123", "4", "5"]),  # digits in runs of at most three
        ("gpt-2", "don't", ["d", "o", "n", "'t"]),
        ("default", "don't", ["d", "o", "n", "'", "t"]),  # llama.cpp's default isolates punctuation first
    ],
)
def test_pre_tokenizer_follows_llama_cpp(tmp_path, pre, text, want):
    tok = tiny_tokenizer(tmp_path, pre)
    assert pieces(tok, text) == want
    assert tok.decode(tok.encode(text)) == text


def test_unknown_pre_tokenizer_warns(tmp_path):
    with pytest.warns(UserWarning, match="pre-tokenizer 'mystery' is not known here; using GPT-2's"):
        tok = tiny_tokenizer(tmp_path, "mystery")
    assert pieces(tok, "123") == ["123"]


def test_sentencepiece_vocab(tmp_path):
    """tokenizer.ggml.model 'llama': scores, byte fallback, a space prefix, BOS added."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁", "a", "b", "▁a", "ab", "▁ab", "▁b"]
    scores = [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0, -0.5, -6.0]
    types = [2, 3, 3] + [6] * 256 + [1] * 7
    path = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = load_gguf_tokenizer(path)
    ids = tok.encode("ab ab é")
    assert [tok.id_to_token(i) for i in ids] == ["<s>", "▁ab", "▁ab", "▁", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "ab ab é"
    assert tok.encode("ab", add_special_tokens=False) == [tokens.index("▁ab")]


# ---- conversion ----------------------------------------------------------------------------------
def test_convert_tiny_round_trip(tiny, tmp_path):
    path, _ = tiny
    out = convert_gguf(path, tmp_path / "hf")
    config = ModelConfig.from_dir(out)
    model = load_gguf(path)
    assert config == replace(model.config, dtype="bfloat16")
    weights = load_weights(out, config)
    for name, w in model.weights.items():
        np.testing.assert_array_equal(weights[name], to_bf16(w), err_msg=name)
    tok = load_tokenizer(out)
    assert tok.encode("hi wo 12") == model.tokenizer().encode("hi wo 12")
    assert tok.chat_template == CHATML and tok.eos_token == "<|im_end|>"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 0]
    convert_gguf(path, out)  # an earlier conversion may be overwritten


def test_convert_refuses_a_foreign_directory(tiny, tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(GGUFError, match="not empty and not an earlier GGUF conversion"):
        convert_gguf(tiny[0], tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


# ---- the real SmolLM2-135M-Instruct GGUF: its weights are loaded (slow) ----------------------------
@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_path()
    if path is None:
        pytest.skip(NOT_INSTALLED)
    return path, load_gguf(path)


@pytest.mark.slow
def test_smollm2_config(smollm2):
    cfg = smollm2[1].config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta) == (64, 1536, 49152, 100000.0)
    assert cfg.tie_word_embeddings and cfg.rope_scaling is None and cfg.rms_norm_eps == 1e-5
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,) and cfg.max_position_embeddings == 8192


@pytest.mark.slow
def test_smollm2_weights(smollm2):
    path, model = smollm2
    assert set(model.weights) == set(model.config.tensor_shapes())
    for name, shape in model.config.tensor_shapes().items():
        assert model.weights[name].shape == shape and model.weights[name].dtype == np.float32, name
    types = {t.qtype for t in read_gguf(path).tensors.values()}
    assert types == {Q.Q4_1, Q.Q8_0, Q.F32}
    norm = model.weights["model.layers.0.input_layernorm.weight"]  # F32: read exactly
    np.testing.assert_array_equal(norm, read_gguf(path).dequantize("blk.0.attn_norm.weight"))


@pytest.mark.slow
def test_smollm2_tokenizer_and_template(smollm2):
    tok = smollm2[1].tokenizer()
    assert (tok.bos_token, tok.eos_token, tok.eos_token_id, tok.vocab_size) == ("<|im_start|>", "<|im_end|>", 2, 49152)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM") and text.endswith(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.encode("Hello world") == [19556, 905]


@pytest.mark.slow
def test_smollm2_convert_round_trip(smollm2, tmp_path):
    path, model = smollm2
    out = convert_gguf(path, tmp_path / "smollm2")
    config = ModelConfig.from_dir(out)
    assert config.to_dict() == {**model.config.to_dict(), "torch_dtype": "bfloat16"}
    weights = load_weights(out, config)
    for name in (
        "model.embed_tokens.weight",
        "model.layers.7.self_attn.q_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
        "model.norm.weight",
    ):
        np.testing.assert_array_equal(weights[name], to_bf16(model.weights[name]), err_msg=name)
    tok, ours = load_tokenizer(out), model.tokenizer()
    for text in ("Hello world", "12345 + 678 = ?", "émojis 🚀 and ünïcödé", "<|im_start|>user\nhi<|im_end|>"):
        assert tok.encode(text) == ours.encode(text), text
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert tok.apply_chat_template(messages) == ours.apply_chat_template(messages)
