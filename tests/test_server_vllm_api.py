"""The server's vLLM-shaped parts, in this process (FastAPI's TestClient, numpy backend, tiny models):
`n` choices (collected and streamed), `best_of`, the model's sampling defaults for absent fields,
`/detokenize`, `/tokenizer_info`, and `serve MODEL`.

References: offline `LLM.generate` one prompt and one seed at a time (child i of a seeded request
samples as seed + i), and the `tokenizers` library's own decode.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from click.testing import CliRunner  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from numba_vllm import LLM, SamplingParams  # noqa: E402
from numba_vllm.cli import main  # noqa: E402
from numba_vllm.server import create_app  # noqa: E402
from tests.helpers.tiny_llama import tiny_checkpoint, write_chat_checkpoint  # noqa: E402

PROMPTS = [list(range(1, 40)), [5, 6, 7]]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def chat(chat_dir):
    from tokenizers import Tokenizer

    served = LLM(str(chat_dir), backend="numpy")
    ref = LLM(str(chat_dir), backend="numpy")  # the references: never the served engine, which its own thread steps
    with TestClient(create_app(served.engine, ["tiny"])) as client:
        yield client, ref, Tokenizer.from_file(str(chat_dir / "tokenizer.json"))


def _alone(llm, prompt, **sampling) -> list[int]:
    return llm.generate([prompt], SamplingParams(**sampling), use_tqdm=False)[0].outputs[0].token_ids


def _sse(response) -> list[dict]:
    events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_n_choices_in_openai_order_each_sampled_as_seed_plus_i(chat):
    client, llm, _ = chat
    body = {"prompt": PROMPTS, "n": 2, "seed": 11, "max_tokens": 5, "ignore_eos": True, "return_token_ids": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    want = [_alone(llm, p, seed=11 + i, max_tokens=5, ignore_eos=True) for p in PROMPTS for i in range(2)]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["token_ids"] for c in choices] == want and want[0] != want[1]
    assert [c["prompt_token_ids"] for c in choices] == [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    usage = r.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (sum(map(len, PROMPTS)), 20)  # prompts counted once

    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        chunks = _sse(s)
    streamed = {i: [] for i in range(4)}
    finished = {}
    for chunk in chunks:
        (c,) = chunk["choices"]
        streamed[c["index"]] += c["token_ids"]
        finished[c["index"]] = c["finish_reason"] or finished.get(c["index"])
    assert [streamed[i] for i in range(4)] == want and set(finished.values()) == {"length"}


def test_chat_n_choices_streamed_and_not(chat):
    client, llm, _ = chat
    hi = [{"role": "user", "content": "hi there"}]
    body = {"messages": hi, "n": 3, "seed": 2, "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}
    choices = client.post("/v1/chat/completions", json=body).json()["choices"]
    prompt = llm.tokenizer.apply_chat_template(hi, add_generation_prompt=True)
    want = [_alone(llm, prompt, seed=2 + i, max_tokens=4, ignore_eos=True) for i in range(3)]
    assert [(c["index"], c["token_ids"]) for c in choices] == list(enumerate(want))
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        chunks = _sse(s)
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role")]
    assert roles == [0, 1, 2]
    text = {i: "" for i in range(3)}
    for c in chunks:
        text[c["choices"][0]["index"]] += c["choices"][0]["delta"].get("content", "")
    assert [text[i] for i in range(3)] == [c["message"]["content"] for c in choices]


def test_best_of_only_equal_to_n(chat):
    client, _, _ = chat
    r = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 1, "best_of": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    r = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 1, "best_of": 2, "n": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    for n in (0, -1):
        r = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 1, "n": n})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


def test_detokenize(chat):
    client, _, hf = chat
    for text in ("hi the world", "<|im_start|>hi"):
        ids = client.post("/tokenize", json={"prompt": text}).json()["tokens"]
        r = client.post("/detokenize", json={"model": "tiny", "tokens": ids})
        assert r.status_code == 200 and r.json() == {"prompt": hf.decode(ids, skip_special_tokens=False)}
    for body, status, param in [
        ({"tokens": [0, 268]}, 400, "tokens"),
        ({"tokens": [-1]}, 400, "tokens"),
        ({"tokens": "12"}, 400, "tokens"),
        ({}, 400, "tokens"),
        ({"model": "other", "tokens": [1]}, 404, "model"),
    ]:
        r = client.post("/detokenize", json=body)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), body
    paths = client.get("/openapi.json").json()["paths"]
    assert "/detokenize" in paths and "200" in paths["/detokenize"]["post"]["responses"]


def test_tokenizer_info(chat, chat_dir, tmp_path):
    client, _, _ = chat
    config = json.loads((chat_dir / "tokenizer_config.json").read_text())
    r = client.get("/tokenizer_info")
    assert r.status_code == 200
    info = r.json()
    fields = ("bos_token", "eos_token", "chat_template")
    assert {k: info[k] for k in fields} == {k: config[k] for k in fields}
    max_len = json.loads((chat_dir / "config.json").read_text())["max_position_embeddings"]  # the served length: the model's
    assert info["add_bos_token"] is False and info["model_max_length"] == max_len and isinstance(info["tokenizer_class"], str)
    assert client.post("/tokenizer_info").status_code == 405
    paths = client.get("/openapi.json").json()["paths"]
    assert "200" in paths["/tokenizer_info"]["get"]["responses"]
    with TestClient(create_app(LLM(str(tiny_checkpoint(tmp_path / "plain")), backend="numpy").engine, ["tiny"])) as plain:
        r = plain.get("/tokenizer_info")  # a checkpoint without a tokenizer takes token ids only
        assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]


def test_absent_fields_take_the_models_defaults_and_given_ones_win(tmp_path):
    path = tiny_checkpoint(tmp_path / "suggesting")
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.85, "top_k": 1}))
    llm = LLM(str(path), backend="numpy")  # the references
    common = {"prompt": PROMPTS[0], "max_tokens": 6, "ignore_eos": True, "return_token_ids": True, "seed": 4}
    greedy = _alone(llm, PROMPTS[0], temperature=0, max_tokens=6, ignore_eos=True)
    given_k = _alone(llm, PROMPTS[0], temperature=0.7, top_p=0.85, top_k=0, seed=4, max_tokens=6, ignore_eos=True)
    neutral = _alone(llm, PROMPTS[0], seed=4, max_tokens=6, ignore_eos=True)
    assert given_k != greedy != neutral
    with TestClient(create_app(LLM(str(path), backend="numpy").engine, ["tiny"])) as client:
        ids = client.post("/v1/completions", json=common).json()["choices"][0]["token_ids"]
        assert ids == greedy  # top_k 1 from the file
        ids = client.post("/v1/completions", json={**common, "top_k": 0}).json()["choices"][0]["token_ids"]
        assert ids == given_k  # the request's top_k wins; temperature and top_p still the file's
    vllm_mode = LLM(str(path), backend="numpy", generation_config="vllm")
    with TestClient(create_app(vllm_mode.engine, ["tiny"])) as client:
        assert client.post("/v1/completions", json=common).json()["choices"][0]["token_ids"] == neutral


def test_serve_takes_the_model_as_its_argument(tmp_path):
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "a"), "--model", str(tmp_path / "b"), "--port", "0"])
    assert r.exit_code == 2 and "name different models" in r.output
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "missing"), "--port", "0", "--backend", "numpy"])
    assert r.exit_code == 1 and "missing: no such file or directory" in r.output
