"""include_stop_str_in_output, skip_special_tokens and min_tokens in the output builder, and
bad_words end to end (SmolLM2's real tokenizer for the first, a tiny model with a byte-level BPE for
the last)."""

import pytest

from numba_vllm import LLM, SamplingParams
from numba_vllm.engine.lengths import LengthPolicy
from numba_vllm.engine.output import CompletionOutput, OutputBuilder, RequestOutput
from numba_vllm.model.config import ModelConfig
from tests.helpers.tiny_llama import tiny_config_dict, write_chat_checkpoint

CONFIG = ModelConfig.from_dict(tiny_config_dict(eos_token_id=2, vocab_size=50000))


def _run(params, tokenizer, ids):
    request = RequestOutput("r", None, [1], [CompletionOutput(0)])
    budget = LengthPolicy(4096, CONFIG.vocab_size).max_new_tokens(1, params.max_tokens)
    b = OutputBuilder(request, request.outputs[0], params, CONFIG, tokenizer, budget)
    for t in ids:
        b.add(t)
        if request.outputs[0].finish_reason:
            break
    return request.outputs[0]


def test_include_stop_str_in_output(smollm2_tok):
    ids = smollm2_tok.encode("Hello world. Bye now", add_special_tokens=False)
    assert _run(SamplingParams(stop=["world"], max_tokens=50), smollm2_tok, ids).text == "Hello "
    out = _run(SamplingParams(stop=["world"], max_tokens=50, include_stop_str_in_output=True), smollm2_tok, ids)
    assert out.text == "Hello world" and out.stop_reason == "world"


def test_skip_special_tokens_false_keeps_them(smollm2_tok):
    special = smollm2_tok.token_to_id("<|im_start|>")
    ids = [special] + smollm2_tok.encode("user", add_special_tokens=False)
    assert _run(SamplingParams(max_tokens=len(ids)), smollm2_tok, ids).text == "user"
    assert _run(SamplingParams(max_tokens=len(ids), skip_special_tokens=False), smollm2_tok, ids).text == "<|im_start|>user"


def test_stop_strings_wait_for_min_tokens(smollm2_tok):
    ids = smollm2_tok.encode("Hi there. Hi again", add_special_tokens=False)
    early = _run(SamplingParams(stop=["Hi"], max_tokens=50), smollm2_tok, ids)
    assert early.text == "" and early.finish_reason == "stop"
    late = _run(SamplingParams(stop=["Hi"], max_tokens=50, min_tokens=2), smollm2_tok, ids)
    assert late.text == "Hi there. " and late.finish_reason == "stop"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return str(write_chat_checkpoint(tmp_path_factory.mktemp("chat"), hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, intermediate_size=64))  # fmt: skip


def test_bad_words_mask_the_word(chat_model):
    llm = LLM(chat_model, backend="numpy")
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = llm.generate(["ab"], greedy, use_tqdm=False)[0].outputs[0].token_ids[0]
    word = llm.tokenizer.decode([first])
    assert llm.tokenizer.encode(word, add_special_tokens=False) == [first]
    banned = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, bad_words=[word])
    out = llm.generate(["ab"], banned, use_tqdm=False)[0].outputs[0]
    assert first not in out.token_ids
