"""What a fuzzer or a careless client sends must not break the server, hang a request or go unanswered.

The tiny random model on the numpy backend, served in a thread of this process (`ServerThread`; its
engine core in a process of its own, or in a thread where a test breaks the engine on purpose) or,
for signals, as `numba-vllm serve` in a subprocess. After every kind of bad or
failed request the next greedy request must give the tokens `LLM.generate` gives, and the metrics
must show no slot or page held.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from numba_vllm import LLM, SamplingParams  # noqa: E402
from numba_vllm.model.config import ModelConfig  # noqa: E402
from numba_vllm.server import ServerLimits, listen  # noqa: E402
from numba_vllm.server.log_limits import RateLimitFilter  # noqa: E402
from tests.helpers.server import MAX_LEN, TINY_NAME, M, ServerThread, start_serve  # noqa: E402
from tests.helpers.tiny_llama import random_weights, tiny_config_dict, write_checkpoint  # noqa: E402

JSON = {"content-type": "application/json"}
PROBE = [4, 5, 6]  # the greedy request that must come out the same after anything else


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    cfg = tiny_config_dict(max_position_embeddings=MAX_LEN)
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), cfg, random_weights(ModelConfig.from_dict(cfg), dtype="bf16"))


@pytest.fixture(scope="module")
def want(tiny_dir):
    llm = LLM(str(tiny_dir), backend="numpy", max_model_len=MAX_LEN)
    (out,) = llm.generate([PROBE], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return out.outputs[0].token_ids


def serve(tiny_dir, **kw) -> ServerThread:
    llm = LLM(str(tiny_dir), backend="numpy", max_model_len=MAX_LEN, max_num_seqs=kw.pop("max_num_seqs", 8))
    return ServerThread(llm.engine, [TINY_NAME], **kw)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    server = ServerThread.spawn(tiny_dir, [TINY_NAME], max_model_len=MAX_LEN, max_num_seqs=8)
    yield server
    server.close()


def probe(server, **sampling) -> list[int]:
    body = {"prompt": PROBE, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True, "temperature": 0, **sampling}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def assert_clean(server, want) -> None:
    """The next greedy request is unaffected, and nothing holds a slot or a page."""
    assert probe(server) == want
    m = server.wait_idle()
    assert m[M + "kv_cache_pages_used"] == 0 and m[M + "num_requests_running"] == 0 and m[M + "num_requests_waiting"] == 0


# ---- 1. one request must not poison the engine ----------------------------------------------------
def test_a_temperature_of_1e_310_is_greedy(tiny, want):
    assert probe(tiny, temperature=1e-310) == want
    assert_clean(tiny, want)


def test_a_failed_step_answers_500_to_its_requests_and_the_server_goes_on(tiny_dir, want, caplog):
    server = serve(tiny_dir)
    try:
        runner = server.server.state.core.engine.runner
        launch = runner.launch
        runner.launch = lambda plan, previous=None: (_ for _ in ()).throw(FloatingPointError("secret internals"))
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 4}, timeout=30)
        runner.launch = launch
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["code"] == "internal_error" and "secret" not in error["message"] and "request cmpl-" in error["message"]
        assert httpx.get(server.url + "/health").status_code == 200
        assert_clean(server, want)
        m = server.metrics()
        assert m[M + "engine_failed_steps_total"] == 1 and m[M + 'request_success_total{finished_reason="error"}'] == 1
    finally:
        server.close()


def test_an_engine_whose_steps_keep_failing_is_unhealthy_and_refuses(tiny_dir):
    server = serve(tiny_dir)
    try:
        server.server.state.core.engine.runner.launch = lambda plan, previous=None: 1 / 0
        for _ in range(3):
            r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 4}, timeout=30)
            assert r.status_code == 500
        assert httpx.get(server.url + "/health").status_code == 503
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 4}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
    finally:
        server.close()


# ---- 2. every request is answered, even when the engine core dies ------------------------------
def test_requests_queued_when_the_engine_thread_dies_are_answered(tiny_dir):
    server = serve(tiny_dir)
    try:
        engine = server.server.state.core.engine
        in_step, release = threading.Event(), threading.Event()

        def broken_step():
            in_step.set()
            release.wait(10)
            raise RuntimeError("a bug in the engine")

        engine.step = broken_step
        statuses = {}

        def post(name):
            r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 4}, timeout=20)
            statuses[name] = r.status_code

        first = threading.Thread(target=post, args=("running",))
        first.start()
        assert in_step.wait(10)
        second = threading.Thread(target=post, args=("queued",))
        second.start()
        deadline = time.monotonic() + 10
        while server.server.state.engine_loop.num_queued_adds == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # the second request's add waits in the queue behind the step
        release.set()
        first.join(20)
        second.join(20)
        assert statuses == {"running": 500, "queued": 503}
        assert httpx.get(server.url + "/health").status_code == 503
    finally:
        server.close()


# ---- 3. bodies that used to give a 500 -------------------------------------------------------------
@pytest.mark.parametrize("depth", [1000, 5000, 100_000])
def test_deeply_nested_json_is_a_400_and_the_connection_stays_usable(tiny, want, depth):
    body = b'{"prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}"
    with httpx.Client(base_url=tiny.url, timeout=30) as http:
        r = http.post("/v1/completions", content=body, headers=JSON)
        assert r.status_code == 400 and "nests deeper than 64 levels" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"prompt": PROBE, "max_tokens": 1}, headers=JSON)  # same connection
        assert r.status_code == 200
    assert_clean(tiny, want)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "\\udfff"]}', "prompt[1]"),
        ("/v1/completions", '{"prompt": [1], "model": "\\ud800"}', "model"),
        ("/v1/completions", '{"prompt": [1], "stop": ["x\\ud83d"]}', "stop[0]"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ],
)
def test_a_lone_surrogate_is_a_400(tiny, want, path, body, param):
    r = httpx.post(tiny.url + path, content=body.encode(), headers=JSON)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "lone UTF-16 surrogate" in error["message"] and error["param"] == param
    assert_clean(tiny, want)


# ---- 4. every field honoured or refused ---------------------------------------------------------------
CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        ("/v1/completions", {"prompt": [1], "repetition_penalty": 0}, "repetition_penalty", "must be > 0"),
        ("/v1/completions", {"prompt": [1], "min_p": 1.5}, "min_p", "must be in [0, 1]"),
        ("/v1/completions", {"prompt": [1], "min_tokens": -1}, "min_tokens", "must be an integer >= 0"),
        ("/v1/completions", {"prompt": [1], "logit_bias": {"1000": 1}}, "logit_bias", "outside the vocabulary"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        ("/v1/completions", {"prompt": [1], "best_off": 2}, "best_off", "not a field this endpoint takes"),
        ("/v1/completions", {"prompt": [1], "stream_options": {"include_usage": True}}, "stream_options", "stream: true"),
        ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"tools": [{}]}}, "chat_template_kwargs", "tools"),
        ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "auto"}, "tool_choice", "not supported"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "must be one of"),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "hi"}]}, "messages[0].role", "must be one of"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content", "required"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages[0].content", "must be a string"),
        ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]},
         "messages[0].tool_calls", "not a field"),  # fmt: skip
    ],
)
def test_fields_the_engine_cannot_honour_are_refused(tiny, path, body, param, words):
    r = httpx.post(tiny.url + path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


# ---- 6. exposure and limits -----------------------------------------------------------------------
def test_a_body_not_sent_as_json_is_a_415(tiny, want):
    body = json.dumps({"prompt": [1], "max_tokens": 1}).encode()
    for headers in ({}, {"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}):
        r = httpx.post(tiny.url + "/v1/completions", content=body, headers=headers)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", headers
    r = httpx.post(tiny.url + "/v1/completions", content=body, headers={"content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200
    assert_clean(tiny, want)


def test_405_says_which_methods_are_allowed(tiny):
    r = httpx.get(tiny.url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["code"] == "method_not_allowed"


def test_too_many_prompts_in_one_request(tiny, want):
    r = httpx.post(tiny.url + "/v1/completions", json={"prompt": [[1]] * 257, "max_tokens": 1})
    assert r.status_code == 400 and "at most 256" in r.json()["error"]["message"]
    assert_clean(tiny, want)


def test_an_unexpected_error_is_logged_with_an_id_and_not_echoed(tiny, monkeypatch, caplog):
    def broken(req):
        raise RuntimeError("secret internals")

    monkeypatch.setattr("numba_vllm.server.app.check_supported", broken)
    with caplog.at_level(logging.ERROR, logger="uvicorn.error"):
        r = httpx.post(tiny.url + "/v1/completions", json={"prompt": [1]})
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert "secret" not in message and "RuntimeError" not in message
    error_id = message.split("(id ")[1].split(")")[0]
    logged = [rec for rec in caplog.records if error_id in rec.getMessage() and rec.exc_info]
    assert logged and "secret internals" in str(logged[0].exc_info[1])


def test_a_full_waiting_queue_answers_503_with_retry_after(tiny_dir, want):
    server = serve(tiny_dir, max_num_seqs=1, limits=ServerLimits(max_waiting_requests=2))
    try:
        body = {"prompt": [1, 2, 3], "max_tokens": MAX_LEN - 8, "ignore_eos": True, "stream": True}
        waiting = []
        with httpx.Client(base_url=server.url, timeout=30) as http, http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()  # kept: closing it would close the connection
            next(line for line in lines if line.startswith("data: "))  # it holds the only slot
            for _ in range(2):
                t = threading.Thread(target=httpx.post, args=(server.url + "/v1/completions",),
                                     kwargs={"json": {"prompt": [1], "max_tokens": 1}, "timeout": 60})  # fmt: skip
                t.start()
                waiting.append(t)
            deadline = time.monotonic() + 10
            while server.metrics()[M + "num_requests_waiting"] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            full = httpx.post(server.url + "/v1/completions", json={"prompt": [1], "max_tokens": 1})
            assert full.status_code == 503 and full.headers["retry-after"] == "1"
        # the stream is closed: its request is aborted, and the two waiting ones run
        for t in waiting:
            t.join(60)
        assert_clean(server, want)
    finally:
        server.close()


def test_allowed_hosts(tiny_dir):
    server = serve(tiny_dir, limits=ServerLimits(allowed_hosts=("localhost", "127.0.0.1")))
    try:
        r = httpx.get(server.url + "/v1/models", headers={"host": "attacker.example"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
        assert httpx.get(server.url + "/health", headers={"host": "attacker.example:80"}).status_code == 400
        assert httpx.get(server.url + "/v1/models").status_code == 200  # Host: 127.0.0.1:PORT
        assert httpx.get(server.url + "/v1/models", headers={"host": "LOCALHOST"}).status_code == 200
    finally:
        server.close()


def test_a_non_ascii_api_key_matches(tiny_dir):
    server = serve(tiny_dir, api_key="clé-ü")
    try:
        ok = httpx.get(server.url + "/v1/models", headers={"authorization": "Bearer clé-ü".encode()})
        assert ok.status_code == 200
        wrong = httpx.get(server.url + "/v1/models", headers={"authorization": "Bearer clé-ü".encode("latin-1")})
        assert wrong.status_code == 401
    finally:
        server.close()


def _connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    sock.settimeout(10)
    return sock


def test_slow_headers_and_slow_bodies_are_cut_off(tiny_dir, want):
    server = serve(tiny_dir, limits=ServerLimits(header_timeout=0.5, body_timeout=0.5))
    try:
        with _connect(server.url) as sock:  # half a request line, then nothing
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            t0 = time.monotonic()
            assert sock.recv(1024) == b""  # closed by the server
            assert time.monotonic() - t0 < 5
        with _connect(server.url) as sock:  # the headers, then 10 of the 100 bytes promised
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\":")  # fmt: skip
            answer = b""
            while chunk := sock.recv(4096):  # the server closes the connection after answering
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
        assert_clean(server, want)  # and a normal client is served
    finally:
        server.close()


def test_a_stream_whose_client_stops_reading_is_aborted(tiny_dir, want):
    sock = listen("127.0.0.1", 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # accepted sockets inherit it: the stall comes soon
    server = serve(tiny_dir, limits=ServerLimits(write_timeout=0.5), sock=sock)
    try:
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": MAX_LEN - 8, "ignore_eos": True, "stream": True}).encode()
        with _connect(server.url, rcvbuf=4096) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            deadline = time.monotonic() + 60  # never read: the buffers fill, the writes stall, the request is aborted
            while server.metrics()[M + 'request_success_total{finished_reason="abort"}'] < 1:
                assert time.monotonic() < deadline, "the stalled stream was not aborted"
                time.sleep(0.1)
            m = server.wait_idle()
            assert m[M + "kv_cache_pages_used"] == 0 and m[M + "generation_tokens_total"] < MAX_LEN - 8
        assert_clean(server, want)
    finally:
        server.close()


def test_repeated_log_records_are_rate_limited():
    now = [0.0]
    limit = RateLimitFilter(burst=10, window=10.0, clock=lambda: now[0])
    records = [logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, "accept failed: %s", ("EMFILE",), None)
               for _ in range(1000)]  # fmt: skip
    assert sum(limit.filter(r) for r in records) == 10
    other = logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, "another message", (), None)
    assert limit.filter(other)  # another kind has its own budget
    now[0] = 10.0
    late = logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, "accept failed: %s", ("EMFILE",), None)
    assert limit.filter(late) and "990 more like this" in late.getMessage()


# ---- 5. a second signal stops at once --------------------------------------------------------------
def test_a_second_signal_ends_every_stream_and_exits_at_once(tiny_dir):
    proc, url = start_serve(tiny_dir, "--shutdown-timeout", "60")
    try:
        body = {"prompt": [1, 2, 3], "max_tokens": MAX_LEN - 8, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=url, timeout=30) as http, http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGINT)
            time.sleep(0.3)
            assert proc.poll() is None  # draining: the stream goes on
            proc.send_signal(signal.SIGINT)
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        proc.wait(timeout=15)  # far inside the 60 s drain the first signal began (about a second when idle)
        out = proc.stdout.read()
        assert proc.returncode == 0, out
        assert "Traceback" not in out and "CancelledError" not in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
