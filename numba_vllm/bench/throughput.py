"""Throughput: the standard offline workload, under continuous and under static scheduling, with
prefix caching on, off, or both side by side.

`--num-requests` requests (default 256) drawn from one generator seeded with `--seed`: prompt lengths
uniform in [--min-prompt-len, --max-prompt-len], output lengths uniform in [--min-output-len,
--max-output-len] (default [100, 1024] both), prompt token ids uniform in [0, 10000), greedy, EOS
ignored (every request generates exactly its output length). With `--shared-prefix-len N` every
prompt starts with the same N random tokens (drawn last, so the rest of the workload is the seed's
as without it), followed by its own tokens of the drawn length. All requests are submitted at once
and the engine is stepped until every one has finished; each step is timed (`LLMEngine.step()`
returns with the tokens on the host).

Each run (a scheduling mode, with prefix caching on or off) gets a fresh engine (the weights uploaded
again, the cache allocated again: the load time is reported) and a warm-up (kernel compilation,
reported apart), so no run finds another's cached prefixes. `--compare-prefix-caching`, implied by
`--shared-prefix-len`, runs each mode with caching on and off. Figures: output tokens/s = generated
tokens / wall time of the run, prefill included; total tokens/s counts prompt tokens too; time to
first token (from the submission of all requests to each one's first token: its p50 and p90);
steps and preemptions (requests that lost their pages and were recomputed); the median step; the
prefix-cache hit rate (prompt tokens found cached / looked up); peak device memory in use (the
driver's total - free, sampled every 10 steps: the KV cache is allocated up front, so this is mostly
its size, set by --gpu-memory-utilization or --num-pages).
Each run also keeps every step's end time, generated tokens and duration (`per_step`), which `--plot`
draws: static batching's steps thin out as a batch drains, continuous batching's stay full.

`--repeat N` runs each (mode, caching) N times, each with a fresh engine, and reports the run of the
median output tokens/s (the lower middle one for even N), with every run's tokens/s, median step
and TTFT p50 beside it (`repeats`) and their spread in the table: on an H200 one run of the default
workload moves by about ±5% from start to start, more than many changes worth measuring.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from numba_vllm.bench.common import (
    BenchError,
    DeviceMemory,
    EngineOptions,
    Log,
    build_engine,
    check_length,
    count_text,
    environment,
    fmt,
    format_table,
    log_stderr,
    ms_stats,
    percentile,
    random_token_ids,
    ratio,
    record_decode_graphs,
    release_device_memory,
    synchronize,
    warm_up,
)
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.loading.checkpoint import Checkpoint

SCHEDULING_CHOICES = ("both", "continuous", "static")


@dataclass
class Workload:
    """Requests of the offline benchmark: prompt token ids and the exact number of tokens to generate."""

    prompts: list[list[int]]
    output_lens: list[int]
    shared_prefix_len: int = 0  # leading tokens every prompt has in common

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def max_len(self) -> int:
        return max(len(p) + n for p, n in zip(self.prompts, self.output_lens, strict=True))


def offline_workload(num_requests: int, seed: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                     vocab_size: int, shared_prefix_len: int = 0) -> Workload:  # fmt: skip
    """Lengths first (prompt, then output, `num_requests` each), then each prompt's ids, then the
    shared prefix every prompt starts with (none by default), from one generator seeded with `seed`.
    The prompt lengths drawn are those of each prompt's own part, after the prefix."""
    for name, (lo, hi) in (("prompt", prompt_range), ("output", output_range)):
        if lo < 1 or hi < lo:
            raise BenchError(f"{name} lengths: need 1 <= min <= max, got [{lo}, {hi}]")
    if num_requests < 1:
        raise BenchError(f"number of requests must be >= 1, got {num_requests}")
    if shared_prefix_len < 0:
        raise BenchError(f"shared prefix length must be >= 0, got {shared_prefix_len}")
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_range[0], prompt_range[1] + 1, num_requests)
    output_lens = rng.integers(output_range[0], output_range[1] + 1, num_requests)
    prompts = [random_token_ids(rng, p, vocab_size) for p in prompt_lens]
    prefix = random_token_ids(rng, shared_prefix_len, vocab_size)
    return Workload([prefix + p for p in prompts], [int(n) for n in output_lens], shared_prefix_len)


def run_throughput(
    ckpt: Checkpoint,
    model_desc: str,
    options: EngineOptions,
    num_requests: int = 256,
    seed: int = 0,
    prompt_range: tuple[int, int] = (100, 1024),
    output_range: tuple[int, int] = (100, 1024),
    scheduling: str = "both",
    shared_prefix_len: int = 0,
    compare_prefix_caching: bool = False,
    compare_hf: bool = False,
    repeat: int = 1,
    log: Log = log_stderr,
) -> dict:
    """Run the offline workload under each scheduling mode asked for (each with prefix caching on and
    off when comparing: implied by a shared prefix), ``repeat`` times each; returns the JSON-ready
    result."""
    if scheduling not in SCHEDULING_CHOICES:
        raise BenchError(f"scheduling must be one of {', '.join(SCHEDULING_CHOICES)}, got {scheduling!r}")
    if repeat < 1:
        raise BenchError(f"repeat must be at least 1, got {repeat}")
    modes = ["continuous", "static"] if scheduling == "both" else [scheduling]
    compare = compare_prefix_caching or shared_prefix_len > 0
    cachings = [True, False] if compare else [options.enable_prefix_caching]
    config = ckpt.config
    workload = offline_workload(num_requests, seed, prompt_range, output_range, config.vocab_size, shared_prefix_len)
    max_model_len = shared_prefix_len + prompt_range[1] + output_range[1] + 1
    check_length(config, max_model_len, f"prompts up to {shared_prefix_len + prompt_range[1]} tokens + outputs up to "
                 f"{output_range[1]}")  # fmt: skip
    for mode in modes:  # a mode the engine lacks fails now, before any run
        options.engine_config(max_model_len, scheduling=mode)

    runs, env, backend = {}, None, options.backend
    for mode in modes:
        for caching in cachings:
            label = run_label(mode, caching if compare else None)
            log(f"[throughput] {label}: {workload.num_requests} requests, {workload.prompt_tokens} prompt tokens, "
                f"{workload.output_tokens} output tokens")  # fmt: skip
            run_options = dataclasses.replace(options, enable_prefix_caching=caching)
            trials = []
            for i in range(repeat):
                run, backend = _run_engine(ckpt, run_options, workload, max_model_len, mode, log)
                env = env or environment(backend)
                trials.append(run)
                of = f" (run {i + 1} of {repeat})" if repeat > 1 else ""
                log(f"[throughput] {label}{of}: {run['output_tokens_per_s']:.1f} output tokens/s, TTFT p50 "
                    f"{run['ttft_p50_ms']:.1f} ms, {run['steps']} steps, {run['preemptions']} preemptions")  # fmt: skip
            runs[label] = median_run(trials)
    result = {
        "benchmark": "throughput",
        "model": model_desc,
        "num_parameters": config.num_parameters(),
        "backend": backend,
        "environment": env,
        "engine": {**options.to_dict(), "max_model_len": max_model_len},
        "repeat": repeat,
        "workload": {
            "num_requests": workload.num_requests,
            "seed": seed,
            "prompt_len_range": list(prompt_range),
            "shared_prefix_len": shared_prefix_len,
            "output_len_range": list(output_range),
            "prompt_tokens": workload.prompt_tokens,
            "output_tokens": workload.output_tokens,
            "token_ids": f"uniform in [0, {min(10000, config.vocab_size)})",
            "sampling": "greedy, ignore_eos, all requests submitted at once",
        },
        "runs": runs,
    }
    caching = True if compare else None  # continuous vs static: with caching on when comparing
    continuous, static = runs.get(run_label("continuous", caching)), runs.get(run_label("static", caching))
    if continuous is not None and static is not None:
        result["continuous_vs_static"] = ratio(continuous["output_tokens_per_s"], static["output_tokens_per_s"])
    if compare:
        result["caching_on_vs_off"] = {
            mode: {
                "output_tokens_per_s": ratio(runs[run_label(mode, True)]["output_tokens_per_s"],
                                             runs[run_label(mode, False)]["output_tokens_per_s"]),
                "ttft_p50_lower": ratio(runs[run_label(mode, False)]["ttft_p50_ms"], runs[run_label(mode, True)]["ttft_p50_ms"]),
            }
            for mode in modes
        }  # fmt: skip
    if compare_hf:
        from numba_vllm.bench import hf

        hf_run = hf.run_throughput(ckpt, hf.device_for(backend), workload.prompts, workload.output_lens, log=log)
        result["hf"] = hf_run
        for run in runs.values():
            run["ratio_vs_hf"] = ratio(run["output_tokens_per_s"], hf_run["output_tokens_per_s"])
    return result


REPEATED = ("output_tokens_per_s", "median_step_ms", "ttft_p50_ms")  # each run's figures kept beside the median run


def median_run(trials: list[dict]) -> dict:
    """The run of the median output tokens/s (the lower middle one of an even count), so that every
    figure reported comes from one run; with several runs, ``repeats`` holds each run's ``REPEATED``
    figures (in run order) and ``spread``, (max - min) / median of their tokens/s."""
    if len(trials) == 1:
        return trials[0]
    ranked = sorted(trials, key=lambda r: r["output_tokens_per_s"])
    run = dict(ranked[(len(ranked) - 1) // 2])
    rates = [r["output_tokens_per_s"] for r in trials]
    run["repeats"] = {key: [r[key] for r in trials] for key in REPEATED}
    run["repeats"]["spread"] = (max(rates) - min(rates)) / run["output_tokens_per_s"]
    return run


def run_label(mode: str, caching: bool | None) -> str:
    """A run's name in the result: its scheduling mode, and its prefix caching when runs compare it."""
    return mode if caching is None else f"{mode}, caching {'on' if caching else 'off'}"


def submit_workload(engine, workload: Workload) -> list:
    """Add every request of the workload to the engine, greedy with EOS ignored (each generates
    exactly its output length); their RequestOutputs, which fill in as the engine steps."""
    return [
        engine.add_request(f"req-{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        for i, (p, n) in enumerate(zip(workload.prompts, workload.output_lens, strict=True))
    ]


def _run_engine(ckpt, options: EngineOptions, workload: Workload, max_model_len: int, mode: str, log: Log):
    engine, load_s = build_engine(ckpt, options.engine_config(max_model_len, scheduling=mode))
    backend = engine.backend
    try:
        warmup_s = warm_up(engine, min(64, max(len(p) for p in workload.prompts)))
        longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens, strict=True))
        warmup_s += record_decode_graphs(engine, longest)
        memory = DeviceMemory(backend)
        memory.sample()
        outs = submit_workload(engine, workload)
        steps0, preempt0 = engine.num_steps, engine.num_preemptions
        stats0 = engine.stats()
        step_times, step_ends, step_tokens, first_token_s = [], [], [], []  # per step: seconds, end since t0, tokens
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            s = time.perf_counter()
            updated = engine.step()
            now = time.perf_counter()
            step_times.append(now - s)
            step_ends.append(now - t0)
            step_tokens.append(len(updated))
            first_token_s += [now - t0] * sum(1 for o in updated if len(o.outputs[0].token_ids) == 1)
            if len(step_times) % 10 == 0:
                memory.sample()
        synchronize(backend)
        elapsed = time.perf_counter() - t0
        memory.sample()
        steps, preemptions = engine.num_steps - steps0, engine.num_preemptions - preempt0
        stats = engine.stats()
        num_pages = 1 + stats.num_pages  # the pool, null page included, as --num-pages counts it
        queries = stats.num_prefix_cache_queries - stats0.num_prefix_cache_queries
        hits = stats.num_prefix_cache_hits - stats0.num_prefix_cache_hits
    finally:
        del engine
        release_device_memory(backend)
    for o, n in zip(outs, workload.output_lens, strict=True):
        c = o.outputs[0]
        if len(c.token_ids) != n or c.finish_reason != "length":
            raise BenchError(f"request {o.request_id} ended with {len(c.token_ids)} tokens ({c.finish_reason}), expected {n}")
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "scheduling": mode,
        "prefix_caching": options.enable_prefix_caching,
        "load_s": load_s,
        "warmup_s": warmup_s,
        "elapsed_s": elapsed,
        "prompt_tokens": workload.prompt_tokens,
        "output_tokens": generated,
        "output_tokens_per_s": generated / elapsed,
        "total_tokens_per_s": (generated + workload.prompt_tokens) / elapsed,
        "requests_per_s": workload.num_requests / elapsed,
        "steps": steps,
        "preemptions": preemptions,
        "ttft_p50_ms": 1e3 * percentile(first_token_s, 50),
        "ttft_p90_ms": 1e3 * percentile(first_token_s, 90),
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs),
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "median_step_ms": ms_stats(step_times)["median_ms"],
        "p90_step_ms": ms_stats(step_times)["p90_ms"],
        "num_pages": num_pages,
        "peak_device_memory_GiB": memory.peak_gib,
        "per_step": {  # for --plot: how full each step was, and how long it took
            "end_s": [round(x, 4) for x in step_ends],
            "generated": step_tokens,
            "ms": [round(x * 1e3, 3) for x in step_times],
        },
    }, backend


ROWS = [  # (label, key in a run)
    ("requests", None),
    ("output tokens", "output_tokens"),
    ("elapsed s", "elapsed_s"),
    ("output tokens/s", "output_tokens_per_s"),
    ("total tokens/s", "total_tokens_per_s"),
    ("TTFT p50 ms", "ttft_p50_ms"),
    ("TTFT p90 ms", "ttft_p90_ms"),
    ("prefix cache hit rate", "prefix_cache_hit_rate"),
    ("steps", "steps"),
    ("preemptions", "preemptions"),
    ("median step ms", "median_step_ms"),
    ("load s", "load_s"),
    ("warm-up s (compile, graphs)", "warmup_s"),
    ("peak device memory GiB", "peak_device_memory_GiB"),
]


def format_throughput(result: dict) -> str:
    """The printed report: one column per run (and transformers with --compare-hf)."""
    w = result["workload"]
    runs = result["runs"]
    hf = result.get("hf")
    columns = [(mode, runs[mode]) for mode in runs] + ([("transformers", hf)] if hf is not None else [])
    rows = []
    for label, key in ROWS:
        if key is None:
            rows.append([label] + [str(w["num_requests"])] * len(columns))
        else:
            rows.append([label] + [col.get(key) for _, col in columns])
    if any("repeats" in run for run in runs.values()):  # every run's tokens/s, under the median run's
        below = 1 + [label for label, _ in ROWS].index("output tokens/s")
        rows.insert(below, ["output tokens/s, runs"] + [_runs_range(col) for _, col in columns])
    if hf is not None:
        rows.append(["ours / transformers"] + [runs[m].get("ratio_vs_hf") for m in runs] + ["1.00"])
    shared = f", after a shared prefix of {w['shared_prefix_len']} tokens" if w["shared_prefix_len"] else ""
    repeat = result.get("repeat", 1)
    median = f"; each column the run of the median output tokens/s of {repeat}" if repeat > 1 else ""
    lines = [
        f"throughput: {result['model']} ({count_text(result['num_parameters'])} parameters), backend {result['backend']} "
        f"({result['environment']['device']})",
        f"{w['num_requests']} requests, prompts {w['prompt_len_range'][0]}-{w['prompt_len_range'][1]} tokens "
        f"({w['prompt_tokens']} in all{shared}), outputs {w['output_len_range'][0]}-{w['output_len_range'][1]} tokens "
        f"({w['output_tokens']} in all), seed {w['seed']}, greedy, EOS ignored, all submitted at once{median}",
        "",
        format_table(["", *[name for name, _ in columns]], rows),
    ]
    if result.get("continuous_vs_static") is not None or result.get("caching_on_vs_off"):
        lines.append("")
    if result.get("continuous_vs_static") is not None:
        lines.append(f"continuous / static output tokens/s: {result['continuous_vs_static']:.2f}x")
    for mode, r in result.get("caching_on_vs_off", {}).items():
        lines.append(f"{mode}, prefix caching on / off: output tokens/s {fmt(r['output_tokens_per_s'])}x, "
                     f"TTFT p50 {fmt(r['ttft_p50_lower'])}x lower")  # fmt: skip
    if hf is not None:
        lines.append(f"transformers: {hf['description']}")
        if hf.get("note"):
            lines.append(f"note: {hf['note']}")
    return "\n".join(lines)


def _runs_range(run: dict) -> str:
    """A column's every-run tokens/s: "min-max (spread)", or "-" for a single run."""
    repeats = run.get("repeats")
    if repeats is None:
        return "-"
    rates = repeats["output_tokens_per_s"]
    return f"{fmt(min(rates))}-{fmt(max(rates))} ({100 * repeats['spread']:.1f}%)"
