"""Latency: milliseconds per decode step at a few batch sizes, and time to first token.

For each batch size B, B requests with random prompts of `prompt_len` token ids are submitted at
once (greedy, EOS ignored, `output_len` new tokens each) to an engine that has been warmed up: first
a short run that compiles the kernels (`warmup_s`), then, per batch size, `warmup_runs` untimed runs
of the same shapes with other random prompts (on the GPU this records the CUDA graphs of its decode
steps, a one-time cost like compilation; `warmup_runs_s` in each row; other prompts, so the prefix
cache cannot serve the timed prompts from the rehearsal). Neither is in the figures.
Every step is timed with `time.perf_counter()`; `LLMEngine.step()` returns once the sampled tokens
are on the host, so a step's wall time includes its device work.

- `ttft_ms`: from submission until every one of the B requests has its first token (the prefill
  steps; at B = 1, the time to first token of one prompt).
- decode step times: the steps after that in which every request got a token (B tokens a step, one
  per sequence), so the median is the time per output token a user sees at that batch size.
- the batch-1 floor: the weight bytes a decode step must read / the device's bandwidth
  (`--peak-bandwidth-tbs`, default the H200's measured 4.24 TB/s copy rate); KV reads are ignored.
"""

from __future__ import annotations

import time

import numpy as np

from numba_vllm.bench.common import (
    BenchError,
    EngineOptions,
    Log,
    build_engine,
    bytes_text,
    check_length,
    count_text,
    environment,
    fmt,
    format_table,
    log_stderr,
    ms_stats,
    random_token_ids,
    ratio,
    release_device_memory,
    synchronize,
    warm_up,
    weight_bytes_per_decode_step,
)
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.loading.checkpoint import Checkpoint

DEFAULT_BATCH_SIZES = (1, 8, 32)


def latency_prompts(batch_sizes, prompt_len: int, seed: int, vocab_size: int) -> dict[int, list[list[int]]]:
    """The prompts of each batch size, drawn in order from one generator seeded with `seed` (the same
    prompts for the engine and for transformers)."""
    rng = np.random.default_rng(seed)
    return {b: [random_token_ids(rng, prompt_len, vocab_size) for _ in range(b)] for b in batch_sizes}


def run_latency(
    ckpt: Checkpoint,
    model_desc: str,
    options: EngineOptions,
    batch_sizes=DEFAULT_BATCH_SIZES,
    prompt_len: int = 128,
    output_len: int = 256,
    seed: int = 0,
    peak_bandwidth_tbs: float = 4.24,
    warmup_runs: int = 1,
    compare_hf: bool = False,
    hf_compile: bool = False,
    log: Log = log_stderr,
    logprobs: int | None = None,
) -> dict:
    """Run the latency benchmark; returns the JSON-ready result (see the module docstring). `logprobs`:
    every request also asks for the top-k logprobs of its tokens (their cost; None: not asked)."""
    batch_sizes = list(batch_sizes)
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise BenchError(f"batch sizes must be positive integers, got {batch_sizes}")
    if len(set(batch_sizes)) != len(batch_sizes):
        raise BenchError(f"batch sizes repeat: {batch_sizes}")
    if max(batch_sizes) > options.max_num_seqs:
        raise BenchError(f"batch size {max(batch_sizes)} is above --max-num-seqs {options.max_num_seqs}")
    if prompt_len < 1:
        raise BenchError(f"prompt length must be >= 1, got {prompt_len}")
    if output_len < 2:
        raise BenchError(f"output length must be >= 2 (one prefill token, then decode steps), got {output_len}")
    if warmup_runs < 0:
        raise BenchError(f"warm-up runs must be >= 0, got {warmup_runs}")
    if not peak_bandwidth_tbs > 0:
        raise BenchError(f"peak bandwidth must be > 0 TB/s, got {peak_bandwidth_tbs}")
    config = ckpt.config
    max_model_len = prompt_len + output_len + 1
    check_length(config, max_model_len, f"--prompt-len {prompt_len} + --output-len {output_len}")
    prompts = latency_prompts(batch_sizes, prompt_len, seed, config.vocab_size)

    engine, load_s = build_engine(ckpt, options.engine_config(max_model_len))
    backend = engine.backend
    env = environment(backend)
    log(f"[latency] {model_desc}: {count_text(config.num_parameters())} parameters, backend {backend} ({env['device']}), "
        f"engine ready in {load_s:.1f} s")  # fmt: skip
    warmup_s = warm_up(engine, prompt_len, num_requests=min(2, max(batch_sizes)))
    log(f"[latency] warm-up (kernel compilation) {warmup_s:.1f} s")
    rows = []
    for b in batch_sizes:
        t = time.perf_counter()
        for r in range(warmup_runs):  # the same shapes, untimed: CUDA graphs of its shapes are recorded now
            # other prompts (their own seed): the prefix cache must not serve the timed run's prompts
            rehearsal = latency_prompts([b], prompt_len, seed + 1 + r, config.vocab_size)[b]
            _measure_batch(engine, b, rehearsal, output_len, tag=f"warmup{r}", logprobs=logprobs)
        rehearsal_s = time.perf_counter() - t
        row = _measure_batch(engine, b, prompts[b], output_len, logprobs=logprobs)
        row["warmup_runs_s"] = rehearsal_s
        log(f"[latency] batch {b}: ttft {row['ttft_ms']:.1f} ms, decode median {fmt(row['decode_ms_median'])} ms/step")
        rows.append(row)
    num_pages = 1 + engine.stats().num_pages  # the pool, null page included, as --num-pages counts it
    del engine
    release_device_memory(backend)

    weight_bytes = weight_bytes_per_decode_step(config)
    floor_ms = weight_bytes / (peak_bandwidth_tbs * 1e12) * 1e3
    b1 = next((r for r in rows if r["batch_size"] == 1), None)
    result = {
        "benchmark": "latency",
        "model": model_desc,
        "num_parameters": config.num_parameters(),
        "backend": backend,
        "environment": env,
        "engine": {**options.to_dict(), "max_model_len": max_model_len, "num_pages": num_pages},
        "workload": {
            "batch_sizes": batch_sizes,
            "prompt_len": prompt_len,
            "output_len": output_len,
            "logprobs": logprobs,
            "seed": seed,
            "warmup_runs": warmup_runs,
            "token_ids": f"uniform in [0, {min(10000, config.vocab_size)})",
            "sampling": "greedy, ignore_eos",
        },
        "load_s": load_s,
        "warmup_s": warmup_s,
        "weight_bytes": weight_bytes,
        "peak_bandwidth_TBps": peak_bandwidth_tbs,
        "batch1_floor_ms": floor_ms,
        "batch1_ratio_to_floor": ratio(b1["decode_ms_median"], floor_ms) if b1 else None,
        "results": rows,
    }
    if compare_hf:
        from numba_vllm.bench import hf

        hf_result = hf.run_latency(ckpt, hf.device_for(backend), prompts, output_len, compile=hf_compile, log=log)
        for row in rows:
            h = next(r for r in hf_result["results"] if r["batch_size"] == row["batch_size"])
            row["hf_decode_ms_median"] = h["decode_ms_median"]
            row["ratio_decode_vs_hf"] = ratio(row["decode_ms_median"], h["decode_ms_median"])
            row["ratio_ttft_vs_hf"] = ratio(row["ttft_ms"], h["ttft_ms"])
        result["hf"] = hf_result
    return result


def _measure_batch(
    engine, batch_size: int, prompts: list[list[int]], output_len: int, tag: str = "timed", logprobs: int | None = None
) -> dict:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, logprobs=logprobs)
    preempt0, steps0 = engine.num_preemptions, engine.num_steps
    t0 = time.perf_counter()
    outs = [engine.add_request(f"latency-{tag}-b{batch_size}-{i}", p, params) for i, p in enumerate(prompts)]
    ttft = None
    decode = []  # seconds of each step in which every request decoded one token
    while engine.has_unfinished_requests():
        s = time.perf_counter()
        updated = engine.step()
        e = time.perf_counter()
        if ttft is not None and len(updated) == batch_size:
            decode.append(e - s)
        if ttft is None and all(o.outputs[0].token_ids for o in outs):
            ttft = e - t0
    synchronize(engine.backend)
    total = time.perf_counter() - t0
    for o in outs:
        if len(o.outputs[0].token_ids) != output_len:
            raise BenchError(f"request {o.request_id} generated {len(o.outputs[0].token_ids)} tokens, expected {output_len}")
    stats = ms_stats(decode)
    return {
        "batch_size": batch_size,
        "ttft_ms": None if ttft is None else ttft * 1e3,
        "decode_ms_median": stats["median_ms"],
        "decode_ms_p90": stats["p90_ms"],
        "decode_ms_mean": stats["mean_ms"],
        "decode_steps": len(decode),
        "decode_tokens_per_s": None if not stats["median_ms"] else batch_size / (stats["median_ms"] * 1e-3),
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "steps": engine.num_steps - steps0,
        "preemptions": engine.num_preemptions - preempt0,
        "total_s": total,
    }


def format_latency(result: dict) -> str:
    """The printed report: a header, one row per batch size (transformers beside it with --compare-hf)."""
    hf = result.get("hf")
    head = [
        f"latency: {result['model']} ({count_text(result['num_parameters'])} parameters), backend {result['backend']} "
        f"({result['environment']['device']})",
        f"prompt {result['workload']['prompt_len']} tokens, {result['workload']['output_len']} new tokens, greedy"
        + ("" if result["workload"].get("logprobs") is None else f", top-{result['workload']['logprobs']} logprobs") + "; "
        f"engine load {result['load_s']:.1f} s, warm-up (compile) {result['warmup_s']:.1f} s",
    ]
    headers = ["batch", "TTFT ms", "decode ms/step p50", "p90", "tokens/s"]
    if hf is not None:
        headers += ["HF TTFT ms", "HF ms/step p50", "HF p90", "ours/HF step"]
    rows = []
    for r in result["results"]:
        row = [str(r["batch_size"]), r["ttft_ms"], r["decode_ms_median"], r["decode_ms_p90"], r["decode_tokens_per_s"]]
        if hf is not None:
            h = next(x for x in hf["results"] if x["batch_size"] == r["batch_size"])
            row += [h["ttft_ms"], h["decode_ms_median"], h["decode_ms_p90"], r.get("ratio_decode_vs_hf")]
        rows.append(row)
    lines = [*head, "", format_table(headers, rows)]
    floor = (
        f"batch-1 floor: {bytes_text(result['weight_bytes'])} of weights / {result['peak_bandwidth_TBps']} TB/s = "
        f"{result['batch1_floor_ms']:.4g} ms/step"
    )
    if result["batch1_ratio_to_floor"] is not None:
        floor += f"; measured batch 1 is {result['batch1_ratio_to_floor']:.2f}x the floor"
    lines += ["", floor]
    if hf is not None:
        lines.append(f"transformers: {hf['description']}")
    return "\n".join(lines)
