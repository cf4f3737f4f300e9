"""A server on a tiny model in a background thread of the test process, for the server, hardening and fuzz tests:
its engine core in a process of its own (as `numba-vllm serve` runs it), or in a thread (tests that reach into the engine)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from numba_vllm.engine.config import EngineConfig
from numba_vllm.server import Server, create_app, server_config
from numba_vllm.server.core_process import CoreProcess, CoreSpec
from numba_vllm.server.metrics import parse_metrics

TINY_NAME = "tiny"


MAX_LEN = 16384  # the tiny test model's max_position_embeddings: long enough to disconnect (or stop) mid-request


M = "numba_vllm:"

openai = pytest.importorskip("openai")  # a dev extra: where it is missing (a GPU host's bare python), these files skip


class ServerThread:
    """uvicorn + the app in a thread of this process, on an OS-chosen loopback port. `engine`: an
    LLMEngine of this process (its core loop runs in a thread) or a started CoreProcess (`spawn`)."""

    def __init__(self, engine, names, sock=None, **app_args):
        self.core = engine if isinstance(engine, CoreProcess) else None
        config = server_config(create_app(engine, names, **app_args), "127.0.0.1", 0, log_level="warning")
        self.server = Server(config, shutdown_timeout=5)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock] if sock else None}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    @classmethod
    def spawn(cls, model_dir, names, sock=None, app_args=None, **engine_args) -> ServerThread:
        """A server whose engine core (numpy backend, `engine_args`) runs in a process of its own."""
        core = CoreProcess(CoreSpec(str(model_dir), "auto", EngineConfig(backend="numpy", **engine_args)))
        core.start()
        return cls(core, names, sock, **(app_args or {}))

    def client(self, api_key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60, **kw)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics").text)

    def wait_idle(self, timeout: float = 60) -> dict[str, float]:
        """Metrics once nothing runs, waits or holds a page (or at `timeout`: generous, since on a
        loaded 2-core machine a disconnect can take seconds to be noticed)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m[M + "num_requests_running"] == 0 and m[M + "num_requests_waiting"] == 0 and m[M + "kv_cache_pages_used"] == 0
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.02)

    def close(self) -> None:
        self.server.begin_shutdown()
        self.thread.join(30)
        assert not self.thread.is_alive()
        if self.core is not None:
            assert self.core.join(5), "the engine core process outlived the server"


# ---- shutdown ------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def start_serve(model_dir, *extra: str) -> tuple[subprocess.Popen, str]:
    """`numba-vllm serve` on the tiny model in a child process (numpy backend, a free port, TINY_NAME,
    MAX_LEN, then `extra` options), once its /health answers 200: (the process, its base URL)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "numba_vllm.cli", "serve", "--model", str(model_dir), "--backend", "numpy", "--port", str(port)]
    cmd += ["--served-model-name", TINY_NAME, "--max-model-len", str(MAX_LEN), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).parents[2])
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read())
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() >= deadline:
            proc.kill()
            raise AssertionError("the server did not come up")
        time.sleep(0.1)
