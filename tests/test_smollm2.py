"""The real default model (SmolLM2-135M-Instruct, GGUF) on the NumPy backend against transformers.

tests/data/smollm2_hf_reference.json (tests/helpers/smollm2.py) was produced by Hugging Face
transformers from the same GGUF in float32 with greedy decoding: the chat-templated prompt ids and
the generated ids. Both must match token for token, whether the prompts run one at a time or together
in one continuous batch. Skipped when the default model package is not installed.
"""

import pytest

from numba_vllm import LLM, SamplingParams
from tests.helpers.smollm2 import REF, needs_smollm2

pytestmark = [needs_smollm2, pytest.mark.slow]  # the real model on the NumPy backend: minutes
GREEDY = SamplingParams(temperature=0, max_tokens=REF["max_new_tokens"])


@pytest.fixture(scope="module")
def llm():
    return LLM(backend="numpy", max_num_seqs=3)  # fewer slots than prompts: some wait in the queue


def _conversation(case):
    return [{"role": "user", "content": case["prompt"]}]


@pytest.mark.parametrize("case", REF["prompts"][:2], ids=lambda c: c["prompt"][:24])
def test_one_prompt_matches_transformers(llm, case):
    ids = llm.tokenizer.apply_chat_template(_conversation(case), add_generation_prompt=True)
    assert ids == case["prompt_ids"]
    (out,) = llm.chat(_conversation(case), GREEDY)
    assert out.prompt_token_ids == case["prompt_ids"] and out.outputs[0].token_ids == case["greedy_ids"]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)


@pytest.mark.timeout(900)  # every reference prompt to its end: ~100 s on 2 cores
def test_all_prompts_batched_match_transformers(llm):
    outs = llm.chat([_conversation(c) for c in REF["prompts"]], GREEDY)
    for out, case in zip(outs, REF["prompts"], strict=True):
        assert out.prompt_token_ids == case["prompt_ids"]
        assert out.outputs[0].token_ids == case["greedy_ids"], case["prompt"]
