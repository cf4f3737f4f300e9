"""The live dashboard: GET /dashboard, one HTML page, and GET /v1/dashboard/state, the JSON it polls.

The page (`dashboard.html`, served as it is: inline script and style, no build step, nothing fetched
from elsewhere) draws each batch slot (request, prefill or decode, tokens so far), the KV-cache page
pool as a grid colored by the request holding each page, the waiting queue, and throughput, TTFT and
TPOT over the last minutes.

Off the hot path: the engine core sends an `EngineStats` with every step's news, as it does for
/metrics (`DashboardFeed.publish`: one reference stored), and a state request only reads the latest
one; the engine never waits for a viewer. The per-request part of a snapshot (each request's slot,
tokens and page ids) costs the engine core one small object per request, so it is taken only while
someone watches: a state request tells the core, which adds the detail for the next `WATCH_SECONDS`.
The first poll after a quiet spell may find no detail yet (`"slots": null`); the next step brings it.

The series are sampled from the server's metrics when the page polls (at most every
`SAMPLE_SECONDS`): generated tokens, and the TTFT and TPOT histograms' sums and counts, so a point's
TTFT is the mean over the requests whose first token came since the point before.

The state holds request ids and token counts, so it is under /v1, where `--api-key` applies: the page
asks for the key when it gets a 401 and sends it as an `Authorization` header (kept in the tab's
sessionStorage, never in a URL). The page itself holds no data and needs no key.
"""

from __future__ import annotations

import base64
import hashlib
import re
import time
from collections import deque
from collections.abc import Callable
from importlib import resources
from typing import TYPE_CHECKING

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse

from numba_vllm.engine.stats import EngineStats
from numba_vllm.model.config import PAGE_SIZE

if TYPE_CHECKING:
    from numba_vllm.server.app import ServerState
    from numba_vllm.server.metrics import ServerMetrics

WATCH_SECONDS = 10.0  # per-request detail is collected this long after the last state request
SAMPLE_SECONDS = 0.5  # at most one series point this often
MAX_POINTS = 600  # series length: 5 minutes at one point per SAMPLE_SECONDS
MAX_WAITING_SHOWN = 200  # the queue beyond this is counted, not listed


class DashboardFeed:
    """The latest engine snapshot, and the viewers' interest in per-request detail."""

    def __init__(self, stats: EngineStats, on_watch: Callable[[], None]):
        self.stats = stats  # replaced whole (never changed) with each snapshot from the engine core
        self.on_watch = on_watch  # tells the engine core to put per-request detail in its snapshots for WATCH_SECONDS

    def watch(self) -> None:
        """A viewer asked for the state (event loop)."""
        self.on_watch()

    def publish(self, stats: EngineStats) -> None:
        self.stats = stats


class Series:
    """Throughput, TTFT and TPOT over time, sampled from the server's metrics (event loop side)."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.start = time.monotonic()
        # (t s since start, generated tokens, ttft sum s, ttft count, tpot sum s, tpot count, running, waiting, pages used)
        self._points: deque[tuple[float, ...]] = deque(maxlen=MAX_POINTS + 1)

    def sample(self, stats: EngineStats) -> None:
        now = time.monotonic() - self.start
        if self._points and now - self._points[-1][0] < SAMPLE_SECONDS:
            return
        m = self.metrics
        ttft, tpot = _histogram(m.ttft), _histogram(m.tpot)
        point = (now, _counter(m.generation_tokens), *ttft, *tpot, stats.num_running, stats.num_waiting, stats.num_pages_used)
        self._points.append(point)

    def to_json(self) -> dict:
        """Per interval between two points: its end time (s before now, <= 0), tokens/s, mean TTFT and
        TPOT in ms (None where no request got its first, or a next, token), and the counts at its end."""
        points = list(self._points)
        now = time.monotonic() - self.start
        out = {k: [] for k in ("t", "tokens_per_s", "ttft_ms", "tpot_ms", "running", "waiting", "pages_used")}
        for (t0, gen0, fs0, fc0, ps0, pc0, *_), (t1, gen1, fs1, fc1, ps1, pc1, running, waiting, pages) in zip(
            points, points[1:], strict=False
        ):
            out["t"].append(round(t1 - now, 3))
            out["tokens_per_s"].append(round((gen1 - gen0) / (t1 - t0), 2))
            out["ttft_ms"].append(round(1e3 * (fs1 - fs0) / (fc1 - fc0), 3) if fc1 > fc0 else None)
            out["tpot_ms"].append(round(1e3 * (ps1 - ps0) / (pc1 - pc0), 3) if pc1 > pc0 else None)
            out["running"].append(running)
            out["waiting"].append(waiting)
            out["pages_used"].append(pages)
        return out


def _counter(counter) -> float:
    """A prometheus_client Counter's value, read through its public `collect()`."""
    return next(s.value for s in counter.collect()[0].samples if s.name.endswith("_total"))


def _histogram(histogram) -> tuple[float, float]:
    """A prometheus_client Histogram's (sum, count)."""
    samples = {s.name.rsplit("_", 1)[-1]: s.value for s in histogram.collect()[0].samples}
    return samples["sum"], samples["count"]


def state_json(stats: EngineStats, series: Series, model: str, backend: str) -> dict:
    """What the page draws, from one snapshot (see the module docstring)."""
    body = {
        "model": model,
        "backend": backend,
        "page_size": PAGE_SIZE,
        "num_slots": stats.num_running + stats.num_free_slots,
        "num_pages": stats.num_pages,  # usable pages: ids 1..num_pages (page 0 is the null page)
        "max_model_len": stats.max_model_len,
        "engine": {
            "running": stats.num_running,
            "waiting": stats.num_waiting,
            "pages_used": stats.num_pages_used,
            "pages_free": stats.num_pages_free,
            "steps": stats.num_steps,
            "preemptions": stats.num_preemptions,
        },
        "series": series.to_json(),
    }
    if stats.running is None and (stats.num_running or stats.num_waiting):
        body.update(slots=None, waiting=None, shared_page_ids=None)  # detail comes with the next step
        return body
    running, waiting = stats.running or (), stats.waiting or ()
    holders: dict[int, int] = {}
    for r in running:
        for page_id in r.page_ids or ():
            holders[page_id] = holders.get(page_id, 0) + 1
    body["slots"] = [
        {
            "slot": r.slot,
            "request_id": r.request_id,
            "phase": r.phase,
            "prompt_tokens": r.num_prompt_tokens,
            "output_tokens": r.num_output_tokens,
            "computed_tokens": r.num_computed_tokens,
            "preemptions": r.num_preemptions,
            "page_ids": list(r.page_ids or ()),
        }
        for r in running
    ]
    body["waiting"] = [
        {"request_id": r.request_id, "prompt_tokens": r.num_prompt_tokens, "output_tokens": r.num_output_tokens,
         "preemptions": r.num_preemptions}
        for r in waiting[:MAX_WAITING_SHOWN]
    ]  # fmt: skip
    # A page in several block tables (a shared prefix, once the prefix cache shares pages).
    body["shared_page_ids"] = sorted(p for p, n in holders.items() if n > 1)
    return body


# ---- the page -----------------------------------------------------------------------------------------
def _page() -> tuple[str, dict[str, str]]:
    """The HTML, and headers that let it run its own inline script and style and reach nothing but this server."""
    html = resources.files("numba_vllm.server").joinpath("dashboard.html").read_text(encoding="utf-8")

    def hashes(tag: str) -> str:
        bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.DOTALL)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in bodies)

    policy = (
        f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    headers = {
        "Content-Security-Policy": policy,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-store",
    }
    return html, headers


def dashboard_routes(state: ServerState) -> APIRouter:
    """GET /dashboard (the page) and GET /v1/dashboard/state (its data) for `state`'s server."""
    router = APIRouter()
    html, headers = _page()
    loop = state.engine_loop
    series = Series(loop.metrics)

    @router.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> HTMLResponse:
        return HTMLResponse(html, headers=headers)

    @router.get("/v1/dashboard/state")
    async def dashboard_state() -> JSONResponse:
        """Slots, pages, queue and series for the dashboard page (needs the API key, if one is set)."""
        loop.dashboard.watch()
        stats = loop.dashboard.stats
        series.sample(stats)
        body = state_json(stats, series, state.model_names[0], state.model.backend)
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    return router
