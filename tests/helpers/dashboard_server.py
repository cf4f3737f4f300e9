"""A server for the dashboard tests (test_dashboard.py, test_dashboard_browser.py): the app on a loopback
port in a thread of the test process, its engine's steps slowed down so requests stay in flight long
enough to be seen, and streamed completions sent from threads."""

from __future__ import annotations

import json
import threading
import time

import httpx
import uvicorn

from numba_vllm.server import Server, create_app

KEY = "dashboard-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
STEP_SECONDS = 0.02  # each engine step is slowed down by this much, so requests stay in flight long enough to see


class DashboardServer:
    """A server on a loopback port in a thread of this process, its engine's steps slowed down."""

    def __init__(self, engine, api_key: str | None):
        real_step = engine.step

        def slow_step():
            time.sleep(STEP_SECONDS)
            return real_step()

        engine.step = slow_step
        config = uvicorn.Config(create_app(engine, ["tiny"], api_key=api_key), host="127.0.0.1", port=0, log_level="warning")
        self.server = Server(config, shutdown_timeout=5)
        self.app = config.app
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def state(self) -> dict:
        r = httpx.get(self.url + "/v1/dashboard/state", headers=AUTH)
        assert r.status_code == 200, r.text
        return r.json()

    def close(self) -> None:
        self.server.begin_shutdown()
        self.thread.join(30)


def start_requests(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[list[threading.Thread], dict]:
    """Stream one completion per prompt, each in its own thread; `ids` fills with the response ids."""
    results: dict = {"ids": [], "tokens": [], "errors": []}

    def one(prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "return_token_ids": True}  # fmt: skip
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
                n, rid = 0, None
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        rid = chunk["id"]
                        n += len(chunk["choices"][0].get("token_ids") or [])
                results["ids"].append(rid)
                results["tokens"].append(n)
        except Exception as e:  # reported by the test, not lost in a thread
            results["errors"].append(repr(e))

    threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in prompts]
    for t in threads:
        t.start()
    return threads, results
