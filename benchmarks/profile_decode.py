"""A short, repeatable decode for profilers: `make profile` runs it under nsys and ncu.

    NUMBA_VLLM_LINEINFO=1 python benchmarks/profile_decode.py --config-dir tests/data/llama-3.2-1b-instruct \
        --batch 8 --steps 8 [--prompt-len 128] [--profile-range all|prefill|decode] [--eager]

Builds random bf16 weights from a config (speed does not depend on the values), then runs the same
workload twice: --batch requests of --prompt-len random tokens are prefilled, then decoded for
--steps steps, then aborted. The first pass compiles every kernel and records the CUDA graphs of
its decode steps; the second is the one measured, and only it runs between `cuProfilerStart` and
`cuProfilerStop` (`numba.cuda.profile_start/stop`), so `nsys --capture-range=cudaProfilerApi` and
`ncu --profile-from-start off` see no compilation and no warm-up. --profile-range narrows that
window to the prefill step(s) or to the decode steps (ncu's --launch-skip/--launch-count then count
kernels from the first decode step). Prints the prefill time and the median decode step time.

Set NUMBA_VLLM_LINEINFO=1 (or pass --lineinfo) so that ncu's source view maps SASS to the kernels'
Python lines. --backend numpy or sim runs the same steps without a GPU (no profiler calls), to
check the script itself on a small config.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config-dir", default="tests/data/llama-3.2-1b-instruct", help="a directory with config.json")
    ap.add_argument("--batch", type=int, default=8, help="requests decoded together")
    ap.add_argument("--steps", type=int, default=8, help="decode steps measured")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--profile-range", choices=["all", "prefill", "decode"], default="all",
                    help="what runs between cuProfilerStart and cuProfilerStop in the measured pass")  # fmt: skip
    ap.add_argument("--eager", action="store_true", help="launch decode steps one kernel at a time (no CUDA graphs)")
    ap.add_argument("--lineinfo", action="store_true", help="compile kernels with line information (NUMBA_VLLM_LINEINFO=1)")
    ap.add_argument("--backend", choices=["cuda", "sim", "numpy"], default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if min(args.batch, args.steps, args.prompt_len) < 1:
        ap.error("--batch, --steps and --prompt-len must be positive")
    if args.lineinfo:
        os.environ["NUMBA_VLLM_LINEINFO"] = "1"  # before any kernel is compiled

    # Imported here so that the switches above are seen when the kernels are defined.
    import numpy as np

    from numba_vllm.engine.config import EngineConfig
    from numba_vllm.engine.kv_cache import pages_for_tokens
    from numba_vllm.engine.llm_engine import LLMEngine
    from numba_vllm.engine.sampling import SamplingParams
    from numba_vllm.executor.backend import prepare_backend
    from numba_vllm.loading.checkpoint import random_checkpoint

    prepare_backend(args.backend)
    t0 = time.perf_counter()
    ckpt = random_checkpoint(args.config_dir, seed=args.seed)
    max_len = args.prompt_len + args.steps + 2
    extra = {"enforce_eager": True} if args.eager else {}
    engine = LLMEngine(
        ckpt,
        EngineConfig(
            backend=args.backend,
            max_num_seqs=args.batch,
            max_num_batched_tokens=max(2048, args.batch * args.prompt_len),  # one prefill step
            max_model_len=max_len,
            num_pages=1 + args.batch * pages_for_tokens(max_len),  # one pass at a time: no preemption
            **extra,
        ),
    )
    print(f"{ckpt.config.num_parameters():,} parameters, engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, ckpt.config.vocab_size, args.prompt_len).tolist() for _ in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True)
    profiler = Profiler(args.backend == "cuda")

    for measured in (False, True):
        tag = "run" if measured else "warmup"
        outputs = [engine.add_request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
        if measured and args.profile_range in ("all", "prefill"):
            profiler.start()
        t_prefill = time.perf_counter()
        while not all(o.outputs[0].token_ids for o in outputs):  # every prompt prefilled, its first token sampled
            engine.step()
        t_prefill = time.perf_counter() - t_prefill
        if measured and args.profile_range == "prefill":
            profiler.stop()
        if measured and args.profile_range == "decode":
            profiler.start()
        step_times = []
        for _ in range(args.steps):
            s = time.perf_counter()
            engine.step()  # returns once the sampled tokens are on the host: the step is done
            step_times.append(time.perf_counter() - s)
        if measured:
            profiler.stop()
        for o in outputs:
            engine.abort_request(o.request_id)
        median = statistics.median(step_times)
        print(
            f"{tag}: prefill of {args.batch} x {args.prompt_len} tokens {t_prefill * 1000:.1f} ms; "
            f"decode {args.steps} steps of batch {args.batch}: median {median * 1000:.2f} ms/step "
            f"({args.batch / median:.0f} tokens/s)",
            flush=True,
        )


class Profiler:
    """`cuProfilerStart`/`cuProfilerStop` around the measured work (nothing off the GPU)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.running = False

    def start(self) -> None:
        if self.enabled and not self.running:
            from numba import cuda

            cuda.synchronize()
            cuda.profile_start()
            self.running = True

    def stop(self) -> None:
        if self.enabled and self.running:
            from numba import cuda

            cuda.synchronize()
            cuda.profile_stop()
            self.running = False


if __name__ == "__main__":
    main()
