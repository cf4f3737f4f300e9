"""A GGUF file's vocabulary as a Hugging Face tokenizer: `tokenizer.json` text and special tokens.

The vocabulary becomes a Hugging Face `tokenizer.json` built with the `tokenizers` library, using the
pre-tokenizer llama.cpp picks for the file's `tokenizer.ggml.pre`. Two tokenizer models are
supported: `gpt2` (byte-level BPE with stored merges) and `llama` (SentencePiece scores, turned
into BPE merges with byte fallback, as Hugging Face's Llama tokenizer does).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from numba_vllm.loading.gguf.reader import GGUFError, GGUFFile
from numba_vllm.loading.tokenizer import Tokenizer

# llama.cpp token types (tokenizer.ggml.token_type) that matter here; the others are 5 (unused) and
# 6 (byte: the <0xNN> pieces of SentencePiece byte fallback, which the BPE model finds by name).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 2, 3, 4

# Pre-tokenizer regexes, by the llama.cpp `tokenizer.ggml.pre` names that use them.
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT_PATTERNS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_PATTERN, r"\p{N}+", r"[0-9][0-9][0-9]")  # applied in turn
_LLAMA3_PRES = ("llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe")
_DIGITS_PRES = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")
_GPT2_PRES = ("gpt-2", "gpt2", "mpt", "olmo", "jais")


def tokenizer_fields(gf: GGUFFile) -> dict[str, Any]:
    """GGUFModel's tokenizer fields: tokenizer.json text, chat template, special token strings."""
    kind = gf.meta("tokenizer.ggml.model", str)
    tokens = gf.metadata.get("tokenizer.ggml.tokens")
    fields: dict[str, Any] = {"chat_template": gf.meta("tokenizer.chat_template", str), "add_bos_token": False}
    if kind in (None, "none", "no_vocab") or tokens is None:
        return {**fields, "tokenizer_json": None, "bos_token": None, "eos_token": None, "unk_token": None, "pad_token": None}
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise GGUFError(f"{gf.path}: tokenizer.ggml.tokens is not a list of strings")
    types = gf.metadata.get("tokenizer.ggml.token_type")
    types = np.full(len(tokens), TOKEN_NORMAL) if types is None else np.asarray(types)
    if types.shape != (len(tokens),):
        raise GGUFError(f"{gf.path}: tokenizer.ggml.token_type has {types.size} entries for {len(tokens)} tokens")

    def special(key: str) -> tuple[int | None, str | None]:
        token_id = gf.meta(f"tokenizer.ggml.{key}_token_id", int)
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
    add_bos = gf.meta("tokenizer.ggml.add_bos_token", bool, default=(kind == "llama"))
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
    pre = gf.meta("tokenizer.ggml.pre", str)
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
    space_prefix = gf.meta("tokenizer.ggml.add_space_prefix", bool, default=True)
    steps = [normalizers.Prepend("▁")] if space_prefix else []
    hf.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tail = [decoders.Strip(" ", 1, 0)] if space_prefix else []  # after Fuse: the text's first space only
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *tail])
    return hf


def make_tokenizer(fields: dict[str, Any]) -> Tokenizer | None:
    """The `Tokenizer` that `tokenizer_fields` describes (GGUFModel has the same fields); None without a vocabulary."""
    if fields["tokenizer_json"] is None:
        return None
    return Tokenizer.from_json(
        fields["tokenizer_json"], fields["chat_template"], fields["bos_token"], fields["eos_token"], fields["add_bos_token"]
    )
