"""``linear``: the one matrix product the model calls, out = x @ w.T, picking the kernel by token count.

Decode (a few tokens) is bound by reading the weights once: ``gemv.py`` streams them with 16-byte
loads. Prefill (many tokens) is bound by arithmetic: ``gemm.py`` reuses each staged weight across
128 tokens. ``GEMV_MAX_TOKENS`` is where one stops beating the other (see
``benchmarks/bench_matmul.py``, which times both around it).
"""

from numba_vllm.kernels.gemm import gemm
from numba_vllm.kernels.gemv import MAX_TOKENS, gemv

GEMV_MAX_TOKENS = 64  # largest token count sent to gemv (<= gemv.MAX_TOKENS); on an H200 gemv won at every M <= 64
assert GEMV_MAX_TOKENS <= MAX_TOKENS


def linear(x, w, out, accumulate: bool = False) -> None:
    """out = x @ w.T, or out += x @ w.T with ``accumulate`` (a residual add fused into the product).

    x (M, K) f32 device array, w (N, K) bf16 device array (PyTorch layout: out_features x
    in_features), out (M, N) f32 device array.
    """
    if x.shape[0] <= GEMV_MAX_TOKENS:
        gemv(x, w, out, accumulate)
    else:
        gemm(x, w, out, accumulate)
