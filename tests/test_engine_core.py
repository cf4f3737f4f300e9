"""The engine core in a process of its own, joined to the HTTP front end by ZeroMQ: the messages carry
only what is new (and every field), streams interleave, a stop string or a client that leaves frees
the request in the core, and the death of either process is reported, never hung on. Expected
outputs come from `LLM.generate` on the same checkpoint, in this process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("zmq")
httpx = pytest.importorskip("httpx")

from numba_vllm import LLM, SamplingParams  # noqa: E402
from numba_vllm.engine.logprobs import Logprob  # noqa: E402
from numba_vllm.engine.output import CompletionOutput, RequestOutput  # noqa: E402
from numba_vllm.engine.stats import EngineStats  # noqa: E402
from numba_vllm.server.core_protocol import CoreAddresses, StepOutputs, encoder, event_decoder, news_since  # noqa: E402
from tests.helpers.server import MAX_LEN, TINY_NAME, M, ServerThread, start_serve  # noqa: E402
from tests.helpers.tiny_llama import tiny_checkpoint, write_chat_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), max_position_embeddings=MAX_LEN)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    server = ServerThread.spawn(tiny_dir, [TINY_NAME], max_model_len=MAX_LEN, max_num_seqs=8)
    yield server
    server.close()


def _greedy(model_dir, prompts, max_tokens: int, **sampling) -> list[CompletionOutput]:
    llm = LLM(str(model_dir), backend="numpy", max_model_len=MAX_LEN)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **sampling)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


# ---- the messages ---------------------------------------------------------------------------------
def test_news_carries_only_what_is_new_and_every_field():
    """Per-token lists (token ids, logprobs) are cut at what was sent, other fields pass as they are,
    request-level ones on the first and last news only; msgpack brings them back typed."""
    lps = [{7: Logprob(-0.5, 1, "x")}, {8: Logprob(-1.0, 2, None)}]
    out = RequestOutput("r", "a prompt", [1, 2, 3], [CompletionOutput(0, "text", [7, 8], -1.5, list(lps))], num_cached_tokens=16)
    sent: dict[int, int] = {}
    first = news_since(out, sent, final=False)
    assert first.prompt is None and first.prompt_token_ids == [] and first.num_cached_tokens == 16
    assert first.outputs == [CompletionOutput(0, "", [7, 8], -1.5, lps)] and sent == {0: 2}
    c = out.outputs[0]
    c.token_ids.append(9)
    c.logprobs.append({9: Logprob(-2.0, 1, "y")})
    c.cumulative_logprob = -3.5
    middle = news_since(out, sent, final=False)
    assert middle.outputs == [CompletionOutput(0, "", [9], -3.5, [{9: Logprob(-2.0, 1, "y")}])] and middle.num_cached_tokens == 0
    c.finish_reason, c.stop_reason = "stop", 5
    out.error = None
    last = news_since(out, sent, final=True)
    assert last.outputs[0].token_ids == [] and last.outputs[0].finish_reason == "stop" and last.num_cached_tokens == 16

    stats = EngineStats(1, 0, 7, 40, 2, 38, 0, 5, 640, True, 0, 0, 0)
    wire = encoder().encode(StepOutputs(["r"], [], [first, middle, last], stats))
    back = event_decoder().decode(wire)
    assert back.outputs == [first, middle, last] and back.stats == stats and back.accepted == ["r"]
    assert isinstance(back.outputs[0].outputs[0], CompletionOutput)
    assert isinstance(back.outputs[0].outputs[0].logprobs[0][7], Logprob)


class _SilentCore:
    """A core that never runs: the front end's channel opens, nothing answers (news is handed in by the test)."""

    def __init__(self):
        self.addresses = CoreAddresses.new()

    def start(self) -> None:
        pass

    def watch(self, loop, on_exit) -> None:
        pass

    def join(self, timeout: float) -> bool:
        return True

    def kill(self) -> None:
        pass

    def close(self) -> None:
        self.addresses.remove_files()


def test_the_front_end_folds_news_generically_and_cuts_at_stop_strings(chat_dir):
    """Per-token lists other than the ids (logprobs) follow their tokens into the output and the
    Deltas, request-level fields arrive, and the text is the tokenizer's own decode, cut before the
    stop string; the core is told to free the request once the stop string is found (and to shut
    down at the end)."""
    from tokenizers import Tokenizer as HFTokenizer

    from numba_vllm.loading.checkpoint import load_checkpoint
    from numba_vllm.server.core_protocol import ModelInfo
    from numba_vllm.server.engine_loop import EngineLoop, Sink

    hf = HFTokenizer.from_file(str(chat_dir / "tokenizer.json"))
    ids = hf.encode("the whole world", add_special_tokens=False).ids
    text = hf.decode(ids)
    stop = text[5:8]
    ckpt = load_checkpoint(chat_dir)
    stats = EngineStats(1, 0, 7, 40, 2, 38, 0, 5, 640, True, 0, 0, 0)
    info = ModelInfo(ckpt.config, ckpt.tokenizer, MAX_LEN, "numpy", stats, str(chat_dir), {})

    async def run():
        core = _SilentCore()
        front = EngineLoop(core, info, TINY_NAME)
        front.start()
        sent = []
        front._send = sent.append  # what would go to the core
        loop = asyncio.get_running_loop()
        sink = Sink(loop, 0, loop.create_future(), asyncio.Queue())
        front.add("r", [1, 2], SamplingParams(max_tokens=100, stop=[stop], ignore_eos=True), sink, time.perf_counter())
        front._apply(StepOutputs(["r"], [], [], stats))
        assert sink.accepted.done()
        for k, token in enumerate(ids):
            logprobs = [{token: -0.5 * k}]
            sequence = CompletionOutput(0, "", [token], -1.0 * k, logprobs)
            news = RequestOutput("r", None, [], [sequence], num_cached_tokens=16 if k == 0 else 0)
            front._apply(StepOutputs([], [], [news], stats))
        deltas = []
        while not sink.queue.empty():
            deltas.append(sink.queue.get_nowait())
        await front.stop(0)
        return front, deltas, sent

    front, deltas, sent = asyncio.run(run())
    assert "".join(d.text for d in deltas) == text[: text.find(stop)] and deltas[-1].finish_reason == "stop"
    taken = [t for d in deltas for t in d.token_ids]
    assert taken == ids[: len(taken)] and len(taken) < len(ids)
    assert [lp for d in deltas for lp in d.logprobs] == [{t: -0.5 * k} for k, t in enumerate(taken)]
    assert deltas[0].num_cached_tokens == 16
    assert [type(c).__name__ for c in sent] == ["AddRequest", "AbortRequests", "Shutdown"] and sent[1].request_ids == ["r"]


def test_a_stop_string_in_one_of_n_sequences_frees_that_sequence_in_the_core(chat_dir):
    """n = 2: a stop string ends sequence 1 in the front end while sequence 0 runs on; the core is
    told to stop that sequence alone (AbortSequence, once), and nothing more when the request ends."""
    from tokenizers import Tokenizer as HFTokenizer

    from numba_vllm.loading.checkpoint import load_checkpoint
    from numba_vllm.server.core_protocol import ModelInfo
    from numba_vllm.server.engine_loop import EngineLoop, Sink

    hf = HFTokenizer.from_file(str(chat_dir / "tokenizer.json"))
    ids = hf.encode("the whole world", add_special_tokens=False).ids
    stop = hf.decode(ids)[5:8]
    ckpt = load_checkpoint(chat_dir)
    stats = EngineStats(1, 0, 7, 40, 2, 38, 0, 5, 640, True, 0, 0, 0)
    info = ModelInfo(ckpt.config, ckpt.tokenizer, MAX_LEN, "numpy", stats, str(chat_dir), {})
    other = hf.encode("aaaa", add_special_tokens=False).ids[0]  # sequence 0's tokens: never the stop string

    async def run():
        core = _SilentCore()
        front = EngineLoop(core, info, TINY_NAME)
        front.start()
        sent = []
        front._send = sent.append
        loop = asyncio.get_running_loop()
        sink = Sink(loop, 0, loop.create_future(), asyncio.Queue())
        params = SamplingParams(n=2, max_tokens=len(ids) + 2, stop=[stop], ignore_eos=True)
        front.add("r", [1, 2], params, sink, time.perf_counter())
        front._apply(StepOutputs(["r"], [], [], stats))
        for k, token in enumerate(ids):  # the core runs both sequences until told
            news = RequestOutput("r", None, [], [CompletionOutput(0, "", [other]), CompletionOutput(1, "", [token])])
            front._apply(StepOutputs([], [], [news], stats))
        last = [CompletionOutput(0, "", [other, other], finish_reason="length"),
                CompletionOutput(1, "", [], finish_reason="abort")]  # fmt: skip
        front._apply(StepOutputs([], [], [RequestOutput("r", None, [], last)], stats))
        deltas = []
        while not sink.queue.empty():
            deltas.append(sink.queue.get_nowait())
        await front.stop(0)
        return deltas, sent

    deltas, sent = asyncio.run(run())
    reasons = {d.index: d.finish_reason for d in deltas if d.finish_reason}
    assert reasons == {0: "length", 1: "stop"}
    assert [type(c).__name__ for c in sent] == ["AddRequest", "AbortSequence", "Shutdown"]
    assert (sent[1].request_id, sent[1].index) == ("r", 1)


def test_the_server_process_never_imports_numba_cuda(tiny_dir):
    """`auto` makes the core look for a GPU (numba.cuda); the front end only gets the model's description."""
    script = f"""
import sys
from numba_vllm.engine.config import EngineConfig
from numba_vllm.server.core_process import CoreProcess, CoreSpec
core = CoreProcess(CoreSpec({str(tiny_dir)!r}, "auto", EngineConfig(backend="auto", max_model_len=64)))
info = core.start()
core.close()
assert info.backend == "numpy" and info.max_model_len == 64, info
assert "numba.cuda" not in sys.modules and "numba" not in sys.modules, sorted(m for m in sys.modules if "numba." in m)
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr


# ---- streams and aborts ---------------------------------------------------------------------------
def test_many_concurrent_streams_interleave(tiny, tiny_dir):
    """Eight streams (as many as the batch slots) run side by side: each one's first token comes
    before any one's last, and each gives the tokens it gives alone. The threads send together (a
    barrier) and each stream is long (600 tokens), so a thread that a loaded machine starts late
    still finds the others running."""
    prompts = [[3 + i, 40 + i, 90 - i] for i in range(8)]
    want = [c.token_ids for c in _greedy(tiny_dir, prompts, 600)]
    arrivals: list[list[float]] = [[] for _ in prompts]
    got: list[list[int]] = [[] for _ in prompts]
    ready = threading.Barrier(len(prompts))

    def one(i):
        body = {"prompt": prompts[i], "max_tokens": 600, "temperature": 0, "ignore_eos": True, "stream": True,
                "return_token_ids": True}  # fmt: skip
        ready.wait(60)
        with httpx.stream("POST", tiny.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    ids = json.loads(line[6:])["choices"][0]["token_ids"]
                    if ids:
                        got[i] += ids
                        arrivals[i].append(time.monotonic())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == want
    assert max(a[0] for a in arrivals) < min(a[-1] for a in arrivals)
    assert tiny.wait_idle()[M + "kv_cache_pages_used"] == 0


def test_a_client_that_gives_up_frees_its_request_in_the_core(tiny):
    before = tiny.wait_idle()
    body = {"model": TINY_NAME, "prompt": [1, 2, 3], "max_tokens": MAX_LEN - 8, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(tiny.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    after = tiny.wait_idle()
    aborted = M + 'request_success_total{finished_reason="abort"}'
    assert after[M + "kv_cache_pages_used"] == 0 and after[M + "num_requests_running"] == 0
    assert after[aborted] == before[aborted] + 1
    assert after[M + "engine_steps_total"] - before[M + "engine_steps_total"] < MAX_LEN - 8


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("chat"), max_position_embeddings=MAX_LEN)


@pytest.fixture(scope="module")
def chat(chat_dir):
    """A server of a model with a tokenizer (text, stop strings), its engine core in a process of its own."""
    server = ServerThread.spawn(chat_dir, [TINY_NAME], max_model_len=MAX_LEN)
    yield server
    server.close()


def _new_substring(text: str, start: int) -> str:
    """Three characters of `text` from `start` on that are not blank and occur there first."""
    pieces = (text[i : i + 3] for i in range(start, len(text) - 3))
    return next(p for p in pieces if p.strip() and text.find(p) == text.find(p, start))


def test_a_stop_string_found_by_the_front_end_frees_the_request_in_the_core(chat, chat_dir):
    """The front end detokenizes and finds the stop string; the core, told so, stops stepping the
    request (the steps it ran meanwhile are a matter of timing: far fewer than max_tokens) and frees
    its pages."""
    (alone,) = _greedy(chat_dir, ["hello there"], 40)
    text = alone.text
    stop = _new_substring(text, 8)
    before = chat.wait_idle()
    body = {"prompt": "hello there", "max_tokens": MAX_LEN - 16, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    r = httpx.post(chat.url + "/v1/completions", json=body, timeout=60)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == text[: text.find(stop)]
    after = chat.wait_idle()
    assert after[M + "kv_cache_pages_used"] == 0 and after[M + "num_requests_running"] == 0
    assert after[M + "engine_steps_total"] - before[M + "engine_steps_total"] < MAX_LEN // 4
    stopped = M + 'request_success_total{finished_reason="stop"}'
    assert after[stopped] == before[stopped] + 1


def test_n_sequences_stop_as_they_do_offline(chat, chat_dir):
    """n = 2 seeded sequences, streamed, with a stop string one of them meets: the texts and finish
    reasons `LLM.generate` gives (where the engine itself checks stop strings)."""
    llm = LLM(str(chat_dir), backend="numpy", max_model_len=MAX_LEN)
    sampling = {"n": 2, "seed": 5, "temperature": 1.0, "max_tokens": 30, "ignore_eos": True}
    (free,) = llm.generate(["hello there"], SamplingParams(**sampling), use_tqdm=False)
    stop = _new_substring(free.outputs[1].text, 4)
    (want,) = llm.generate(["hello there"], SamplingParams(**sampling, stop=[stop]), use_tqdm=False)
    body = {"prompt": "hello there", "stop": [stop], "stream": True, **sampling}
    texts, reasons = ["", ""], [None, None]
    with httpx.stream("POST", chat.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                (choice,) = json.loads(line[6:])["choices"]
                texts[choice["index"]] += choice["text"]
                reasons[choice["index"]] = choice["finish_reason"] or reasons[choice["index"]]
    assert texts == [c.text for c in want.outputs] and reasons == [c.finish_reason for c in want.outputs]
    assert "stop" in reasons
    assert chat.wait_idle()[M + "kv_cache_pages_used"] == 0


# ---- either side dying ------------------------------------------------------------------------------
def test_a_killed_core_fails_every_open_request_and_health_turns_503(tiny_dir):
    server = ServerThread.spawn(tiny_dir, [TINY_NAME], max_model_len=MAX_LEN, max_num_seqs=1)
    try:
        long = {"prompt": [1, 2, 3], "max_tokens": MAX_LEN - 8, "ignore_eos": True}
        statuses = {}

        def collected():  # waits for the only slot, behind the stream
            r = httpx.post(server.url + "/v1/completions", json=long, timeout=60)
            statuses["collected"] = (r.status_code, r.json()["error"]["code"])

        stream = {**long, "stream": True}
        with httpx.Client(base_url=server.url, timeout=60) as http, http.stream("POST", "/v1/completions", json=stream) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            waiting = threading.Thread(target=collected)
            waiting.start()
            deadline = time.monotonic() + 10
            while server.metrics()[M + "num_requests_waiting"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            os.kill(server.core.pid, signal.SIGKILL)
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "internal_error"
        waiting.join(30)
        assert statuses["collected"] == (500, "internal_error")
        assert httpx.get(server.url + "/health").status_code == 503
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [1], "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
    finally:
        server.close()


def _core_processes(pid: int) -> list[int]:
    """The children of `pid` that multiprocessing spawned (not its resource tracker)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat, cmdline = (entry / "stat").read_text(), (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
                children.append(int(entry.name))
    return children


def _running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow  # starts `numba-vllm serve` in a child process (imports numba and the server stack)
def test_the_core_process_exits_when_the_server_process_dies(tiny_dir):
    proc, url = start_serve(tiny_dir, "--log-level", "warning")
    try:
        (core,) = _core_processes(proc.pid)
        body = {"prompt": [1, 2, 3], "max_tokens": MAX_LEN - 8, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=url, timeout=30) as http, http.stream("POST", "/v1/completions", json=body) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))  # the core is stepping
            proc.kill()
            proc.wait(10)
        deadline = time.monotonic() + 10
        while _running(core):
            assert time.monotonic() < deadline, "the engine core outlived the server"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow  # starts `numba-vllm serve` in a child process
def test_serve_engine_in_process_keeps_the_core_in_a_thread(tiny_dir):
    proc, url = start_serve(tiny_dir, "--engine-in-process", "--log-level", "warning")
    try:
        assert _core_processes(proc.pid) == []
        r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "Traceback" not in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
