"""Where a loaded step's GPU time goes: a kernel timeline of `bench throughput`'s workload.

    python benchmarks/kernel_timeline.py --max-num-seqs 64 --steps 1000 1150 [--trace trace.json.gz]

Runs the standard offline workload (`numba-vllm bench throughput`'s: 256 requests, prompts and
outputs of 100-1024 tokens, seed 0, greedy, EOS ignored) on random bf16 weights with Llama 3.2 1B's
config under continuous batching, and records every kernel and copy of the steps in `--steps`
(a window of the steady state: past the first wave of prompts, before the tail) with CUPTI through
torch.profiler, which sees the kernels numba launches as well as its own (the process shares one
CUDA context). Printed: the window's wall time and median host step time; the GPU's busy time (the
union of kernel and copy intervals) as a share of the span they cover, and the idle gaps between
them; per kernel, total time, share of the busy time, launches and mean time a launch. A GPU busy
most of the window is bound by its kernels; idle gaps point at the host (scheduling, launches,
copies). `--trace` keeps the Chrome trace (open it in chrome://tracing or Perfetto).

Needs a GPU and torch (a measuring tool, as in the other GPU benchmarks; the engine never imports
torch). Nsight Systems gives the same picture where it can write reports (`make profile-nsys`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from numba_vllm.bench.common import (  # noqa: E402
    EngineOptions,
    build_engine,
    load_model,
    record_decode_graphs,
    synchronize,
    warm_up,
)
from numba_vllm.bench.throughput import offline_workload, submit_workload  # noqa: E402

CONFIG_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "llama-3.2-1b-instruct"
NUM_REQUESTS, LENGTHS = 256, (100, 1024)  # bench throughput's defaults: prompt and output lengths alike
def short_name(name: str) -> str:
    """A kernel's function name out of the profiler's (numba's kernels arrive as
    ``numba_vllm::kernels::module::[factory::_3clocals_3e::]name[abi:...](args)``; copies keep theirs)."""
    return name.split("[abi:")[0].split("::")[-1][:60]


def busy_and_gaps(events: list[dict]) -> tuple[float, float, list[float]]:
    """(busy us: the union of the events' intervals, span us from the first start to the last end,
    the idle gaps between them in us); `events` are Chrome-trace events with `ts` and `dur`."""
    events = sorted(events, key=lambda e: e["ts"])
    busy, end, gaps = 0.0, None, []
    for e in events:
        start, stop = e["ts"], e["ts"] + e["dur"]
        if end is None or start > end:
            if end is not None:
                gaps.append(start - end)
            busy += e["dur"]
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    span = end - events[0]["ts"] if events else 0.0
    return busy, span, gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, nargs=2, default=(300, 420), metavar=("FIRST", "END"),
                    help="the window: steps FIRST..END-1")  # fmt: skip
    ap.add_argument("--top", type=int, default=20, help="kernels listed")
    ap.add_argument("--trace", default=None, help="also write the window's Chrome trace here (.json.gz)")
    args = ap.parse_args()
    import torch  # the profiler only: the engine never imports it

    first, end = args.steps
    if not 0 <= first < end:
        sys.exit(f"--steps: need 0 <= FIRST < END, got {first} {end}")

    ckpt, _, _ = load_model(None, str(CONFIG_DIR))
    workload = offline_workload(NUM_REQUESTS, 0, LENGTHS, LENGTHS, ckpt.config.vocab_size)
    options = EngineOptions(max_num_seqs=args.max_num_seqs)
    max_model_len = LENGTHS[1] + LENGTHS[1] + 1  # longest prompt + longest output + 1, as bench throughput sizes it
    engine, _ = build_engine(ckpt, options.engine_config(max_model_len, scheduling="continuous"))
    warm_up(engine, 64)
    record_decode_graphs(engine, workload.max_len)
    submit_workload(engine, workload)

    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    step, host_times = 0, []
    while engine.has_unfinished_requests() and step < end:
        if step == first:
            synchronize("cuda")
            profiler.start()
            window_start = time.perf_counter()
        started = time.perf_counter()
        engine.step()
        if step >= first:
            host_times.append(time.perf_counter() - started)
        step += 1
    if step < end:
        sys.exit(f"the workload ended after {step} steps, before the window's end ({end})")
    synchronize("cuda")
    wall = time.perf_counter() - window_start
    profiler.stop()

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        profiler.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())["traceEvents"]
        events = [e for e in trace if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        if args.trace:
            with path.open("rb") as src, gzip.open(args.trace, "wb") as dst:
                shutil.copyfileobj(src, dst)
    if not events:
        sys.exit("the profiler recorded no kernels (is CUPTI available?)")

    busy, span, gaps = busy_and_gaps(events)
    long_gaps = [g for g in gaps if g > 20]
    print(f"steps {first}..{end - 1} of the workload, --max-num-seqs {args.max_num_seqs}: {wall * 1e3:.1f} ms wall, "
          f"host step median {statistics.median(host_times) * 1e3:.2f} ms")  # fmt: skip
    print(f"{len(events)} kernels and copies over {span / 1e3:.1f} ms: GPU busy {busy / 1e3:.1f} ms ({busy / span:.1%}); "
          f"idle {sum(gaps) / 1e3:.1f} ms in {len(gaps)} gaps, "
          f"{sum(long_gaps) / 1e3:.1f} ms of it in {len(long_gaps)} over 20 us")  # fmt: skip
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        entry = per_kernel[short_name(e["name"])]
        entry[0] += e["dur"]
        entry[1] += 1
    print(f"{'kernel':<62}{'ms':>9}{'% busy':>8}{'launches':>10}{'us each':>9}")
    for name, (total, count) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{name:<62}{total / 1e3:>9.2f}{total / busy:>8.1%}{count:>10}{total / count:>9.1f}")


if __name__ == "__main__":
    main()
