"""Server metrics for `/metrics`, in the Prometheus text format (version 0.0.4), with `prometheus_client`.

Each server has its own `CollectorRegistry`, never the library's process-wide default, so two
servers (or tests) in one process do not clash. Two kinds of series:
- engine state (requests running and waiting, KV-cache pages, steps, preemptions, prefix-cache
  queries and hits, in tokens as vLLM counts them): every step's message from the engine core
  brings a fresh `EngineStats`, and `EngineStateCollector` turns the latest one
  into gauges and counters when `/metrics` is read. The snapshot is frozen and replaced whole, so
  the event loop reads one consistent state without a lock;
- events (tokens in and out, finished requests, latencies): counters and histograms the front end
  updates as the core's news arrives (so they live in the server's process: no multiprocess mode).

Every series is published under the `numba_vllm:` prefix, unlabelled: the engine's own view,
pages and steps included. Those that vLLM also has are published a second time under vLLM's own
names with vLLM's `model_name` label (`vllm:num_requests_waiting{model_name="..."}`, ...): the
model-server protocol that routers, the Gateway API Inference Extension and vLLM's dashboards read.
`VllmNames` derives that second copy from the first when /metrics is read, so the two never
disagree and a new `numba_vllm:` series with a vLLM name (`VLLM_NAMES`) shows up under both. The
`_created` samples prometheus_client adds to counters and histograms (each series' creation time)
are left out, as vLLM leaves them out.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from numba_vllm.engine.stats import EngineStats
from numba_vllm.model.config import PAGE_SIZE

PREFIX = "numba_vllm:"
VLLM_PREFIX = "vllm:"
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)
FINISH_REASONS = ("stop", "length", "abort", "error")  # error: the engine failed the request (a 500)

# numba_vllm: series -> the vllm: names it is also published under. vLLM calls the time between
# consecutive tokens both `time_per_output_token_seconds` (older) and `inter_token_latency_seconds`.
# The prefix-cache counters count prompt tokens looked up in, and found in, the prefix cache.
VLLM_NAMES = {
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc",),
    "num_preemptions": ("num_preemptions",),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "request_success": ("request_success",),
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "time_per_output_token_seconds": ("time_per_output_token_seconds", "inter_token_latency_seconds"),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "prefix_cache_queries": ("prefix_cache_queries",),
    "prefix_cache_hits": ("prefix_cache_hits",),
}


class EngineStateCollector:
    """The latest `EngineStats` as Prometheus gauges and counters, built when /metrics is read."""

    def __init__(self, stats: EngineStats):
        self.stats = stats  # replaced (never changed in place) with each step's snapshot from the engine core

    def collect(self) -> Iterable[Metric]:
        s = self.stats  # one snapshot for every series below
        gauges = [
            ("num_requests_running", "Requests in batch slots (prefilling or decoding).", s.num_running),
            ("num_requests_waiting", "Requests queued for a slot (new or preempted).", s.num_waiting),
            ("kv_cache_pages_used", "KV-cache pages held by requests.", s.num_pages_used),
            ("kv_cache_pages_free", "KV-cache pages free.", s.num_pages_free),
            ("kv_cache_pages_total", "Usable KV-cache pages (16 tokens each).", s.num_pages),
            ("kv_cache_usage_perc", "Fraction of KV-cache pages in use (0..1).", s.kv_cache_usage),
            ("kv_cache_pages_cached", "KV-cache pages holding a reusable prefix (in use or free).", s.num_cached_pages),
        ]
        for name, help, value in gauges:
            yield GaugeMetricFamily(PREFIX + name, help, value)
        yield CounterMetricFamily(
            PREFIX + "num_preemptions", "Requests that lost their pages and were recomputed.", s.num_preemptions
        )
        yield CounterMetricFamily(PREFIX + "engine_steps", "Engine steps (forward passes).", s.num_steps)
        yield CounterMetricFamily(
            PREFIX + "prefix_cache_queries", "Prefix cache queries, in tokens (known tokens of admitted requests).",
            s.num_prefix_cache_queries,
        )  # fmt: skip
        yield CounterMetricFamily(
            PREFIX + "prefix_cache_hits", "Prefix cache hits, in tokens (their K/V reused, not recomputed).",
            s.num_prefix_cache_hits,
        )  # fmt: skip
        yield CounterMetricFamily(
            PREFIX + "engine_failed_steps", "Engine steps that failed (their requests got a 500).", s.num_failed_steps
        )


class ServerMetrics:
    """Everything /metrics shows, in one server's own registry. Updated and rendered on the event
    loop, from the engine core's messages. `model_name` is the `model_name` label of the vllm: series."""

    def __init__(self, stats: EngineStats, model_name: str):
        self.registry = CollectorRegistry()
        self.engine_state = EngineStateCollector(stats)
        self.registry.register(self.engine_state)
        self.vllm_names = VllmNames(self.registry, self.engine_state, model_name)
        r = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", registry=r)
        self.finished = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r
        )
        for reason in FINISH_REASONS:  # every reason shows from the start, at 0
            self.finished.labels(reason)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time from arrival to the first generated token.",
            buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds", "Time between consecutive generated tokens of a request.",
            buckets=TPOT_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last token.", buckets=E2E_BUCKETS, registry=r
        )

    def set_engine_stats(self, stats: EngineStats) -> None:
        """Publish the engine's state after a step (as the engine core's message brings it)."""
        self.engine_state.stats = stats

    def render(self) -> bytes:
        """The registry and its vllm: copy in the Prometheus text format, without `_created` samples."""
        return generate_latest(_WithoutCreated(self.vllm_names))


class VllmNames:
    """A registry's series, then those with a vLLM name (`VLLM_NAMES`) again under that name with a
    `model_name` label, then `vllm:cache_config_info` (the page size and count, which the inference
    extension's prefix-cache scorer reads). A collector over the registry rather than a second set of
    metrics, so both copies come from one reading."""

    def __init__(self, registry: CollectorRegistry, engine_state: EngineStateCollector, model_name: str):
        self.registry = registry
        self.engine_state = engine_state
        self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        mirrored = []
        for metric in self.registry.collect():  # fresh Metric objects on every call
            yield metric
            if metric.name.startswith(PREFIX):
                for name in VLLM_NAMES.get(metric.name[len(PREFIX) :], ()):
                    mirrored.append(self._renamed(metric, VLLM_PREFIX + name))
        yield from mirrored
        info = GaugeMetricFamily(
            VLLM_PREFIX + "cache_config_info", "KV-cache configuration.", labels=["block_size", "num_gpu_blocks"]
        )
        info.add_metric([str(PAGE_SIZE), str(self.engine_state.stats.num_pages)], 1.0)
        yield info

    def _renamed(self, metric: Metric, name: str) -> Metric:
        """`metric` under `name`, every sample also labelled model_name."""
        out = Metric(name, metric.documentation, metric.type, metric.unit)
        for s in metric.samples:
            labels = {**s.labels, "model_name": self.model_name}
            out.add_sample(name + s.name[len(metric.name) :], labels, s.value, s.timestamp, s.exemplar)
        return out


class _WithoutCreated:
    """A collector's metrics minus their `_created` samples. Filtered here rather than switched off
    with prometheus_client's `disable_created_metrics()`, which would change every registry in the
    process, the application's own included."""

    def __init__(self, collector):
        self.collector = collector

    def collect(self) -> Iterable[Metric]:
        for metric in self.collector.collect():  # fresh Metric objects on every call: safe to edit
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}, through prometheus_client's parser (for the tests)."""
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values
