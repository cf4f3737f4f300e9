"""Server metrics in the Prometheus text exposition format (version 0.0.4), written by hand.

The engine thread records (tokens, latencies, finished requests, and a snapshot of the scheduler
and the page allocator after each step); `/metrics` renders under the same lock. Names follow
vLLM's (`vllm:` becomes `numba_vllm:`), so dashboards built for it need only the prefix changed.
"""

from __future__ import annotations

import bisect
import math
import threading

PREFIX = "numba_vllm:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)
FINISH_REASONS = ("stop", "length", "abort")


class Histogram:
    """Cumulative-bucket histogram: counts of observations <= each bound, their sum and count."""

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, out: list[str]) -> None:
        name = PREFIX + self.name
        out += [f"# HELP {name} {self.help}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            cumulative += n
            le = "+Inf" if bound == math.inf else repr(float(bound))
            out.append(f'{name}_bucket{{le="{le}"}} {cumulative}')
        out += [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]


class ServerMetrics:
    """Everything /metrics shows. Mutated by the engine thread, rendered by the event loop."""

    def __init__(self, num_pages_total: int):
        self.lock = threading.Lock()
        self.num_running = 0
        self.num_waiting = 0
        self.pages_total = num_pages_total  # usable pages (the null page excluded)
        self.pages_free = num_pages_total
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.steps = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = Histogram("time_to_first_token_seconds", "Time from arrival to the first generated token.", TTFT_BUCKETS)
        self.tpot = Histogram(
            "time_per_output_token_seconds", "Time between consecutive generated tokens of a request.", TPOT_BUCKETS
        )
        self.e2e = Histogram("e2e_request_latency_seconds", "Time from arrival to the last token.", E2E_BUCKETS)

    def render(self) -> str:
        out: list[str] = []
        with self.lock:
            used = self.pages_total - self.pages_free
            gauges = [
                ("num_requests_running", "Requests in batch slots (prefilling or decoding).", self.num_running),
                ("num_requests_waiting", "Requests queued for a slot (new or preempted).", self.num_waiting),
                ("kv_cache_pages_used", "KV-cache pages held by requests.", used),
                ("kv_cache_pages_free", "KV-cache pages free.", self.pages_free),
                ("kv_cache_pages_total", "Usable KV-cache pages (16 tokens each).", self.pages_total),
                (
                    "kv_cache_usage_perc",
                    "Fraction of KV-cache pages in use (0..1).",
                    used / self.pages_total if self.pages_total else 0.0,
                ),
            ]
            for name, help, value in gauges:
                out += [f"# HELP {PREFIX}{name} {help}", f"# TYPE {PREFIX}{name} gauge", f"{PREFIX}{name} {value}"]
            counters = [
                ("prompt_tokens_total", "Prompt tokens of admitted requests.", self.prompt_tokens),
                ("generation_tokens_total", "Generated tokens.", self.generation_tokens),
                ("num_preemptions_total", "Requests that lost their pages and were recomputed.", self.preemptions),
                ("engine_steps_total", "Engine steps (forward passes).", self.steps),
            ]
            for name, help, value in counters:
                out += [f"# HELP {PREFIX}{name} {help}", f"# TYPE {PREFIX}{name} counter", f"{PREFIX}{name} {value}"]
            name = PREFIX + "request_success_total"
            out += [f"# HELP {name} Finished requests by finish reason.", f"# TYPE {name} counter"]
            out += [f'{name}{{finished_reason="{r}"}} {n}' for r, n in self.finished.items()]
            for h in (self.ttft, self.tpot, self.e2e):
                h.render(out)
        return "\n".join(out) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (for the tests)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values
