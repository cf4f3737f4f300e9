"""The OpenAI-compatible server, started for real on a free loopback port (numpy backend) and driven
with the official `openai` client and raw HTTP: the tiny random model (token-id prompts) for
batching, disconnects, bad input, the API key and shutdown; SmolLM2 for chat (skipped if absent).
Expected outputs come from `LLM.generate` / `LLM.chat` on the same checkpoint, one prompt at a time.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from click.testing import CliRunner  # noqa: E402

from numba_vllm import LLM, SamplingParams  # noqa: E402
from numba_vllm.cli import main  # noqa: E402
from numba_vllm.engine.stats import EngineStats  # noqa: E402
from numba_vllm.server.metrics import ServerMetrics, parse_metrics  # noqa: E402
from tests.helpers.server import MAX_LEN, TINY_NAME, M, ServerThread, start_serve  # noqa: E402
from tests.helpers.smollm2 import needs_smollm2  # noqa: E402
from tests.helpers.tiny_llama import tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), max_position_embeddings=MAX_LEN)


@pytest.fixture(scope="module")
def ref(tiny_dir):
    """The offline API on the same checkpoint: what each request must produce alone."""
    llm = LLM(str(tiny_dir), backend="numpy", max_model_len=MAX_LEN)

    def generate(prompt, **sampling) -> list[int]:
        (out,) = llm.generate([prompt], SamplingParams(**sampling), use_tqdm=False)
        return out.outputs[0].token_ids

    return generate


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    """The server as `numba-vllm serve` runs it: its engine core in a process of its own."""
    server = ServerThread.spawn(tiny_dir, [TINY_NAME], max_model_len=MAX_LEN, max_num_seqs=8)  # fewer slots than requests
    yield server
    server.close()


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


# ---- completions on the tiny model ---------------------------------------------------------------
def test_models_health_and_metrics(tiny):
    client = tiny.client()
    assert [m.id for m in client.models.list().data] == [TINY_NAME]
    assert client.models.retrieve(TINY_NAME).model_extra["max_model_len"] == MAX_LEN
    assert httpx.get(tiny.url + "/health").status_code == 200
    r = httpx.get(tiny.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    names = ["num_requests_running", "num_requests_waiting", "kv_cache_pages_used", "kv_cache_pages_free", "prompt_tokens_total"]
    names += ["generation_tokens_total", "time_to_first_token_seconds_count", "time_per_output_token_seconds_count"]
    for name in names:
        assert M + name in r.text


def test_metrics_text_from_engine_stats_and_events_in_a_registry_per_server():
    stats = EngineStats(
        num_running=3, num_waiting=2, num_free_slots=5, num_pages=40, num_pages_used=10, num_pages_free=30,
        num_preemptions=4, num_steps=99, max_model_len=640, prefix_caching=True, num_cached_pages=6,
        num_prefix_cache_queries=500, num_prefix_cache_hits=320,
    )  # fmt: skip
    a, b = ServerMetrics(stats, TINY_NAME), ServerMetrics(stats, TINY_NAME)  # two in one process: no clash
    a.prompt_tokens.inc(7)
    a.finished.labels("length").inc()
    for seconds in (0.003, 0.03, 3.0):
        a.ttft.observe(seconds)
    text = a.render().decode()
    assert "_created" not in text
    m = parse_metrics(text)
    assert {k.removeprefix(M): v for k, v in m.items() if k.startswith(M) and "_seconds" not in k} == {
        "num_requests_running": 3, "num_requests_waiting": 2, "kv_cache_pages_used": 10, "kv_cache_pages_free": 30,
        "kv_cache_pages_total": 40, "kv_cache_usage_perc": 0.25, "num_preemptions_total": 4, "engine_steps_total": 99,
        "kv_cache_pages_cached": 6, "prefix_cache_queries_total": 500, "prefix_cache_hits_total": 320,
        "prompt_tokens_total": 7, "generation_tokens_total": 0, 'request_success_total{finished_reason="stop"}': 0,
        'request_success_total{finished_reason="length"}': 1, 'request_success_total{finished_reason="abort"}': 0,
        'request_success_total{finished_reason="error"}': 0, "engine_failed_steps_total": 0,
    }  # fmt: skip
    ttft = M + "time_to_first_token_seconds"
    assert [m[f'{ttft}_bucket{{le="{le}"}}'] for le in ("0.001", "0.005", "0.04", "2.5", "5.0", "+Inf")] == [0, 1, 2, 2, 3, 3]
    assert m[ttft + "_count"] == 3 and m[ttft + "_sum"] == pytest.approx(3.033)
    assert parse_metrics(b.render().decode())[M + "prompt_tokens_total"] == 0
    b.set_engine_stats(EngineStats(0, 0, 8, 40, 0, 40, 4, 120, 640, True, 0, 0, 0))
    assert parse_metrics(b.render().decode())[M + "engine_steps_total"] == 120


def test_greedy_and_seeded_completions_match_llm_generate(tiny, ref):
    client = tiny.client()
    cases = [
        ([5, 6, 7], {"temperature": 0}, {}),
        ([9, 10, 11, 12, 13], {"temperature": 0.8, "seed": 3, "top_p": 0.9}, {"top_k": 20}),
    ]
    for prompt, sampling, extra in cases:
        want = ref(prompt, max_tokens=12, ignore_eos=True, **sampling, **extra)
        extra_body = {"ignore_eos": True, "return_token_ids": True, **extra}
        r = client.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=12, extra_body=extra_body, **sampling)
        (choice,) = r.choices
        assert _ids(choice) == want and choice.finish_reason == "length"
        assert choice.model_extra["prompt_token_ids"] == prompt
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(prompt), 12, len(prompt) + 12)
        assert r.model == TINY_NAME and r.object == "text_completion" and r.id.startswith("cmpl-")

        stream = client.completions.create(
            model=TINY_NAME, prompt=prompt, max_tokens=12, stream=True, stream_options={"include_usage": True},
            extra_body=extra_body, **sampling,
        )  # fmt: skip
        chunks = list(stream)
        streamed = [t for c in chunks if c.choices for t in _ids(c.choices[0])]
        assert streamed == want
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_cached_prompt_tokens_are_reported_in_usage_and_metrics(tiny, ref):
    """A 40-token prompt sent again finds its 2 full pages in the prefix cache: usage says 32 cached
    prompt tokens (OpenAI's prompt_tokens_details.cached_tokens), streamed or not; the metrics count
    the lookups and hits in tokens."""
    prompt = [77] * 40  # no other test sends it
    client = tiny.client()
    before = tiny.wait_idle()
    want = ref(prompt, max_tokens=3, temperature=0)
    cached = []
    for _ in range(2):
        r = client.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=3, temperature=0,
                                      extra_body={"return_token_ids": True})  # fmt: skip
        assert _ids(r.choices[0]) == want
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    stream = client.completions.create(model=TINY_NAME, prompt=[prompt, prompt], max_tokens=3, temperature=0, stream=True,
                                       stream_options={"include_usage": True})  # fmt: skip
    usage = list(stream)[-1].usage
    assert cached == [0, 32] and usage.prompt_tokens_details.cached_tokens == 2 * 32 and usage.prompt_tokens == 80
    after = tiny.wait_idle()
    assert after[M + "prefix_cache_queries_total"] - before[M + "prefix_cache_queries_total"] == 4 * 40
    assert after[M + "prefix_cache_hits_total"] - before[M + "prefix_cache_hits_total"] == 3 * 32
    assert after[M + "kv_cache_pages_cached"] >= 2


def test_batched_prompts_in_one_request(tiny, ref):
    prompts = [[3, 4], [20, 21, 22]]
    r = tiny.client().completions.create(
        model=TINY_NAME, prompt=prompts, max_tokens=5, temperature=0, extra_body={"return_token_ids": True}
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert [_ids(c) for c in r.choices] == [ref(p, max_tokens=5, temperature=0) for p in prompts]


def test_32_concurrent_requests_match_their_outputs_alone(tiny, ref):
    rng = np.random.default_rng(0)
    specs = []
    for i in range(32):
        prompt = rng.integers(3, 128, int(rng.integers(1, 40))).tolist()
        sampling = {"temperature": 0} if i % 2 else {"temperature": 0.9, "seed": i, "top_p": 0.95}
        specs.append((prompt, int(rng.integers(4, 40)), sampling, i % 3 == 0))
    want = [ref(p, max_tokens=n, **s) for p, n, s, _ in specs]
    client = openai.AsyncOpenAI(base_url=tiny.url + "/v1", api_key="none", max_retries=0, timeout=60)

    async def one(prompt, max_tokens, sampling, stream):
        kw = dict(model=TINY_NAME, prompt=prompt, max_tokens=max_tokens, extra_body={"return_token_ids": True}, **sampling)
        if not stream:
            return _ids((await client.completions.create(**kw)).choices[0])
        return [t async for c in await client.completions.create(stream=True, **kw) for t in _ids(c.choices[0])]

    async def all_at_once():
        async with client:
            return await asyncio.gather(*(one(*s) for s in specs))

    got = asyncio.run(all_at_once())
    assert got == want
    m = tiny.wait_idle()
    assert m[M + "kv_cache_pages_used"] == 0 and m[M + "num_requests_running"] == 0


# ---- disconnects ---------------------------------------------------------------------------------
def test_a_client_that_disconnects_mid_stream_frees_its_pages(tiny):
    """On the module's shared server, after other requests (a disconnect there once went unnoticed)."""
    before = tiny.wait_idle()
    body = {"model": TINY_NAME, "prompt": [1, 2, 3], "max_tokens": MAX_LEN - 8, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=tiny.url, timeout=30) as http, http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: closing it would close the connection
        next(line for line in lines if line.startswith("data: "))
        during = tiny.metrics()
        assert during[M + "num_requests_running"] == 1 and during[M + "kv_cache_pages_used"] > 0
    after = tiny.wait_idle()
    assert after[M + "kv_cache_pages_used"] == 0 and after[M + "kv_cache_pages_free"] == before[M + "kv_cache_pages_free"]
    aborted = M + 'request_success_total{finished_reason="abort"}'
    assert after[aborted] == before[aborted] + 1
    assert after[M + "generation_tokens_total"] - before[M + "generation_tokens_total"] < MAX_LEN - 8

    # the same without streaming: the client gives up waiting
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(tiny.url + "/v1/completions", json={**body, "stream": False}, timeout=httpx.Timeout(30, read=0.3))
    after2 = tiny.wait_idle()
    assert after2[M + "kv_cache_pages_used"] == 0 and after2[aborted] == after[aborted] + 1


# ---- bad input -----------------------------------------------------------------------------------
BAD = [  # (path, body: dict, or bytes sent as they are, status, param or None, words in the message)
    ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "must be a JSON object"),
    ("/v1/completions", b"\xff\xfe", 400, None, "not valid JSON"),
    ("/v1/completions", {"model": TINY_NAME}, 400, "prompt", "required"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", "must be a string"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": "8"}, 400, "max_tokens", "valid integer"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens", "max_tokens must be an integer >= 1"),
    ("/v1/completions", {"prompt": [1, 2], "temperature": "hot"}, 400, "temperature", "valid number"),
    ("/v1/completions", {"prompt": [1, 2], "temperature": -1}, 400, "temperature", "temperature must be >= 0"),
    ("/v1/completions", {"prompt": [1, 2], "top_p": 1.5}, 400, "top_p", "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": [1, 2], "top_k": -3}, 400, "top_k", "top_k must be an integer"),
    ("/v1/completions", {"prompt": [1, 2], "seed": -1}, 400, "seed", "seed must be a non-negative integer"),
    ("/v1/completions", {"prompt": [1, 2], "stop": ""}, 400, "stop", "non-empty strings"),
    ("/v1/completions", {"prompt": [1, 2], "stop": [1]}, 400, "stop", "a string or a list of strings"),
    ("/v1/completions", {"prompt": [1, 2], "stream": "yes"}, 400, "stream", "valid boolean"),
    ("/v1/completions", {"prompt": [1, 2], "n": 0}, 400, "n", "n must be an integer >= 1"),
    ("/v1/completions", {"prompt": [1, 2], "n": 2, "best_of": 3}, 400, "best_of", "only equal to n"),
    ("/v1/completions", {"prompt": [1, 2], "logprobs": 21}, 400, "logprobs", "logprobs must be an integer in [0, 20]"),
    ("/v1/completions", {"prompt": [1, 2], "model": "gpt-4"}, 404, "model", "does not exist"),
    ("/v1/completions", {"prompt": [1, 1000]}, 400, "prompt", "outside the vocabulary"),
    ("/v1/completions", {"prompt": [1, -1]}, 400, "prompt", "outside the vocabulary"),
    ("/v1/completions", {"prompt": [3] * MAX_LEN}, 400, "prompt", f"maximum context length is {MAX_LEN}"),
    ("/v1/completions", {"prompt": [3] * 100, "max_tokens": MAX_LEN}, 400, "max_tokens", "max_tokens is too large"),
    ("/v1/completions", {"prompt": "hello"}, 400, "prompt", "no tokenizer"),
    ("/v1/completions", {"prompt": [1] * 400_000}, 413, None, "larger than the limit"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "messages", "no chat template"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least one message"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages[0].role", "required"),
    ("/v1/nowhere", {}, 404, None, "no route"),
]


def test_bad_input_gets_a_4xx_and_does_not_disturb_a_running_request(tiny, ref):
    want = ref([7, 8, 9], max_tokens=200, temperature=0, ignore_eos=True)
    got = {}

    def background():
        r = tiny.client().completions.create(
            model=TINY_NAME, prompt=[7, 8, 9], max_tokens=200, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        got["ids"] = [t for c in r for t in _ids(c.choices[0])]

    thread = threading.Thread(target=background)
    thread.start()
    with httpx.Client(base_url=tiny.url, timeout=30) as http:
        for path, body, status, param, words in BAD:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = http.post(path, content=content, headers={"content-type": "application/json"})
            assert r.status_code == status, (body if len(content) < 200 else path, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
            assert words in error["message"] and error["param"] == param, error

        def chunked():  # no Content-Length: the limit is counted as the body streams in
            for _ in range(40):
                yield b" " * 65536

        r = http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    client = tiny.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt=[1], max_tokens=1)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="best_of is not supported"):
        client.completions.create(model=TINY_NAME, prompt=[1], n=3, best_of=2)
    thread.join(60)
    assert got["ids"] == want
    r = client.completions.create(
        model=TINY_NAME, prompt=[4, 5], max_tokens=3, temperature=0, extra_body={"return_token_ids": True}
    )
    assert _ids(r.choices[0]) == ref([4, 5], max_tokens=3, temperature=0)
    assert tiny.wait_idle()[M + "kv_cache_pages_used"] == 0


def test_api_key(tiny_dir):
    server = ServerThread(LLM(str(tiny_dir), backend="numpy", max_model_len=MAX_LEN).engine, [TINY_NAME], api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key="wrong").completions.create(model=TINY_NAME, prompt=[1], max_tokens=1)
        for r in (httpx.get(server.url + "/v1/models"), httpx.post(server.url + "/v1/completions", json={"prompt": [1]})):
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.url + "/health").status_code == 200  # health and metrics stay open
        r = server.client(api_key="s3cret").completions.create(model=TINY_NAME, prompt=[1], max_tokens=2)
        assert r.usage.completion_tokens >= 1
    finally:
        server.close()




@pytest.mark.slow  # starts `numba-vllm serve` in a child process (imports numba and the server stack)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_admitting_aborts_what_runs_and_exits_0(tiny_dir, sig):
    proc, url = start_serve(tiny_dir, "--shutdown-timeout", "2", "--log-level", "warning")
    try:
        body = {"prompt": [1, 2, 3], "max_tokens": MAX_LEN - 8, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=url, timeout=30) as http, http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.send_signal(sig)
            time.sleep(0.2)
            with httpx.Client(base_url=url, timeout=30) as other:
                late = other.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
                assert late.status_code == 503 and late.json()["error"]["code"] == "service_unavailable"
                assert other.get("/health").status_code == 503
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "Traceback" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_command_errors_are_one_line():
    r = CliRunner().invoke(main, ["serve", "--model", "/no/such/dir", "--backend", "numpy"])
    assert r.exit_code == 1 and "/no/such/dir: no such file or directory" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["serve", "--load-format", "dummy"])
    assert r.exit_code == 2 and "--load-format dummy needs --model" in r.output


# ---- chat and text on SmolLM2 --------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol():
    llm = LLM(backend="numpy")
    conversation = [{"role": "user", "content": "What is 2+2?"}]
    chat = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    text = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    server = ServerThread(llm.engine, ["smollm2"])  # the same engine, idle now, serves
    yield server, conversation, chat, text
    server.close()


@pytest.mark.slow  # SmolLM2 on the NumPy backend: the fixture's two requests, then these six tokens twice
@pytest.mark.timeout(900)
@needs_smollm2
def test_chat_streamed_and_not_match_llm_chat(smol):
    server, conversation, want, _ = smol
    client = server.client()
    r = client.chat.completions.create(model="smollm2", messages=conversation, max_tokens=6, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.outputs[0].text
    assert r.choices[0].finish_reason == want.outputs[0].finish_reason == "length" and r.object == "chat.completion"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), len(want.outputs[0].token_ids))
    # The fixture's own llm.chat of this conversation cached every full page of the prompt; the last
    # token is always computed, so a prompt of n tokens finds 16 * ((n - 1) // 16) of them.
    cached = 16 * ((len(want.prompt_token_ids) - 1) // 16)
    assert cached > 0 and r.usage.prompt_tokens_details.cached_tokens == cached
    stream = client.chat.completions.create(
        model="smollm2", messages=conversation, max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6 and all(c.id == chunks[0].id for c in chunks)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached


@pytest.mark.slow
@pytest.mark.timeout(900)  # when run alone, it pays for the fixture
@needs_smollm2
def test_text_completion_on_smollm2(smol):
    server, _, _, want = smol
    r = server.client().completions.create(model="smollm2", prompt="Once upon a time", max_tokens=4, temperature=0)
    assert r.choices[0].text == want.outputs[0].text and r.usage.prompt_tokens == len(want.prompt_token_ids)
    with pytest.raises(openai.BadRequestError, match="only text parts"):
        server.client().chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        )
