"""Logprobs, echo and the sampling fields through the server, with the official `openai` client.

A tiny random model with a byte-level BPE and ChatML (numpy backend) behind a real server; what each
answer must hold comes from `LLM.generate` on the same checkpoint (whose logprobs are tested against
transformers in test_logprobs.py): the completions logprobs object (tokens, token_logprobs,
top_logprobs, text_offset) with and without echo, echo with max_tokens 0, streamed and not; chat's
logprobs.content with top_logprobs; penalties and logit_bias changing the output as offline.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from numba_vllm import LLM, SamplingParams  # noqa: E402
from tests.helpers.server import TINY_NAME, ServerThread  # noqa: E402
from tests.helpers.tiny_llama import write_chat_checkpoint  # noqa: E402

PROMPT = "hello there"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = write_chat_checkpoint(tmp_path_factory.mktemp("chat"), hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256)  # fmt: skip
    llm = LLM(str(path), backend="numpy", max_model_len=256)
    server = ServerThread(LLM(str(path), backend="numpy", max_model_len=256).engine, [TINY_NAME])
    yield server, llm
    server.close()


def _offline(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


def test_completion_logprobs_and_echo(served):
    server, llm = served
    client = server.client()
    want = _offline(llm, PROMPT, temperature=0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    r = client.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3, echo=True,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    choice = r.choices[0]
    lp = choice.logprobs
    n = len(want.prompt_token_ids)
    assert choice.text == PROMPT + want.outputs[0].text
    all_ids = want.prompt_token_ids + want.outputs[0].token_ids
    assert len(lp.tokens) == n + 4 and "".join(lp.tokens) == llm.tokenizer.decode(all_ids, skip_special_tokens=False)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    prompt_want = [d[t].logprob for d, t in zip(want.prompt_logprobs[1:], want.prompt_token_ids[1:], strict=True)]
    out_want = [d[t].logprob for d, t in zip(want.outputs[0].logprobs, want.outputs[0].token_ids, strict=True)]
    assert lp.token_logprobs[1:] == pytest.approx(prompt_want + out_want, abs=1e-6)
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs[1:])  # keyed by text: tokens of equal text collapse
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_echo_with_max_tokens_0_gives_the_prompt_alone(served):
    server, _ = served
    r = server.client().completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == PROMPT and r.usage.completion_tokens == 0 and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == r.usage.prompt_tokens


def test_streamed_logprobs_match_the_whole_answer(served):
    server, _ = served
    client = server.client()
    args = dict(model=TINY_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2, echo=True,
                extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.completions.create(**args).choices[0]
    tokens, logprobs, text = [], [], ""
    for chunk in client.completions.create(stream=True, **args):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                logprobs += c.logprobs.token_logprobs
    assert text == whole.text and tokens == whole.logprobs.tokens and logprobs == whole.logprobs.token_logprobs


def test_chat_logprobs_with_top_logprobs(served):
    server, llm = served
    client = server.client()
    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
    content = r.choices[0].logprobs.content
    ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    want = _offline(llm, ids, temperature=0, max_tokens=3, ignore_eos=True, logprobs=2).outputs[0]
    sampled = zip(want.logprobs, want.token_ids, strict=True)
    assert [c.logprob for c in content] == pytest.approx([d[t].logprob for d, t in sampled])
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert all(c.bytes == list(c.token.encode()) for c in content)
    streamed = client.chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=3, temperature=0, logprobs=True,
                                              top_logprobs=2, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    got = [c.logprob for chunk in streamed for ch in chunk.choices if ch.logprobs for c in ch.logprobs.content]
    assert got == pytest.approx([c.logprob for c in content])


def test_penalties_and_logit_bias_as_offline(served):
    server, llm = served
    fields = dict(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.5, min_p=0.1, min_tokens=2)
    want = _offline(llm, PROMPT, temperature=0, max_tokens=6, logit_bias={101: 5.0}, **fields).outputs[0]
    r = server.client().completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={"101": 5.0},
                                           frequency_penalty=0.5, presence_penalty=0.5,
                                           extra_body={"repetition_penalty": 1.5, "min_p": 0.1, "min_tokens": 2})  # fmt: skip
    assert r.choices[0].text == want.text


def test_n_choices_with_echo_and_logprobs(served):
    server, _ = served
    r = server.client().completions.create(model=TINY_NAME, prompt=[PROMPT, "bye"], n=2, max_tokens=3, echo=True, logprobs=1,
                                           seed=5, extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        prompt = PROMPT if c.index < 2 else "bye"
        assert c.text.startswith(prompt) and c.logprobs.token_logprobs[0] is None
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(c.logprobs.text_offset)


def test_the_openapi_schema_lists_the_sampling_fields(served):
    import httpx

    server, _ = served
    schemas = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        fields = schemas[name]["properties"]
        for field in ("repetition_penalty", "min_p", "min_tokens", "bad_words", "logit_bias", "include_stop_str_in_output",
                      "skip_special_tokens", "prompt_logprobs", "logprobs"):  # fmt: skip
            assert field in fields, (name, field)
    assert "echo" in schemas["CompletionRequest"]["properties"]
    assert "top_logprobs" in schemas["ChatCompletionRequest"]["properties"]


def test_prompt_logprobs_field(served):
    """vLLM's extension: `prompt_logprobs: k` gives each choice a prompt_logprobs list (None first)."""
    server, llm = served
    want = _offline(llm, PROMPT, max_tokens=1, prompt_logprobs=2)
    r = server.client().completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want.prompt_token_ids)
    for g, w in zip(got[1:], want.prompt_logprobs[1:], strict=True):
        assert {int(t): (v["logprob"], v["rank"]) for t, v in g.items()} == {t: (lp.logprob, lp.rank) for t, lp in w.items()}
