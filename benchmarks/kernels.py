"""Per-kernel roofline table: kept for old commands, the same as `numba-vllm bench kernels`.

    python benchmarks/kernels.py [--only NAME] [--iters 30] [--json out.json]

The harness lives in `numba_vllm/bench/kernels.py`, the cases beside it (`matmul_cases.py`,
`attention_cases.py`, `pointwise_cases.py`); `docs/benchmarks.md` says what is measured and how.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from numba_vllm.cli import main  # noqa: E402

if __name__ == "__main__":
    main(["bench", "kernels", *sys.argv[1:]], prog_name="benchmarks/kernels.py")
