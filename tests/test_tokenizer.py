"""Tokenizer: encode/decode and BOS policy, chat templates rendered as transformers renders them, and
incremental detokenization (no half characters, no lost spaces, same text as a full decode).

Small tokenizers are built here with the `tokenizers` library; the last tests compare the tokenizer
built from the SmolLM2 GGUF with ids produced by Hugging Face transformers (tests/data), when present.
"""

from __future__ import annotations

import json
from datetime import datetime

import pytest
from tokenizers import AddedToken, decoders, models
from tokenizers import Tokenizer as HFTokenizer

from numba_vllm.loading.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer, TokenizerError, load_tokenizer
from tests.helpers.smollm2 import REF
from tests.helpers.tokenizers import CHATML, MERGES, SPECIALS, byte_level_json

LLAMA3 = """{{- bos_token }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""






def byte_level(chat_template: str | None = CHATML, add_bos_token: bool = False, bos_post_processor: bool = False) -> Tokenizer:
    return Tokenizer.from_json(
        byte_level_json(bos_post_processor), chat_template, "<|begin_of_text|>", "<|eot_id|>", add_bos_token
    )


def sentencepiece() -> Tokenizer:
    """A Llama-2 style tokenizer: '▁' for spaces, byte-fallback pieces, decoder dropping the first space."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁Hello", "▁world", "!", "▁"]
    vocab = {t: i for i, t in enumerate(pieces)}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return Tokenizer.from_json(hf.to_str(), None, "<s>", "</s>", True)


# ---- encode / decode ---------------------------------------------------------------------------------
def test_encode_decode_round_trip():
    tok = byte_level()
    text = "hi the wo 🚀 ünïcödé\n\t<|im_end|>"
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == text.removesuffix("<|im_end|>")
    assert tok.id_to_token(tok.encode(" the")[0]) == "Ġthe"
    assert tok.encode("<|im_start|>hi") == [tok.token_to_id("<|im_start|>"), tok.token_to_id("hi")]
    assert tok.vocab_size == 256 + len(MERGES) + len(SPECIALS)
    assert tok.id_to_token(10**6) is None


def test_bos_policy():
    bos = byte_level().token_to_id("<|begin_of_text|>")
    assert byte_level(add_bos_token=False).encode("hi") == [byte_level().token_to_id("hi")]
    assert byte_level(add_bos_token=True).encode("hi")[:1] == [bos]
    assert byte_level(add_bos_token=True).encode("hi", add_special_tokens=False)[:1] != [bos]
    # a tokenizer.json that adds BOS itself (Llama 3) never gets a second one
    assert byte_level(add_bos_token=True, bos_post_processor=True).encode("hi").count(bos) == 1
    assert byte_level(add_bos_token=False, bos_post_processor=True).encode("hi")[:1] == [bos]


def test_special_tokens_and_stop_ids():
    tok = byte_level()
    assert tok.eos_token_id == tok.token_to_id("<|eot_id|>") and tok.stop_token_ids == (tok.eos_token_id,)
    with pytest.raises(TokenizerError, match="eos_token '<missing>' is not in the vocabulary"):
        Tokenizer.from_json(byte_level_json(), None, None, "<missing>")
    with pytest.raises(TokenizerError, match="invalid tokenizer.json"):
        Tokenizer.from_json("{not json")


# ---- model directories -----------------------------------------------------------------------------
def test_from_dir(tmp_path):
    assert load_tokenizer(tmp_path) is None  # no tokenizer.json: token-id prompts only
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text(byte_level_json())
    cfg = {
        "bos_token": {"content": "<|begin_of_text|>", "special": True},
        "eos_token": "<|eot_id|>",
        "add_bos_token": True,
        "chat_template": LLAMA3,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_token, tok.eos_token, tok.add_bos_token, tok.chat_template) == (
        "<|begin_of_text|>",
        "<|eot_id|>",
        True,
        LLAMA3,
    )
    (tmp_path / "chat_template.jinja").write_text(CHATML)  # newer transformers keep the template here
    assert Tokenizer.from_dir(tmp_path).chat_template == CHATML
    (tmp_path / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: not valid JSON"):
        Tokenizer.from_dir(tmp_path)


# ---- chat templates --------------------------------------------------------------------------------
def test_chatml_template():
    tok = byte_level(CHATML)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False) == text.removesuffix(
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages) == tok.encode(text, add_special_tokens=False)


def test_llama3_template_has_one_bos():
    tok = byte_level(LLAMA3, add_bos_token=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  hi \n"}]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = tok.apply_chat_template(messages)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1  # the template's BOS only


def test_template_helpers():
    source = (
        "{{ messages | tojson }}|{{ strftime_now('%Y') }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}"
    )
    tok = byte_level(source)
    out = tok.apply_chat_template([{"role": "user", "content": "<é>"}, {"role": "assistant", "content": "x"}], tokenize=False)
    assert out == f'[{{"role": "user", "content": "<é>"}}, {{"role": "assistant", "content": "x"}}]|{datetime.now():%Y}|user'
    assert (
        byte_level("{{ tools }}-{{ date_string }}").apply_chat_template([{"role": "user"}], tokenize=False, date_string="today")
        == "None-today"
    )


def test_template_errors():
    strict = byte_level(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with the user') }}{% endif %}ok"
    )
    assert strict.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "ok"
    with pytest.raises(ChatTemplateError, match="^chat template: Conversations must start with the user$"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        byte_level("{% for m in messages %}").apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        byte_level(None).apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="list of"):
        byte_level().apply_chat_template("hello")
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        byte_level("{{ messages[0]['content'] + 1 }}").apply_chat_template([{"role": "user", "content": "x"}])
    assert not byte_level(None).has_chat_template and byte_level().has_chat_template


# ---- incremental detokenization ------------------------------------------------------------------------
def stream(tok: Tokenizer, ids: list[int], prompt_ids: list[int] = (), skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens)
    return [detok.add(i) for i in ids] + [detok.flush()]


def test_stream_holds_back_split_characters():
    tok = byte_level()
    ids = tok.encode("a 🚀 é!")  # the rocket is 4 byte tokens, é is 2
    assert len(ids) == 10
    chunks = stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids) == "a 🚀 é!"
    assert not any("\ufffd" in c for c in chunks)
    assert chunks[:6] == ["a", " ", "", "", "", "🚀"]  # the space is its own token here (no merge)


def test_stream_keeps_spaces_the_decoder_strips():
    tok = sentencepiece()
    hello, world, bang = (tok.token_to_id(t) for t in ("▁Hello", "▁world", "!"))
    assert tok.decode([world]) == "world"  # decoding one token alone would lose its space
    assert stream(tok, [hello, world, bang]) == ["Hello", " world", "!", ""]
    assert "".join(stream(tok, [world, bang], prompt_ids=[tok.bos_token_id, hello])) == " world!"
    rocket = [tok.token_to_id(f"<0x{b:02X}>") for b in "🚀".encode()]
    assert stream(tok, [hello, *rocket]) == ["Hello", "", "", "", "🚀", ""]


def test_stream_matches_full_decode_with_prompt_and_specials():
    tok = byte_level()
    prompt = tok.encode("<|im_start|>user\nhi wo<|im_end|>\n")
    out = tok.encode("the ünïcödé 🚀 wo<|im_end|>")
    assert "".join(stream(tok, out, prompt)) == tok.decode(prompt + out)[len(tok.decode(prompt)) :]
    assert "".join(stream(tok, out, prompt, skip_special_tokens=False)).endswith("<|im_end|>")


def test_flush_emits_an_unfinished_character():
    tok = byte_level()
    ids = tok.encode("ok🚀")[:-1]  # the rocket's 4th byte never came
    assert stream(tok, ids) == ["o", "k", "", "", "", "\ufffd"]


# ---- the real SmolLM2 tokenizer (conftest.py's smollm2_tok) against Hugging Face transformers -------------
def test_smollm2_chat_prompts_match_transformers(smollm2_tok):
    for case in REF["prompts"]:
        messages = [{"role": "user", "content": case["prompt"]}]
        assert smollm2_tok.apply_chat_template(messages, tokenize=False) == case["template_text"]
        assert smollm2_tok.apply_chat_template(messages) == case["prompt_ids"], case["prompt"]
        assert smollm2_tok.decode(case["greedy_ids"], skip_special_tokens=False) == case["greedy_text"]
        assert "".join(stream(smollm2_tok, case["greedy_ids"], case["prompt_ids"])) == smollm2_tok.decode(case["greedy_ids"])


def test_smollm2_encodings_match_the_digit_splitting_tokenizer(smollm2_tok):
    # SmolLM2's own tokenizer.json and llama.cpp split digits one by one ('smollm'); transformers'
    # GGUF loader does not, so compare with its digit-splitting ids (the same for most strings).
    for case in REF["plain_encodings"]:
        assert smollm2_tok.encode(case["text"]) == case["ids_digits_pretokenizer"], case["text"]
        assert smollm2_tok.decode(case["ids"], skip_special_tokens=False) == case["text"]
    for case in REF["pretokenizer_divergence_cases"]:
        assert smollm2_tok.encode(case["text"]) == case["digits_pretokenizer_ids"], case["text"]


def test_smollm2_emoji_streams_whole(smollm2_tok):
    ids = smollm2_tok.encode("Go 🚀 now")
    assert [smollm2_tok.id_to_token(i) for i in ids][1:4] == ["ĠðŁ", "ļ", "Ģ"]  # one character, three tokens
    assert stream(smollm2_tok, ids) == ["Go", "", "", " 🚀", " now", ""]
