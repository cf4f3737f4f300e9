"""End-to-end engine run on the GPU: many concurrent requests of mixed lengths on a random checkpoint.

    python benchmarks/engine.py --config-dir tests/data/llama-3.2-1b-instruct --num-requests 256 \
        --max-num-seqs 256 [--num-pages 600] [--json out.json]

Builds random bf16 weights in memory from a config (speed does not depend on the values), then
submits all requests at once (prompt lengths uniform in [--min-prompt, --max-prompt], output lengths
uniform in [--min-output, --max-output], random token ids, EOS ignored) and steps the engine until
all finish. A small --num-pages forces preemption. Prints load time, peak GPU memory, steps,
preemptions, output tokens/s (prefill included) and the median step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from numba_vllm.checkpoint import random_checkpoint  # noqa: E402
from numba_vllm.config import EngineConfig  # noqa: E402
from numba_vllm.engine.llm_engine import LLMEngine  # noqa: E402
from numba_vllm.sampling import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config-dir", default="tests/data/llama-3.2-1b-instruct")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--num-pages", type=int, default=None)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from numba import cuda

    t0 = time.perf_counter()
    ckpt = random_checkpoint(args.config_dir, seed=args.seed)
    t_weights = time.perf_counter() - t0
    engine = LLMEngine(
        ckpt,
        EngineConfig(
            backend="cuda",
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_prompt + args.max_output + 1,
            num_pages=args.num_pages,
        ),
    )
    cuda.synchronize()
    t_load = time.perf_counter() - t0
    free, total = cuda.current_context().get_memory_info()
    rng = np.random.default_rng(args.seed)
    prompt_lens = rng.integers(args.min_prompt, args.max_prompt + 1, args.num_requests)
    output_lens = rng.integers(args.min_output, args.max_output + 1, args.num_requests)
    # Warm up (compiles every kernel variant a step uses) on a throwaway request.
    engine.add_request("warmup", list(range(1, 40)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    cuda.synchronize()
    t_ready = time.perf_counter() - t0
    outputs = [
        engine.add_request(
            str(i),
            rng.integers(0, 10000, int(p)).tolist(),
            SamplingParams(temperature=0, max_tokens=int(o), ignore_eos=True),
        )
        for i, (p, o) in enumerate(zip(prompt_lens, output_lens, strict=True))
    ]
    steps0, preempt0 = engine.num_steps, engine.num_preemptions
    step_times, min_free = [], free
    t1 = time.perf_counter()
    while engine.has_unfinished_requests():
        s = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - s)
        if len(step_times) % 50 == 0:
            min_free = min(min_free, cuda.current_context().get_memory_info()[0])
    cuda.synchronize()
    elapsed = time.perf_counter() - t1
    generated = sum(len(o.token_ids) for o in outputs)
    assert all(o.finish_reason == "length" and len(o.token_ids) == n for o, n in zip(outputs, output_lens, strict=True))
    result = {
        "config": args.config_dir,
        "num_requests": args.num_requests,
        "max_num_seqs": args.max_num_seqs,
        "num_pages": engine.runner.num_pages,
        "weights_build_s": round(t_weights, 2),
        "load_s": round(t_load, 2),
        "ready_s (load + first compile)": round(t_ready, 2),
        "gpu_memory_used_GiB (peak seen)": round((total - min_free) / 2**30, 2),
        "prompt_tokens": int(prompt_lens.sum()),
        "output_tokens": generated,
        "steps": engine.num_steps - steps0,
        "preemptions": engine.num_preemptions - preempt0,
        "elapsed_s": round(elapsed, 2),
        "output_tokens_per_s": round(generated / elapsed, 1),
        "median_step_ms": round(1000 * statistics.median(step_times), 2),
    }
    for k, v in result.items():
        print(f"{k:>36}: {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
