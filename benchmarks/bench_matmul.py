"""gemv, gemm and the tensor-core gemm_tc timed alone, plus their crossover at M = 8..128 (where
`numba_vllm/kernels/matmul.py` switches). Needs an NVIDIA GPU.

    python benchmarks/bench_matmul.py

The cases and their timing are `numba_vllm/bench/matmul_cases.py`; the roofline table over every
kernel is `numba-vllm bench kernels` (`--only gemm` for these).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from numba_vllm.bench.matmul_cases import main  # noqa: E402

if __name__ == "__main__":
    main()
