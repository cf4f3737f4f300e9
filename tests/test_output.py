"""Stop rules and streamed text of one request (OutputBuilder), on SmolLM2's real tokenizer."""


from numba_vllm.engine.lengths import LengthPolicy
from numba_vllm.engine.output import OutputBuilder, RequestOutput
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.model.config import ModelConfig
from tests.helpers.tiny_llama import tiny_config_dict

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


class TestWithTokenizer:
    """On SmolLM2's tokenizer (conftest.py's smollm2_tok: skipped when the model is not installed)."""

    def test_stream_concatenates_to_the_full_decode(self, smollm2_tok):
        ids = smollm2_tok.encode("Héllo wörld 🚀 and more text", add_special_tokens=False)
        out, b = builder(SamplingParams(max_tokens=len(ids)), smollm2_tok)
        pieces = [b.add(t) for t in ids]
        assert "".join(pieces) == out.text == smollm2_tok.decode(ids) and out.finish_reason == "length"

    def test_stop_string_cuts_the_text_and_holds_back_partial_matches(self, smollm2_tok):
        ids = smollm2_tok.encode("one two three four five", add_special_tokens=False)
        out, b = builder(SamplingParams(max_tokens=50, stop=["three f"]), smollm2_tok)
        pieces = []
        for t in ids:
            pieces.append(b.add(t))
            if out.finished:
                break
        assert out.finish_reason == "stop" and out.text == "one two " and "".join(pieces) == out.text
