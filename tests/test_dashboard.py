"""The dashboard's data (GET /v1/dashboard/state) and page (GET /dashboard) on a real server (numpy
backend, tiny random model, loopback port), with engine steps slowed down so requests are seen in
flight. Checked against what the test itself knows: the requests it sent, how many tokens each
generates, the page arithmetic of 16-token pages; and that per-request detail is taken only while
someone watches. The page in a real browser: test_dashboard_browser.py.
"""

from __future__ import annotations

import base64
import hashlib
import re
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from numba_vllm import LLM  # noqa: E402
from numba_vllm.engine.kv_cache import pages_for_tokens  # noqa: E402
from numba_vllm.model.config import ModelConfig  # noqa: E402
from tests.helpers.dashboard_server import KEY, DashboardServer, start_requests  # noqa: E402
from tests.helpers.tiny_llama import random_weights, tiny_config_dict, write_checkpoint  # noqa: E402

NUM_SLOTS = 3
NUM_PAGES = 40  # 39 usable


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    cfg = tiny_config_dict(max_position_embeddings=512)
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), cfg, random_weights(ModelConfig.from_dict(cfg), dtype="bf16"))


@pytest.fixture
def server(tiny_dir):
    llm = LLM(  # caching off: the page accounting below assumes no page is shared
        str(tiny_dir), backend="numpy", max_num_seqs=NUM_SLOTS, num_pages=NUM_PAGES, max_model_len=512,
        enable_prefix_caching=False,
    )
    s = DashboardServer(llm.engine, KEY)
    yield s
    s.close()


def test_state_in_flight_then_cleared(server):
    idle = server.state()
    assert idle["num_slots"] == NUM_SLOTS and idle["num_pages"] == NUM_PAGES - 1 and idle["page_size"] == 16
    assert idle["slots"] == [] and idle["waiting"] == [] and idle["engine"]["pages_used"] == 0
    time.sleep(0.6)
    assert len(server.state()["series"]["t"]) == 1  # a second point, before any request: every token comes after it

    # 5 requests for 3 slots: prompts of 20..24 tokens, 60 new tokens each (2..6 pages per request).
    prompts = [list(range(3, 23 + i)) for i in range(5)]
    threads, results = start_requests(server.url, prompts, max_tokens=60)
    seen_waiting, seen = False, None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (seen and seen_waiting):
        s = server.state()
        if s["slots"]:
            assert len(s["slots"]) == s["engine"]["running"] <= NUM_SLOTS
            held = [p for r in s["slots"] for p in r["page_ids"]]
            assert len(held) == len(set(held)) == s["engine"]["pages_used"]  # no prefix caching: nothing shared
            assert all(1 <= p < NUM_PAGES for p in held) and s["shared_page_ids"] == []
            for r in s["slots"]:
                known = r["prompt_tokens"] + r["output_tokens"]
                assert r["prompt_tokens"] in range(20, 25) and 0 <= r["output_tokens"] <= 60
                assert pages_for_tokens(r["computed_tokens"]) <= len(r["page_ids"]) <= pages_for_tokens(known)
                assert r["phase"] in ("prefill", "decode") and r["request_id"].startswith("cmpl-")
            seen = s
        if s["waiting"]:
            assert len(s["waiting"]) == s["engine"]["waiting"] and all(w["request_id"].startswith("cmpl-") for w in s["waiting"])
            seen_waiting = True
        time.sleep(0.05)
    assert seen and seen_waiting, "never saw the requests running and waiting"
    for t in threads:
        t.join(60)
    assert not results["errors"] and results["tokens"] == [60] * 5
    assert {r["request_id"] for r in seen["slots"]} <= set(results["ids"])

    time.sleep(0.6)  # one more series point after the last token
    done = server.state()
    assert done["slots"] == [] and done["waiting"] == [] and done["engine"]["pages_used"] == 0
    series = done["series"]
    assert len(series["t"]) >= 2 and all(t <= 0 for t in series["t"])
    # Each interval's rate times its length adds up to the 5 x 60 tokens (the first interval ended before them).
    assert series["tokens_per_s"][0] == 0
    durations = [b - a for a, b in zip(series["t"], series["t"][1:], strict=False)]
    generated = sum(rate * dt for rate, dt in zip(series["tokens_per_s"][1:], durations, strict=True))
    assert generated == pytest.approx(300, abs=5)
    assert any(v is not None and v > 0 for v in series["ttft_ms"]) and any(v is not None and v > 0 for v in series["tpot_ms"])
    assert max(series["running"]) <= NUM_SLOTS


def test_detail_is_taken_only_while_watched(server):
    loop = server.app.state.numba_vllm.engine_loop
    threads, _ = start_requests(server.url, [[5, 6, 7]], max_tokens=3)
    for t in threads:
        t.join(30)
    assert loop.dashboard.stats.running is None  # nobody has asked: counts only
    server.state()
    threads, _ = start_requests(server.url, [[5, 6, 7]], max_tokens=3)
    for t in threads:
        t.join(30)
    assert loop.dashboard.stats.running == ()  # detail (empty: all done), since a viewer asked


def test_the_key_guards_the_state_not_the_page(server):
    assert httpx.get(server.url + "/v1/dashboard/state").status_code == 401
    assert httpx.get(server.url + "/v1/dashboard/state", headers={"Authorization": "Bearer wrong"}).status_code == 401
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert "/v1/dashboard/state" in html and "sessionStorage" in html
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)  # nothing fetched from elsewhere
    # The policy allows exactly the page's own inline script and style, by hash, and connections to this server only.
    policy = page.headers["content-security-policy"]
    for tag in ("script", "style"):
        (body,) = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.DOTALL)
        digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
        assert f"{tag}-src 'sha256-{digest}'" in policy
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
