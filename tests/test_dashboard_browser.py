"""The dashboard page in a real browser: headless Chromium (Debian's, driven by selenium through
chromedriver) opens /dashboard on a real server (numpy backend, tiny random model, an API key), is
given the key, watches requests run and wait, and the DOM shows each slot's request and phase and the
pages it holds, then clears when the requests end.

Skipped, with the reason, where selenium, chromium or chromedriver is missing: `make test-browser`
installs Debian's chromium and chromium-driver (as root) and runs this file. With
NUMBA_VLLM_DASHBOARD_SCREENSHOT=path.png the page is saved there while busy (docs/dashboard.png).
"""

from __future__ import annotations

import os
import shutil
import time

import pytest

pytestmark = pytest.mark.browser
pytest.importorskip("fastapi")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install 'numba-vllm[dev]')")

from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

from numba_vllm import LLM  # noqa: E402
from numba_vllm.model.config import ModelConfig  # noqa: E402
from tests.helpers.dashboard_server import KEY, DashboardServer, start_requests  # noqa: E402
from tests.helpers.tiny_llama import random_weights, tiny_config_dict, write_checkpoint  # noqa: E402

NUM_SLOTS = 4
NUM_PAGES = 97  # 96 usable: 8 rows of 12 cells
WAIT_S = 20  # the longest any one wait below may take

# One snapshot of what the page shows, read from the DOM in one call.
READ_DOM = """
const all = (sel) => [...document.querySelectorAll(sel)];
return {
  status: document.getElementById('status').dataset.state,
  keyFormShown: !document.getElementById('key-form').hidden,
  slots: all('#slots .slot').map((e) => [e.dataset.requestId, e.dataset.phase || '']),
  owners: all('#pages .page').map((e) => e.dataset.owner),
  waiting: all('#waiting .chip').map((e) => e.dataset.requestId),
  waitingText: document.getElementById('waiting').textContent,
  ttft: document.getElementById('c-ttft').textContent,
  tpsLines: all('#chart-tps polyline').length,
  ttftMarks: all('#chart-ttft circle').length,
};
"""


def _find(*names: str) -> str | None:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture
def browser():
    chromium = os.environ.get("CHROMIUM") or _find("chromium", "chromium-browser", "google-chrome")
    driver_path = os.environ.get("CHROMEDRIVER") or _find("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("no chromium/chromedriver on PATH: `make test-browser` installs Debian's chromium and chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,1040",
                "--no-first-run", "--disable-extensions", "--proxy-server=direct://", "--proxy-bypass-list=*"):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(WAIT_S)
    yield driver
    driver.quit()


@pytest.fixture
def server(tmp_path):
    cfg = tiny_config_dict(max_position_embeddings=512)
    path = write_checkpoint(tmp_path / "tiny", cfg, random_weights(ModelConfig.from_dict(cfg), dtype="bf16"))
    llm = LLM(  # caching off: the page counts below assume no page is shared (the prompts share a beginning)
        str(path), backend="numpy", max_num_seqs=NUM_SLOTS, num_pages=NUM_PAGES, max_model_len=512, enable_prefix_caching=False
    )
    s = DashboardServer(llm.engine, KEY)
    yield s
    s.close()


def wait_for(driver, condition, what: str) -> dict:
    """Read the DOM until `condition(dom)` holds (at most WAIT_S s); returns that reading."""
    deadline = time.monotonic() + WAIT_S
    while True:
        dom = driver.execute_script(READ_DOM)
        if condition(dom):
            return dom
        assert time.monotonic() < deadline, f"timed out waiting for {what}; the page shows {dom}"
        time.sleep(0.05)


def test_slots_pages_and_queue_appear_and_clear(browser, server, tmp_path):
    browser.get(server.url + "/dashboard?poll_ms=150")  # the key is never in the URL: the page asks for it
    wait_for(browser, lambda d: d["status"] == "locked" and d["keyFormShown"], "the API key prompt")
    browser.find_element(By.ID, "key").send_keys(KEY)
    browser.find_element(By.CSS_SELECTOR, "#key-entry button").click()
    dom = wait_for(browser, lambda d: d["status"] == "live" and len(d["slots"]) == NUM_SLOTS, "the live page")
    assert not dom["keyFormShown"] and len(dom["owners"]) == NUM_PAGES - 1
    assert all(rid == "" for rid, _ in dom["slots"]) and not any(dom["owners"]) and dom["waiting"] == []

    # 7 requests for 4 slots: some wait. Prompts of 20..68 tokens, 90 new tokens each.
    prompts = [list(range(3, 23 + 8 * i)) for i in range(7)]
    threads, results = start_requests(server.url, prompts, max_tokens=90)

    def busy(d):
        running = [rid for rid, _ in d["slots"] if rid]
        return len(running) == NUM_SLOTS and d["waiting"] and all(rid in d["owners"] for rid in running)

    dom = wait_for(browser, busy, "every slot busy, pages held and a queue")
    shot = os.environ.get("NUMBA_VLLM_DASHBOARD_SCREENSHOT") or str(tmp_path / "dashboard.png")
    browser.save_screenshot(shot)
    running = {rid: phase for rid, phase in dom["slots"] if rid}
    assert all(rid.startswith("cmpl-") for rid in running) and set(running.values()) <= {"prefill", "decode"}
    # Every request holds at least the pages of its prompt (at least 2 pages of 16 tokens for 20+ tokens).
    assert all(dom["owners"].count(rid) >= 2 for rid in running)
    assert not set(dom["waiting"]) & set(running)

    for t in threads:
        t.join(60)
    assert not results["errors"] and results["tokens"] == [90] * len(prompts)
    assert set(running) | set(dom["waiting"]) <= set(results["ids"])

    def cleared(d):
        return all(rid == "" for rid, _ in d["slots"]) and not any(d["owners"]) and "nobody waits" in d["waitingText"]

    dom = wait_for(browser, cleared, "slots, pages and queue to clear")
    def charted(d):
        return d["ttft"] != "-" and d["tpsLines"] > 0 and d["ttftMarks"] > 0

    dom = wait_for(browser, charted, "the TTFT figure and chart, and the throughput line")
    assert float(dom["ttft"]) > 0
