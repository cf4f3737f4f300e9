"""GPU check of the piecewise CUDA graphs and overlapped scheduling, in one process (~5 minutes, H200).

    python benchmarks/mixed_graphs_gpu.py [--json PATH] [--skip-throughput] [--skip-latency]

Random bf16 weights in Llama 3.2 1B's shapes (tests/data/llama-3.2-1b-instruct); one process, so
every kernel compiles once.

1. Correctness, greedy. 48 requests (prompts 20-400 tokens, outputs 8-48) submitted at once with
   --max-num-seqs 64: the 2048-token budget admits them over several steps, so most steps mix
   prompt chunks with decodes. Four engines: eager (--enforce-eager) serial, the reference; eager
   overlapped; graphs serial; graphs overlapped. Each step's batch is the same in all four (no
   request waits for a slot, and a request finishing by length is held out, not replaced), and eager
   and replayed steps launch the same kernels on the same padded shapes: the tokens must be
   identical, request by request. Prints mismatches and the graphs recorded.
   Then the cost of the graphs: seconds and device memory of `warm_up` on a --max-num-seqs 64
   engine (every token bucket's pieces and heads, the decode graphs up to 4096-token sequences).
2. Throughput, `numba-vllm bench throughput --random-weights tests/data/llama-3.2-1b-instruct
   --max-num-seqs 64` (256 requests, prompts and outputs 100-1024, greedy, EOS ignored): continuous
   and static with graphs and overlap (the defaults), with --enforce-eager, and continuous with
   graphs but --no-async-scheduling.
3. Decode latency at batch 1 and 32 (`bench latency`, prompt 128, 256 new tokens), graphs with and
   without overlap.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from numba_vllm.bench.common import LLAMA_3_2_1B_CONFIG_DIR, EngineOptions, load_model, release_device_memory  # noqa: E402
from numba_vllm.bench.latency import run_latency  # noqa: E402
from numba_vllm.bench.throughput import format_throughput, run_throughput  # noqa: E402
from numba_vllm.engine.config import EngineConfig  # noqa: E402
from numba_vllm.engine.llm_engine import LLMEngine  # noqa: E402
from numba_vllm.engine.sampling import SamplingParams  # noqa: E402
from numba_vllm.executor.backend import prepare_backend  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def correctness(ckpt, backend: str, num_requests: int) -> dict:
    """Tokens of the four engines (eager/graphs x serial/overlapped) on one workload, compared."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, min(10000, ckpt.config.vocab_size), int(n)).tolist() for n in rng.integers(20, 401, num_requests)]
    outputs = [int(n) for n in rng.integers(8, 49, num_requests)]
    runs = {}
    for eager in (True, False):
        for overlap in (False, True):
            name = f"{'eager' if eager else 'graphs'} {'overlapped' if overlap else 'serial'}"
            config = EngineConfig(backend=backend, max_num_seqs=64, max_model_len=512, enforce_eager=eager,
                                  async_scheduling=overlap)  # fmt: skip
            engine = LLMEngine(ckpt, config)
            outs = [engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                    for i, (p, n) in enumerate(zip(prompts, outputs, strict=True))]  # fmt: skip
            t0 = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            elapsed = time.perf_counter() - t0
            runner = engine.runner
            pieces = getattr(runner, "piecewise_graphs", None)
            decode = getattr(runner, "decode_graphs", None)
            runs[name] = {
                "tokens": [o.outputs[0].token_ids for o in outs],
                "steps": engine.num_steps,
                "seconds": elapsed,
                "piecewise_graphs": pieces.num_graphs if pieces is not None else 0,
                "token_buckets": sorted(pieces.token_counts) if pieces is not None else [],
                "decode_graphs": decode.num_graphs if decode is not None else 0,
            }
            log(f"[correctness] {name}: {engine.num_steps} steps, {elapsed:.2f} s, "
                f"{runs[name]['piecewise_graphs']} piecewise graphs, {runs[name]['decode_graphs']} decode graphs")  # fmt: skip
            del engine, runner, pieces, decode
            release_device_memory(backend)
    reference = runs["eager serial"]["tokens"]
    report = {}
    for name, run in runs.items():
        differing = [i for i, (a, b) in enumerate(zip(reference, run["tokens"], strict=True)) if a != b]
        first = None
        if differing:
            a, b = reference[differing[0]], run["tokens"][differing[0]]
            position = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            first = {"request": differing[0], "position": position}
        summary = {k: v for k, v in run.items() if k != "tokens"}
        report[name] = summary | {"requests_differing": len(differing), "first_difference": first}
    return report


def graph_cost(ckpt, backend: str) -> dict:
    """Seconds and device memory `LLMEngine.warm_up` takes to record every graph of a --max-num-seqs 64
    engine (kernels already compiled by the correctness runs): one dummy step per token bucket
    (pieces and heads recorded) and the decode graphs of sequences up to 4096 tokens."""
    engine = LLMEngine(ckpt, EngineConfig(backend=backend, max_num_seqs=64, max_model_len=4096))
    free = _free_bytes(backend)
    t0 = time.perf_counter()
    engine.warm_up()
    seconds = time.perf_counter() - t0
    used = free - _free_bytes(backend) if free is not None else None
    runner = engine.runner
    pieces, decode = getattr(runner, "piecewise_graphs", None), getattr(runner, "decode_graphs", None)
    cost = {
        "warm_up_s": seconds,
        "device_MiB": None if used is None else used / 2**20,
        "token_buckets": len(runner.layout.token_sizes) if hasattr(runner, "layout") else 0,
        "piecewise_graphs": pieces.num_graphs if pieces is not None else 0,
        "decode_graphs": decode.num_graphs if decode is not None else 0,
    }
    log(f"[graphs] warm-up {seconds:.1f} s, {cost['device_MiB']} MiB: {cost}")
    del engine, runner, pieces, decode
    release_device_memory(backend)
    return cost


def _free_bytes(backend: str) -> int | None:
    if backend != "cuda":
        return None
    from numba import cuda

    cuda.synchronize()
    return cuda.current_context().get_memory_info()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config-dir", default=LLAMA_3_2_1B_CONFIG_DIR)
    ap.add_argument("--backend", default="cuda", choices=["cuda", "sim", "numpy"], help="sim/numpy: a smoke run of the script")
    ap.add_argument("--num-requests", type=int, default=48, help="requests of the correctness workload")
    ap.add_argument("--throughput-requests", type=int, default=256)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--json", default=None, help="write all results here")
    args = ap.parse_args()
    prepare_backend(args.backend)
    ckpt, desc, seconds = load_model(None, args.config_dir)
    log(f"[mixed-graphs] {desc} built in {seconds:.1f} s")
    result = {"model": desc, "correctness": correctness(ckpt, args.backend, args.num_requests)}
    result["graph_cost"] = graph_cost(ckpt, args.backend)

    if not args.skip_throughput:
        variants = {  # name: (options, scheduling)
            "graphs + overlap": (EngineOptions(backend=args.backend, max_num_seqs=64), "both"),
            "enforce-eager + overlap": (EngineOptions(backend=args.backend, max_num_seqs=64, enforce_eager=True), "both"),
            "graphs, serial": (EngineOptions(backend=args.backend, max_num_seqs=64, async_scheduling=False), "continuous"),
        }
        result["throughput"] = {}
        for name, (options, scheduling) in variants.items():
            log(f"[throughput] {name}")
            run = run_throughput(ckpt, desc, options, num_requests=args.throughput_requests, scheduling=scheduling, log=log)
            print(f"\n== throughput, {name} ==\n{format_throughput(run)}", flush=True)
            result["throughput"][name] = run

    if not args.skip_latency:
        result["latency"] = {}
        for overlap in (True, False):
            options = EngineOptions(backend=args.backend, max_num_seqs=64, async_scheduling=overlap)
            run = run_latency(ckpt, desc, options, batch_sizes=(1, 32), log=log)
            result["latency"]["overlap" if overlap else "serial"] = run

    print("\n== correctness (tokens against eager serial) ==")
    for name, r in result["correctness"].items():
        print(f"{name:20s} requests differing {r['requests_differing']:3d}  steps {r['steps']:4d}  {r['seconds']:6.2f} s  "
              f"piecewise graphs {r['piecewise_graphs']:4d} ({len(r['token_buckets'])} token buckets)  "
              f"decode graphs {r['decode_graphs']:3d}  first difference {r['first_difference']}")  # fmt: skip
    print(f"\n== graphs recorded by warm_up (--max-num-seqs 64) ==\n{result['graph_cost']}")
    if "throughput" in result:
        print("\n== throughput summary (output tokens/s) ==")
        for name, run in result["throughput"].items():
            cells = ", ".join(
                f"{mode} {r['output_tokens_per_s']:.0f} ({r['steps']} steps, median step {r['median_step_ms']:.2f} ms, "
                f"warm-up {r['warmup_s']:.1f} s)"
                for mode, r in run["runs"].items()
            )
            ratio = run.get("continuous_vs_static")
            print(f"{name:24s} {cells}" + (f"; continuous/static {ratio:.2f}x" if ratio else ""))
    if "latency" in result:
        print("\n== decode latency (median ms per step) ==")
        for name, run in result["latency"].items():
            rows = ", ".join(f"batch {row['batch_size']}: {row['decode_ms_median']}" for row in run["results"])
            print(f"{name:8s} {rows}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
