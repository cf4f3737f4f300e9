"""Benchmarks behind `numba-vllm bench`: one module per benchmark, each a plain function returning a
JSON-ready dict (the command prints a table from it and writes it with `--json`).

- `latency.py`: per-token decode time at a few batch sizes and time to first token;
- `throughput.py`: the offline workload (many requests of mixed lengths submitted at once), under
  continuous and static scheduling;
- `kernels.py`: the per-kernel roofline table (cases in `matmul_cases.py`, `attention_cases.py`,
  `pointwise_cases.py`);
- `kernel_report.py`: `bench kernels --static`, every kernel's registers, spills, shared memory and
  H200 occupancy from ptxas, without a GPU;
- `hf.py`: the same latency and throughput workloads on Hugging Face transformers, same weights, for
  `--compare-hf` (torch and transformers are imported there only, never by the engine);
- `common.py`: what they share: the model, the engine, the clock, the tables.

Only the `*_cases.py` modules import numba.cuda at module import (the kernel benchmark imports them
when it runs); the others do not, since the `sim` backend must be chosen before numba.cuda loads.
"""
