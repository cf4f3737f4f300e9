"""GGUF import: a llama.cpp model file -> `ModelConfig`, float32 weights under Hugging Face names, tokenizer.

A GGUF file is a header of typed key/value metadata (hyperparameters, vocabulary, merges, chat
template), a table of tensors (name, dimensions, ggml type, offset), then the aligned tensor data,
usually block-quantized (Q4_1 stores each run of 32 weights as 4-bit integers plus an f16 scale and
minimum). The header is parsed here with `struct`: `gguf.GGUFReader` builds a NumPy view per string
and takes seconds on a 49k-token vocabulary. Dequantization is the `gguf` package's.

A llama.cpp file differs from a Hugging Face checkpoint in three ways, all undone here:
- names: `blk.N.attn_q.weight` is `model.layers.N.self_attn.q_proj.weight`, and so on;
- shapes: GGUF lists dimensions fastest-varying first (`[in, out]`), the reverse of NumPy's `(out, in)`;
- rotary layout: llama.cpp's converter permutes the rows of q_proj and k_proj so that each head's
  rotary pairs sit side by side (interleaved) instead of half a head apart (HF's rotate-half).

The vocabulary becomes a Hugging Face `tokenizer.json` built with the `tokenizers` library, using the
pre-tokenizer llama.cpp picks for the file's `tokenizer.ggml.pre`. `convert_gguf` writes everything
out as a Hugging Face style directory with bf16 safetensors.
"""

from __future__ import annotations

import json
import math
import mmap
import re
import struct
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from .config import ConfigError, ModelConfig, RopeScaling
from .rope_scaling import rope_inv_freq
from .tokenizer import Tokenizer

Q = GGMLQuantizationType
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
DEFAULT_ALIGNMENT = 32

# Metadata value types of the GGUF format (8 = string and 9 = array are read separately).
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}

# llama.cpp token types (tokenizer.ggml.token_type) that matter here; the others are 5 (unused) and
# 6 (byte: the <0xNN> pieces of SentencePiece byte fallback, which the BPE model finds by name).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 2, 3, 4

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1+ RoPE scaling, stored as per-frequency divisors

# Pre-tokenizer regexes, by the llama.cpp `tokenizer.ggml.pre` names that use them.
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT_PATTERNS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_PATTERN, r"\p{N}+", r"[0-9][0-9][0-9]")  # applied in turn
_LLAMA3_PRES = ("llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe")
_DIGITS_PRES = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")
_GPT2_PRES = ("gpt-2", "gpt2", "mpt", "olmo", "jais")

CONVERTED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
SOURCE_KEY = "source_gguf"  # safetensors metadata key marking a directory that convert_gguf wrote


class GGUFError(ValueError):
    """A GGUF file is missing, malformed, truncated, or holds a model or tensor type we do not support."""


# ---- the file format ---------------------------------------------------------------------------
@dataclass(frozen=True)
class GGUFTensor:
    """One entry of the tensor table."""

    name: str
    shape: tuple[int, ...]  # NumPy order: (out, in) for a weight matrix
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


@dataclass
class GGUFFile:
    """A parsed GGUF header; tensor data stays in the memory-mapped file until asked for."""

    path: Path
    metadata: dict[str, Any]  # numeric arrays as NumPy arrays, string arrays as lists
    tensors: dict[str, GGUFTensor]
    buffer: mmap.mmap

    def dequantize(self, name: str) -> np.ndarray:
        """Tensor `name` as a float32 array of its NumPy shape, owning its memory."""
        t = self.tensors[name]
        if t.qtype not in SUPPORTED_TYPES:
            supported = ", ".join(q.name for q in SUPPORTED_TYPES)
            raise GGUFError(
                f"{self.path}: tensor {name!r} has type {t.qtype.name}, which is not supported (supported: {supported})"
            )
        block, type_size = GGML_QUANT_SIZES[t.qtype]
        raw = np.frombuffer(self.buffer, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        rows = raw.reshape(*t.shape[:-1], t.shape[-1] // block * type_size)  # (..., bytes per row) uint8
        out = dequantize(rows, t.qtype)  # (..., t.shape[-1]) float32
        return out.copy() if t.qtype == Q.F32 else out.astype(np.float32, copy=False)  # F32 is a view of the file


class _Cursor:
    """Little-endian reads from the mapped file; running off its end means the file is truncated."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.path, self.pos = buf, path, 0

    def truncated(self) -> GGUFError:
        return GGUFError(f"{self.path}: truncated or corrupt GGUF header (ends inside byte {self.pos})")

    def scalar(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise self.truncated() from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise self.truncated()
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: a metadata string at byte {self.pos - n} is not valid UTF-8") from None

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.scalar("<I"), self.scalar("<Q")
            if n > len(self.buf) - self.pos:  # every element takes at least one byte
                raise self.truncated()
            if etype in _SCALAR_FORMATS:  # numbers: one NumPy read, not n struct calls
                dtype = np.dtype(_SCALAR_FORMATS[etype])
                if self.pos + n * dtype.itemsize > len(self.buf):
                    raise self.truncated()
                arr = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).copy()
                self.pos += n * dtype.itemsize
                return arr
            return [self.value(etype) for _ in range(n)]
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise GGUFError(f"{self.path}: unknown metadata value type {vtype} at byte {self.pos - 4}")
        value = self.scalar(fmt)
        # An f32 read as a Python float shows its binary error (1e-5 -> 9.99999974e-06); keep the
        # shortest decimal that rounds to the same f32, which is what the converter was given.
        return float(str(np.float32(value))) if vtype == _FLOAT32 else value


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's metadata and tensor table (v2 or v3, little-endian); data stays mapped."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
            if magic != b"GGUF":
                raise GGUFError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise GGUFError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise GGUFError(f"{path}: is a directory, not a GGUF file") from None
    except OSError as e:
        raise GGUFError(f"{path}: cannot read ({e.strerror or e})") from None
    cur = _Cursor(buf, path)
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        hint = " (a big-endian file?)" if version > 0xFFFF else ""
        raise GGUFError(f"{path}: GGUF version {version} is not supported (supported: 2, 3){hint}")
    num_tensors, num_kv = cur.scalar("<Q"), cur.scalar("<Q")
    if num_tensors > len(buf) or num_kv > len(buf):
        raise cur.truncated()
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        num_dims = cur.scalar("<I")
        dims = [cur.scalar("<Q") for _ in range(num_dims)]  # fastest-varying first
        infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"{path}: general.alignment {alignment!r} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, type_id, offset in infos:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name!r} has unknown ggml type {type_id}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims and dims[0] % block:
            raise GGUFError(f"{path}: tensor {name!r} has rows of {dims[0]}, not a multiple of the {qtype.name} block ({block})")
        nbytes = math.prod(dims) // block * type_size
        start = data_start + offset
        if start + nbytes > len(buf):
            raise GGUFError(f"{path}: truncated (tensor {name!r} ends at byte {start + nbytes}, the file has {len(buf)})")
        tensors[name] = GGUFTensor(name, tuple(reversed(dims)), qtype, start, nbytes)
    return GGUFFile(path, metadata, tensors, buf)


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
        return _make_tokenizer(vars(self))


def load_gguf(path: str | Path) -> GGUFModel:
    """Read a Llama-architecture GGUF: config, dequantized weights (float32), tokenizer and template."""
    gf = read_gguf(path)
    config = _config(gf)
    return GGUFModel(config=config, weights=_weights(gf, config), **_tokenizer_fields(gf))


def load_gguf_tokenizer(path: str | Path) -> Tokenizer | None:
    """Only the tokenizer of a GGUF file (no weights are read), or None if it has no vocabulary."""
    return _make_tokenizer(_tokenizer_fields(read_gguf(path)))


def _meta(gf: GGUFFile, key: str, kind: type, default: Any = None, required: bool = False) -> Any:
    """Metadata value `key` checked to be of `kind` (int, float, str or bool); None if absent."""
    value = gf.metadata.get(key, default)
    if value is None:
        if required:
            raise GGUFError(f"{gf.path}: metadata {key} is missing")
        return None
    accepted = (int, float) if kind is float else kind
    if not isinstance(value, accepted) or (isinstance(value, bool) and kind is not bool):
        raise GGUFError(f"{gf.path}: metadata {key} is {value!r}, expected {kind.__name__}")
    return float(value) if kind is float else value


def _config(gf: GGUFFile) -> ModelConfig:
    arch = gf.metadata.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"{gf.path}: architecture {arch!r} is not supported (only 'llama')")
    hidden = _meta(gf, "llama.embedding_length", int, required=True)
    heads = _meta(gf, "llama.attention.head_count", int, required=True)
    head_dim = _meta(gf, "llama.attention.key_length", int) or _meta(gf, "llama.rope.dimension_count", int) or hidden // heads
    rope_dim = _meta(gf, "llama.rope.dimension_count", int, default=head_dim)
    if rope_dim != head_dim:
        raise GGUFError(
            f"{gf.path}: rope.dimension_count {rope_dim} differs from the head dim {head_dim} (partial RoPE is not supported)"
        )
    if _meta(gf, "llama.attention.value_length", int, default=head_dim) != head_dim:
        raise GGUFError(f"{gf.path}: attention.value_length differs from attention.key_length (not supported)")
    scaling_type = _meta(gf, "llama.rope.scaling.type", str, default="none")
    if scaling_type != "none":
        raise GGUFError(f"{gf.path}: rope.scaling.type {scaling_type!r} is not supported (only Llama 3 scaling via {ROPE_FREQS})")
    tokens = gf.metadata.get("tokenizer.ggml.tokens")
    vocab = _meta(gf, "llama.vocab_size", int) or (len(tokens) if isinstance(tokens, list) else None)
    if vocab is None and "token_embd.weight" in gf.tensors:
        vocab = gf.tensors["token_embd.weight"].shape[0]
    eos_ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        token_id = _meta(gf, key, int)
        if token_id is not None and token_id not in eos_ids:
            eos_ids.append(token_id)
    cfg = {
        "hidden_size": hidden,
        "num_hidden_layers": _meta(gf, "llama.block_count", int, required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": _meta(gf, "llama.attention.head_count_kv", int, default=heads),
        "head_dim": head_dim,
        "intermediate_size": _meta(gf, "llama.feed_forward_length", int, required=True),
        "vocab_size": vocab,
        "rms_norm_eps": _meta(gf, "llama.attention.layer_norm_rms_epsilon", float, default=1e-5),
        "rope_theta": _meta(gf, "llama.rope.freq_base", float, default=10000.0),
        "max_position_embeddings": _meta(gf, "llama.context_length", int, default=2048),
        "tie_word_embeddings": "output.weight" not in gf.tensors,
        "torch_dtype": "float32",
    }
    gen: dict[str, Any] = {"bos_token_id": _meta(gf, "tokenizer.ggml.bos_token_id", int), "eos_token_id": eos_ids}
    for key, name, kind in (("temp", "temperature", float), ("top_p", "top_p", float), ("top_k", "top_k", int)):
        value = _meta(gf, f"general.sampling.{key}", kind)
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
    original = _meta(gf, "llama.rope.scaling.original_context_length", int, default=8192)
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
    return f"model.layers.{int(m.group(1))}.{_LAYER_NAMES[m.group(2)]}.weight"


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


# ---- the tokenizer -------------------------------------------------------------------------------
def _tokenizer_fields(gf: GGUFFile) -> dict[str, Any]:
    """GGUFModel's tokenizer fields: tokenizer.json text, chat template, special token strings."""
    kind = _meta(gf, "tokenizer.ggml.model", str)
    tokens = gf.metadata.get("tokenizer.ggml.tokens")
    fields: dict[str, Any] = {"chat_template": _meta(gf, "tokenizer.chat_template", str), "add_bos_token": False}
    if kind in (None, "none", "no_vocab") or tokens is None:
        return {**fields, "tokenizer_json": None, "bos_token": None, "eos_token": None, "unk_token": None, "pad_token": None}
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise GGUFError(f"{gf.path}: tokenizer.ggml.tokens is not a list of strings")
    types = gf.metadata.get("tokenizer.ggml.token_type")
    types = np.full(len(tokens), TOKEN_NORMAL) if types is None else np.asarray(types)
    if types.shape != (len(tokens),):
        raise GGUFError(f"{gf.path}: tokenizer.ggml.token_type has {types.size} entries for {len(tokens)} tokens")

    def special(key: str) -> tuple[int | None, str | None]:
        token_id = _meta(gf, f"tokenizer.ggml.{key}_token_id", int)
        if token_id is None:
            return None, None
        if not 0 <= token_id < len(tokens):
            raise GGUFError(
                f"{gf.path}: tokenizer.ggml.{key}_token_id {token_id} is outside the vocabulary ({len(tokens)} tokens)"
            )
        return token_id, tokens[token_id]

    (bos_id, bos), (_, unk) = special("bos"), special("unknown")
    if kind == "gpt2":
        hf = _byte_level_bpe(gf, tokens)
    elif kind == "llama":
        hf = _sentencepiece_bpe(gf, tokens, types, unk)
    else:
        raise GGUFError(f"{gf.path}: tokenizer model {kind!r} is not supported (supported: gpt2, llama)")
    # Control and unknown pieces are special (skipped when decoding); user-defined ones are plain
    # added tokens. All are in the vocabulary already: adding them makes them match whole, first.
    hf.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i in np.flatnonzero((types == TOKEN_CONTROL) | (types == TOKEN_UNKNOWN))
        ]
    )
    hf.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in np.flatnonzero(types == TOKEN_USER_DEFINED)])
    add_bos = _meta(gf, "tokenizer.ggml.add_bos_token", bool, default=(kind == "llama"))
    if add_bos and bos is not None:
        hf.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return {
        **fields,
        "tokenizer_json": hf.to_str(),
        "bos_token": bos,
        "eos_token": special("eos")[1],
        "unk_token": unk,
        "pad_token": special("padding")[1],
        "add_bos_token": bool(add_bos),
    }


def _byte_level_bpe(gf: GGUFFile, tokens: list[str]) -> HFTokenizer:
    """GPT-2 style byte-level BPE: vocab and merges as stored, the pre-tokenizer llama.cpp would use."""
    merges = gf.metadata.get("tokenizer.ggml.merges") or []
    pairs = [tuple(m.split(" ")) for m in merges]
    bad = next((m for m, p in zip(merges, pairs, strict=True) if len(p) != 2), None)
    if bad is not None:
        raise GGUFError(f"{gf.path}: malformed merge {bad!r} in tokenizer.ggml.merges")
    pre = _meta(gf, "tokenizer.ggml.pre", str)
    vocab = {t: i for i, t in enumerate(tokens)}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _LLAMA3_PRES))
    hf.pre_tokenizer = _pre_tokenizer(gf, pre)
    hf.decoder = decoders.ByteLevel()
    return hf


def _pre_tokenizer(gf: GGUFFile, pre: str | None) -> pre_tokenizers.PreTokenizer:
    """Split text the way llama.cpp does for `tokenizer.ggml.pre`, then map bytes to BPE symbols."""
    to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _LLAMA3_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), "isolated"), to_bytes])
    if pre in _DIGITS_PRES:  # every digit alone, then GPT-2's regex
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    if pre in (None, "default"):
        if pre is None:
            warnings.warn(f"{gf.path.name}: no tokenizer.ggml.pre; using llama.cpp's default pre-tokenizer", stacklevel=5)
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(p), "isolated") for p in _DEFAULT_PATTERNS] + [to_bytes])
    if pre not in _GPT2_PRES:
        warnings.warn(
            f"{gf.path.name}: pre-tokenizer {pre!r} is not known here; using GPT-2's (tokenization may differ)", stacklevel=5
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _sentencepiece_bpe(gf: GGUFFile, tokens: list[str], types: np.ndarray, unk: str | None) -> HFTokenizer:
    """SentencePiece (Llama 1/2) vocabulary as HF's Llama tokenizer does it: BPE with byte fallback.

    The file has scores, not merges. SentencePiece joins the adjacent pair whose joined piece scores
    highest, so the merges are every split of a piece into two pieces, ordered by the joined piece's
    score (ties by vocabulary order), over normal and user-defined pieces only.
    """
    scores = gf.metadata.get("tokenizer.ggml.scores")
    scores = np.zeros(len(tokens)) if scores is None else np.asarray(scores, dtype=np.float64)
    mergeable = {t: i for i, t in enumerate(tokens) if int(types[i]) in (TOKEN_NORMAL, TOKEN_USER_DEFINED)}
    ranked = []
    for piece, piece_id in mergeable.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-scores[piece_id], piece_id, mergeable[left], mergeable[right], left, right))
    ranked.sort()
    merges = [(left, right) for *_, left, right in ranked]
    vocab = {t: i for i, t in enumerate(tokens)}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    space_prefix = _meta(gf, "tokenizer.ggml.add_space_prefix", bool, default=True)
    steps = [normalizers.Prepend("▁")] if space_prefix else []
    hf.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tail = [decoders.Strip(" ", 1, 0)] if space_prefix else []  # after Fuse: the text's first space only
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *tail])
    return hf


def _make_tokenizer(fields: dict[str, Any]) -> Tokenizer | None:
    if fields["tokenizer_json"] is None:
        return None
    return Tokenizer.from_json(
        fields["tokenizer_json"], fields["chat_template"], fields["bos_token"], fields["eos_token"], fields["add_bos_token"]
    )


# ---- conversion ----------------------------------------------------------------------------------
def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write a GGUF model as a Hugging Face style directory: config, bf16 safetensors, tokenizer.

    `out_dir` must be new, empty, or an earlier output of this function (then it is overwritten).
    """
    from .bf16 import to_bf16
    from .weights import read_metadata, save_safetensors

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
