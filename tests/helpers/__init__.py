"""Code shared by the test modules: they import it from here, never from one another.

- ``tiny_llama``: tiny random Llama configs, weights and checkpoints built on the fly;
- ``hf_tiny``: three tiny random Llamas with logits computed by Hugging Face transformers;
- ``smollm2``: the default model (SmolLM2-135M-Instruct) and transformers' answers for it;
- ``products``: random matrix products checked against float64 NumPy (gemv, gemm, gemm_tc);
- ``ptx``: compiling the kernel registry's variants to PTX without a GPU, and what PTX must not hold.
"""

from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"  # tests/data: reference outputs and configs
# The share of the free GPU memory a GPU test's engine takes for its KV cache (instead of the 0.9
# default): `make test-gpu` runs several test processes on one GPU, and an engine holding most of its
# memory would leave the others none.
GPU_TEST_MEMORY_SHARE = 0.05
