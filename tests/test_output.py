"""Stop rules and streamed text of one request (OutputBuilder), on SmolLM2's real tokenizer."""


from numba_vllm.engine.lengths import LengthPolicy
from numba_vllm.engine.output import CompletionOutput, OutputBuilder, RequestOutput
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.model.config import ModelConfig
from tests.helpers.tiny_llama import tiny_config_dict

CONFIG = ModelConfig.from_dict(tiny_config_dict(eos_token_id=2))


def builder(params, tokenizer=None, prompt=(5, 6), max_model_len=256):
    """A builder for one sequence, and that sequence (a CompletionOutput)."""
    request = RequestOutput("r", None, list(prompt), [CompletionOutput(0)])
    budget = LengthPolicy(max_model_len, CONFIG.vocab_size).max_new_tokens(len(prompt), params.max_tokens)
    return request.outputs[0], OutputBuilder(request, request.outputs[0], params, CONFIG, tokenizer, budget)


def test_eos_stops_and_is_kept_in_ids_but_ignore_eos_goes_on():
    out, b = builder(SamplingParams(max_tokens=10))
    b.add(7)
    b.add(2)
    assert out.token_ids == [7, 2] and out.finish_reason == "stop" and out.stop_reason is None  # EOS: no stop_reason
    out, b = builder(SamplingParams(max_tokens=3, ignore_eos=True))
    for t in (2, 2, 2):
        b.add(t)
    assert out.finish_reason == "length" and out.token_ids == [2, 2, 2]


def test_stop_token_ids_and_length_limit_of_the_model():
    out, b = builder(SamplingParams(max_tokens=100, stop_token_ids=[9]))
    b.add(9)
    assert out.finish_reason == "stop" and out.stop_reason == 9 and out.token_ids == [9]
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
            if out.finished():
                break
        assert out.finish_reason == "stop" and out.text == "one two " and "".join(pieces) == out.text
        assert out.stop_reason == "three f"


def test_request_output_has_vllms_fields_and_is_finished_when_every_sequence_is():
    request = RequestOutput("r", "hi", [5, 6], [CompletionOutput(0), CompletionOutput(1)])
    assert (request.prompt, request.prompt_logprobs, request.num_cached_tokens, request.error) == ("hi", None, 0, None)
    c = request.outputs[0]
    assert (c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason) == (
        0, "", [], None, None, None, None
    )
    request.outputs[0].finish_reason = "length"
    assert request.outputs[0].finished() and not request.finished
    request.outputs[1].finish_reason = "stop"
    assert request.finished


def test_fail_marks_the_sequence_and_the_request():
    out, b = builder(SamplingParams(max_tokens=5))
    b.add(7)
    b.fail("the engine step failed: boom")
    assert out.finish_reason == "error" and out.token_ids == [7] and b.output.error == "the engine step failed: boom"
