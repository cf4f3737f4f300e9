"""A fleet on loopback: three numpy-backend replicas of a tiny model with a tokenizer behind vLLM's router
(`numba-vllm fleet`'s code, `numba_vllm.fleet`), driven with the official `openai` client through the
router only. Greedy answers must equal the offline engine's on the same checkpoint (what one server
answers: tests/test_server.py holds a server to that); requests sharing a prefix must land on one
replica (each replica's own /metrics counts its requests); benchmarks/serve.py must run against the
router unchanged; a replica drained with SIGTERM mid-run must finish what it runs while the router
sends the rest elsewhere; a replica killed mid-run must not fail any later request. The tests run in
order on one fleet: the last two take replicas away.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts four replicas and two routers: about a minute on two busy cores
pytest.importorskip("vllm_router")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from click.testing import CliRunner  # noqa: E402

from numba_vllm import LLM, SamplingParams  # noqa: E402
from numba_vllm.cli import main  # noqa: E402
from numba_vllm.fleet import Fleet, FleetError, FleetSpec, http_status  # noqa: E402
from numba_vllm.server.metrics import parse_metrics  # noqa: E402
from tests.helpers.tiny_llama import write_chat_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NAME = "tiny"
REPLICAS = 3
BODY = "the context every request of a group shares, long enough to outweigh the question"


def group_prompt(group: int, question: int) -> str:
    """Prompts of one group share all but their last few characters; groups differ from the start."""
    return f"group {group} asks: {BODY} question {question}?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("tiny-chat"), max_position_embeddings=1024)


@pytest.fixture(scope="module")
def ref(model_dir):
    """What one engine answers on its own, greedy: (token ids, text, finish reason)."""
    llm = LLM(str(model_dir), backend="numpy")

    def answer(prompt: str | list[dict], max_tokens: int) -> tuple[list[int], str, str]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        if isinstance(prompt, str):
            (out,) = llm.generate([prompt], params, use_tqdm=False)
        else:
            (out,) = llm.chat(prompt, params, use_tqdm=False)
        return out.outputs[0].token_ids, out.outputs[0].text, out.outputs[0].finish_reason

    return answer


def _free_ports(n: int) -> int:
    """A base port p with p .. p+n-1 free on loopback now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


@pytest.fixture(scope="module")
def fleet(model_dir, tmp_path_factory):
    port = _free_ports(REPLICAS + 2)
    spec = FleetSpec(
        serve_args=["--model", str(model_dir), "--backend", "numpy", "--served-model-name", NAME, "--max-num-seqs", "8",
                    "--shutdown-timeout", "20", "--no-access-log", "--log-level", "warning"],
        replicas=REPLICAS, port=port, worker_port=port + 1, health_check_interval=1,
        log_dir=tmp_path_factory.mktemp("fleet-logs"),
    )  # fmt: skip
    fleet = Fleet(spec)
    fleet.start(timeout=120)
    yield fleet
    fleet.stop(grace=20)


def _client(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.spec.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _complete(fleet: Fleet, prompt: str, max_tokens: int = 6) -> tuple[list[int], str, str]:
    r = _client(fleet).completions.create(
        model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True}
    )
    (choice,) = r.choices
    return choice.model_extra["token_ids"], choice.text, choice.finish_reason


def _served(fleet: Fleet) -> list[float | None]:
    """Requests each replica has finished, from its own /metrics (None once it is gone)."""
    counts = []
    for url in fleet.spec.worker_urls:
        try:
            values = parse_metrics(httpx.get(url + "/metrics", timeout=5).text)
        except httpx.HTTPError:
            counts.append(None)
            continue
        counts.append(sum(v for k, v in values.items() if k.startswith("vllm:request_success_total")))
    return counts


def _owner(fleet: Fleet, group: int, requests: int) -> int:
    """Send `requests` prompts of `group` one after another; the one replica that served them all."""
    before = _served(fleet)
    for q in range(requests):
        _complete(fleet, group_prompt(group, q))
    after = _served(fleet)
    grew = {i: after[i] - before[i] for i in range(REPLICAS) if after[i] is not None and after[i] != before[i]}
    assert list(grew.values()) == [requests], f"group {group} spread over replicas: {grew}"
    return next(iter(grew))


def _stream_in_background(fleet: Fleet, prompt: str, max_tokens: int) -> tuple[threading.Event, dict]:
    """A streamed completion in a thread; the event is set once its first token has arrived. The dict
    gets 'ids' and 'finish_reason', or 'error'."""
    first, result = threading.Event(), {"ids": [], "finish_reason": None}

    def run() -> None:
        try:
            stream = _client(fleet).completions.create(
                model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            for chunk in stream:
                for choice in chunk.choices:
                    result["ids"] += choice.model_extra.get("token_ids") or []
                    result["finish_reason"] = choice.finish_reason or result["finish_reason"]
                    first.set()
        except (openai.APIError, httpx.HTTPError) as e:
            result["error"] = repr(e)
        finally:
            first.set()

    result["thread"] = threading.Thread(target=run, daemon=True)
    result["thread"].start()
    return first, result


# ---- the fleet serving -------------------------------------------------------------------------------
def test_answers_through_the_router_match_one_engine(fleet, ref):
    client = _client(fleet)
    assert [m.id for m in client.models.list().data] == [NAME]
    for prompt in ("hi the world", "the cat sat on the mat"):
        assert _complete(fleet, prompt, 8) == ref(prompt, 8)
    want_ids, want_text, _ = ref("the world", 8)
    stream = client.completions.create(
        model=NAME, prompt="the world", max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == want_text
    conversation = [{"role": "user", "content": "hi there"}]
    r = client.chat.completions.create(
        model=NAME, messages=conversation, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    want_ids, want_text, want_reason = ref(conversation, 5)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (want_text, want_reason)
    assert r.usage.completion_tokens == len(want_ids)


@pytest.fixture(scope="module")
def group_owners(fleet) -> list[int]:
    """Which replica serves each group's prefix. The groups' first requests go out together, so the
    router (cache_aware: a new prefix goes to the least loaded replica) spreads them; later requests
    follow their group's prefix one at a time (`_owner` checks that each group stays on one replica).
    The first requests generate 400 tokens, so that each is still running when the next reaches the
    router even on a loaded machine: with one finished before the next arrived, every replica would
    be equally loaded and the router could send all three to the same one."""
    seeds = [_stream_in_background(fleet, group_prompt(g, 1000), max_tokens=400) for g in range(REPLICAS)]
    for _, result in seeds:
        result["thread"].join(60)
        assert "error" not in result and result["finish_reason"] == "length", result
    return [_owner(fleet, g, requests=3) for g in range(REPLICAS)]


def test_requests_sharing_a_prefix_land_on_one_replica(fleet, group_owners):
    assert len(set(group_owners)) >= 2, f"every group went to replica {group_owners[0]}"
    for g in range(REPLICAS):  # later, still the same replica
        assert _owner(fleet, g, requests=2) == group_owners[g]


def test_the_load_generator_runs_unchanged_against_the_router(fleet, tmp_path):
    summary = tmp_path / "serve.json"
    cmd = [sys.executable, "benchmarks/serve.py", "--base-url", fleet.spec.url, "-n", "12", "-c", "6", "--prompt-len", "8", "24",
           "--output-len", "4", "--vocab-size", "256", "--warmup", "1", "--json", str(summary)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(summary.read_text())
    assert (result["requests_ok"], result["requests_failed"], result["output_tokens"]) == (12, 0, 48)


# ---- replicas going away -----------------------------------------------------------------------------
def test_a_draining_replica_finishes_its_requests_while_the_router_sends_new_ones_elsewhere(fleet, group_owners, ref):
    target = group_owners[0]
    first, running = _stream_in_background(fleet, group_prompt(0, 100), max_tokens=160)
    assert first.wait(30) and "error" not in running
    fleet.replicas[target].signal(signal.SIGTERM)  # what Kubernetes and the fleet's Ctrl-C send
    for q in range(6):  # group 0's prefix belongs to the draining replica
        assert _complete(fleet, group_prompt(0, 200 + q)) == ref(group_prompt(0, 200 + q), 6)
    running["thread"].join(60)
    assert "error" not in running, running.get("error")
    assert (running["ids"], running["finish_reason"]) == (ref(group_prompt(0, 100), 160)[0], "length")
    assert fleet.replicas[target].process.wait(30) == 0  # drained, then exited cleanly


def test_a_replica_killed_mid_run_fails_no_later_request(fleet, group_owners, ref):
    alive = [i for i, child in enumerate(fleet.replicas) if child.running()]
    assert len(alive) == 2
    group = next(g for g in range(REPLICAS) if group_owners[g] in alive)  # a prefix the target serves
    target = group_owners[group]
    first, running = _stream_in_background(fleet, group_prompt(group, 300), max_tokens=400)
    assert first.wait(30)
    fleet.replicas[target].signal(signal.SIGKILL)
    running["thread"].join(60)
    assert not running["thread"].is_alive()  # the request in flight ended (whole, or cut off), did not hang
    survivor = next(i for i in alive if i != target)
    before = _served(fleet)[survivor]
    t0 = time.monotonic()
    for q in range(8):  # the killed replica's prefix, and the others'
        prompt = group_prompt(q % REPLICAS, 400 + q)
        assert _complete(fleet, prompt) == ref(prompt, 6)
    assert _served(fleet)[survivor] - before == 8
    assert time.monotonic() - t0 < 30
    assert fleet.poll()  # the router still runs; the dead replica is reported


# ---- the fleet's command ------------------------------------------------------------------------------
def test_one_replica_per_gpu_and_the_commands():
    spec = FleetSpec(serve_args=["--model", "m", "--backend", "cuda"], gpus=["2", "3"], port=9000)
    assert spec.replicas == 2 and spec.worker_urls == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert [spec.replica_env(i) for i in range(2)] == [{"CUDA_VISIBLE_DEVICES": "2"}, {"CUDA_VISIBLE_DEVICES": "3"}]
    cmd = spec.replica_command(1)
    assert cmd[cmd.index("serve") :] == ["serve", "--model", "m", "--backend", "cuda", "--host", "127.0.0.1", "--port", "9002"]
    router = spec.router_command()
    assert router[router.index("--worker-urls") + 1 : router.index("--worker-urls") + 3] == spec.worker_urls
    assert router[router.index("--policy") + 1] == "cache_aware" and router[router.index("--port") + 1] == "9000"
    assert router[router.index("--prometheus-port") + 1] == "9003"  # the router's own metrics: the next port
    assert FleetSpec(serve_args=[], replicas=3).replica_env(0) == {}  # CPU replicas, or all on the visible GPUs


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--replicas", "3", "--gpus", "0,1", "--"], "one replica per GPU"),
        (["--gpus", "0,,1", "--"], "GPU ids"),
        (["--", "--model", "m", "--port", "5"], "sets each replica's --port"),
        (["--port", "9000", "--worker-port", "8999", "-n", "2", "--"], "ports clash"),
    ],
)
def test_fleet_command_mistakes_are_one_line(args, message):
    r = CliRunner().invoke(main, ["fleet", *args])
    assert r.exit_code in (1, 2) and message in r.output and "Traceback" not in r.output


def test_the_fleet_command_serves_until_sigterm_then_stops_everything(model_dir):
    """`numba-vllm fleet` itself, one replica: up, answers through the router, SIGTERM, exit 0, ports closed."""
    port = _free_ports(3)  # router, replica, router metrics
    cmd = [sys.executable, "-m", "numba_vllm.cli", "fleet", "-n", "1", "--port", str(port), "--", "--model", str(model_dir),
           "--backend", "numpy", "--served-model-name", NAME, "--no-access-log"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while http_status(f"http://127.0.0.1:{port}/readiness") != 200:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the fleet did not come up"
            time.sleep(0.25)
        body = {"model": NAME, "prompt": "hi", "max_tokens": 2}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert http_status(f"http://127.0.0.1:{port}/readiness") is None
    assert http_status(f"http://127.0.0.1:{port + 1}/health") is None


class _Ready:
    """A stand-in child process that is running; `Fleet._wait_ready` polls it and a URL."""

    name = "router"
    process = None

    def running(self) -> bool:
        return True


def test_a_signal_after_the_router_answers_is_a_stop_not_a_failed_start():
    """A client that saw the router ready may already have sent its requests and signalled the fleet
    before the fleet's own readiness poll saw it: that signal stops a started fleet (exit 0), while a
    signal before the router answers is a stop during start-up (FleetError, exit 130)."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200 if self.path == "/readiness" else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        fleet = Fleet(FleetSpec(serve_args=["--backend", "numpy"]))
        fleet.stopping.set()  # the signal came first
        fleet._wait_ready(_Ready(), url + "/readiness", time.monotonic() + 10)  # ready: returns
        with pytest.raises(FleetError, match="stopped while starting"):
            fleet._wait_ready(_Ready(), url + "/not-ready", time.monotonic() + 10)
    finally:
        server.shutdown()
