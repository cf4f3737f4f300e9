"""The model-server protocol: on /metrics the series routers and the Gateway API Inference Extension
read, under vLLM's names with vLLM's `model_name` label, beside the `numba_vllm:` ones (expected
names and values are written out here, vLLM's names as its servers publish them, not derived from the
code's own table); and vLLM's /tokenize, which prefix-aware routers call, checked against the
`tokenizers` library and against what /v1/chat/completions runs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

from numba_vllm.engine.stats import EngineStats  # noqa: E402
from numba_vllm.server.metrics import ServerMetrics, parse_metrics  # noqa: E402

MODEL = "org/model-1B"


def _stats(**kw) -> EngineStats:
    values = dict(
        num_running=3, num_waiting=2, num_free_slots=5, num_pages=40, num_pages_used=10, num_pages_free=30,
        num_preemptions=4, num_steps=99, max_model_len=640, prefix_caching=True, num_cached_pages=12,
        num_prefix_cache_queries=300, num_prefix_cache_hits=96,
    )  # fmt: skip
    values.update(kw)
    return EngineStats(**values)


def test_vllm_names_with_model_name_label_beside_numba_vllm_names():
    m = ServerMetrics(_stats(), MODEL)
    m.prompt_tokens.inc(7)
    m.generation_tokens.inc(5)
    m.finished.labels("stop").inc(2)
    for seconds in (0.003, 0.03):
        m.ttft.observe(seconds)
    m.tpot.observe(0.02)
    m.e2e.observe(1.5)
    values = parse_metrics(m.render().decode())
    label = f'model_name="{MODEL}"'
    want = {
        # what the inference extension scrapes: queue, running requests, KV-cache use, page size and count
        f"vllm:num_requests_waiting{{{label}}}": 2,
        f"vllm:num_requests_running{{{label}}}": 3,
        f"vllm:kv_cache_usage_perc{{{label}}}": 0.25,
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="40"}': 1,
        # the rest of vLLM's series
        f"vllm:num_preemptions_total{{{label}}}": 4,
        f"vllm:prompt_tokens_total{{{label}}}": 7,
        f"vllm:generation_tokens_total{{{label}}}": 5,
        f'vllm:request_success_total{{finished_reason="stop",{label}}}': 2,
        f'vllm:request_success_total{{finished_reason="length",{label}}}': 0,
        f'vllm:request_success_total{{finished_reason="abort",{label}}}': 0,
        f"vllm:time_to_first_token_seconds_count{{{label}}}": 2,
        f"vllm:time_per_output_token_seconds_count{{{label}}}": 1,
        f"vllm:inter_token_latency_seconds_count{{{label}}}": 1,
        f"vllm:e2e_request_latency_seconds_count{{{label}}}": 1,
    }
    for key, value in want.items():
        assert values[key] == pytest.approx(value), key
    assert values[f"vllm:time_to_first_token_seconds_sum{{{label}}}"] == pytest.approx(0.033)
    assert values[f'vllm:time_to_first_token_seconds_bucket{{le="0.005",{label}}}'] == 1
    assert values[f'vllm:time_to_first_token_seconds_bucket{{le="+Inf",{label}}}'] == 2
    # the engine's own series stay, unlabelled; those vLLM lacks appear only there
    assert values["numba_vllm:num_requests_waiting"] == 2 and values["numba_vllm:engine_steps_total"] == 99
    assert values["numba_vllm:kv_cache_pages_total"] == 40
    assert not any(k.startswith(("vllm:engine_steps", "vllm:kv_cache_pages")) for k in values)
    assert all("_created" not in k for k in values)


def test_vllm_series_follow_the_engine_state():
    m = ServerMetrics(_stats(), MODEL)
    m.set_engine_stats(_stats(num_running=0, num_waiting=7, num_pages_used=20, num_pages_free=20, num_pages=40))
    values = parse_metrics(m.render().decode())
    label = f'{{model_name="{MODEL}"}}'
    assert values["vllm:num_requests_waiting" + label] == 7
    assert values["vllm:num_requests_running" + label] == 0
    assert values["vllm:kv_cache_usage_perc" + label] == 0.5


# ---- /tokenize, which prefix-aware routers call -----------------------------------------------------
@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    """A server on a tiny checkpoint with a tokenizer and a chat template, in this process; and the
    tokenizer itself, straight from the `tokenizers` library."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer as HFTokenizer

    from numba_vllm import LLM
    from numba_vllm.server import create_app
    from tests.helpers.tiny_llama import write_chat_checkpoint

    path = write_chat_checkpoint(tmp_path_factory.mktemp("tiny-chat"))
    llm = LLM(str(path), backend="numpy")
    with TestClient(create_app(llm.engine, ["tiny"])) as client:
        yield client, HFTokenizer.from_file(str(path / "tokenizer.json"))


def test_tokenize_a_prompt(chat_server):
    client, hf = chat_server
    max_model_len = client.get("/v1/models").json()["data"][0]["max_model_len"]
    for text in ("hi the world", "<|im_start|>hi"):
        r = client.post("/tokenize", json={"model": "tiny", "prompt": text})
        want = hf.encode(text).ids
        assert r.status_code == 200
        assert r.json() == {"count": len(want), "max_model_len": max_model_len, "tokens": want, "token_strs": None}
    r = client.post("/tokenize", json={"prompt": "hi the", "return_token_strs": True}).json()
    assert r["token_strs"] == [hf.id_to_token(i) for i in hf.encode("hi the").ids] == ["hi", "Ġthe"]


def test_tokenize_a_conversation_as_chat_completions_runs_it(chat_server):
    client, hf = chat_server
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    tokens = client.post("/tokenize", json={"messages": conversation}).json()["tokens"]
    chatml = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    assert tokens == hf.encode(chatml).ids
    chat = client.post("/v1/chat/completions", json={"messages": conversation, "max_tokens": 1, "return_token_ids": True})
    assert chat.json()["choices"][0]["prompt_token_ids"] == tokens
    bare = client.post("/tokenize", json={"messages": conversation, "add_generation_prompt": False}).json()["tokens"]
    assert bare == hf.encode(chatml.removesuffix("<|im_start|>assistant\n")).ids


def test_tokenize_errors(chat_server):
    client, _ = chat_server
    hi = [{"role": "user", "content": "x"}]
    for body, status, param in [
        ({"prompt": "a", "messages": hi}, 400, None),
        ({}, 400, None),
        ({"prompt": 5}, 400, "prompt"),
        ({"messages": []}, 400, "messages"),
        ({"messages": hi, "chat_template_kwargs": {"tokenize": False}}, 400, "chat_template_kwargs"),
        ({"model": "other", "prompt": "a"}, 404, "model"),
    ]:
        r = client.post("/tokenize", json=body)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), body


def test_the_fields_routers_add_are_accepted_at_their_defaults_only(chat_server):
    """vllm-router forwards every request with its own defaults added (seen on the fleet test): those
    values are what this server does anyway; any other value is a 400 naming the field."""
    client, _ = chat_server
    added = {"no_stop_trim": False, "return_hidden_states": False, "skip_special_tokens": True}
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, **added})
    assert r.status_code == 200, r.text
    chat_added = {
        "continue_final_message": False, "include_reasoning": True, "separate_reasoning": True, "stream_reasoning": True
    }  # fmt: skip
    hi = [{"role": "user", "content": "hi"}]
    r = client.post("/v1/chat/completions", json={"messages": hi, "max_tokens": 1, **added, **chat_added})
    assert r.status_code == 200, r.text
    for field, value in [("no_stop_trim", True), ("separate_reasoning", False)]:
        r = client.post("/v1/chat/completions", json={"messages": hi, "max_tokens": 1, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
