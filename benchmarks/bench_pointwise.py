"""The pointwise and row kernels timed alone (wall time per call, and the GPU's own time with
torch), beside the same operations in torch. Needs an NVIDIA GPU.

    python benchmarks/bench_pointwise.py

The cases and this run are `numba_vllm/bench/pointwise_cases.py`; the roofline table over every
kernel is `numba-vllm bench kernels`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__":
    from numba_vllm.bench.pointwise_cases import main

    main()
