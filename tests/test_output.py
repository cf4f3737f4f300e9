"""Stop rules and streamed text of one request (OutputBuilder), on SmolLM2's real tokenizer."""

import pytest
from test_smollm2 import HAVE_MODEL
from tiny_llama import tiny_config_dict

from numba_vllm.engine.lengths import LengthPolicy
from numba_vllm.engine.output import OutputBuilder, RequestOutput
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.model.config import ModelConfig

CONFIG = ModelConfig.from_dict(tiny_config_dict(eos_token_id=2))


def builder(params, tokenizer=None, prompt=(5, 6), max_model_len=256):
    out = RequestOutput("r", list(prompt))
    budget = LengthPolicy(max_model_len, CONFIG.vocab_size).max_new_tokens(len(prompt), params.max_tokens)
    return out, OutputBuilder(out, params, CONFIG, tokenizer, budget)


def test_eos_stops_and_is_kept_in_ids_but_ignore_eos_goes_on():
    out, b = builder(SamplingParams(max_tokens=10))
    b.add(7)
    b.add(2)
    assert out.token_ids == [7, 2] and out.finish_reason == "stop"
    out, b = builder(SamplingParams(max_tokens=3, ignore_eos=True))
    for t in (2, 2, 2):
        b.add(t)
    assert out.finish_reason == "length" and out.token_ids == [2, 2, 2]


def test_stop_token_ids_and_length_limit_of_the_model():
    out, b = builder(SamplingParams(max_tokens=100, stop_token_ids=[9]))
    b.add(9)
    assert out.finish_reason == "stop"
    out, b = builder(SamplingParams(max_tokens=100), prompt=[1] * 250, max_model_len=253)
    for t in (3, 4, 5):
        b.add(t)
    assert out.finish_reason == "length" and len(out.token_ids) == 3


@pytest.fixture(scope="module")
def tok():
    from numba_vllm.loading.checkpoint import default_model_path
    from numba_vllm.loading.gguf.importer import load_gguf_tokenizer

    return load_gguf_tokenizer(default_model_path())


@pytest.mark.skipif(not HAVE_MODEL, reason="default model not installed")
class TestWithTokenizer:
    def test_stream_concatenates_to_the_full_decode(self, tok):
        ids = tok.encode("Héllo wörld 🚀 and more text", add_special_tokens=False)
        out, b = builder(SamplingParams(max_tokens=len(ids)), tok)
        pieces = [b.add(t) for t in ids]
        assert "".join(pieces) == out.text == tok.decode(ids) and out.finish_reason == "length"

    def test_stop_string_cuts_the_text_and_holds_back_partial_matches(self, tok):
        ids = tok.encode("one two three four five", add_special_tokens=False)
        out, b = builder(SamplingParams(max_tokens=50, stop=["three f"]), tok)
        pieces = []
        for t in ids:
            pieces.append(b.add(t))
            if out.finished:
                break
        assert out.finish_reason == "stop" and out.text == "one two " and "".join(pieces) == out.text
