"""``linear``: the one matrix product the model calls, out = x @ w.T, picking the kernel by token count.

Decode of a few sequences is bound by reading the weights once: ``gemv.py`` streams them with 16-byte
loads. More tokens (a large decode batch, a prefill) go to a tiled GEMM that reuses each staged
weight across its block's tokens. ``GEMV_MAX_TOKENS`` is where one stops beating the other (see
``benchmarks/bench_matmul.py``, which times both around it).

Three prefill GEMMs, chosen by the caller's ``gemm`` (``EngineConfig.prefill_gemm``):

- ``"tensor_cores"``: ``gemm_tc.py``, ``mma.sync`` on bf16 operands with fp32 accumulation.
  The activations are rounded to bf16 as they are staged (the weights already are), so results
  differ from the fp32 path by about 2^-9 relative per product.
- ``"wgmma"``: ``gemm_wgmma.py``, Hopper's warpgroup ``wgmma`` fed by the TMA, on the same bf16
  operands (H100/H200 only: it needs sm_90a). On an H200 it beat gemm_tc on every shape measured,
  2-4x (M = 4 .. 4096 on Llama 3.2 1B's weights: no crossover).
- ``"auto"`` (default): ``"wgmma"`` on a GPU of compute capability 9.0, else ``"tensor_cores"``
  (other GPUs, and the simulator, where gemm_tc is the cheaper one to emulate).
- ``"fp32"``: ``gemm.py``, the plain register-tiled SGEMM on the FMA units (x stays fp32): the
  readable reference path, slower (~32 against a 200+ TFLOP/s target on an H200).

What comes before and after a product in a Llama layer can ride along: ``norm`` (the RMSNorm of x)
and ``silu_mul`` (SwiGLU on a [gate; up] product). When gemv runs they are fused into it (no
launch and no pass over memory of their own: 33 fewer launches in a Llama 3.2 1B decode step, and
16 fewer for SwiGLU); otherwise ``linear`` runs them as their own kernels (``rms_norm``,
``silu_and_mul``) through the caller's scratch buffers ``normed`` and ``gate_up``. When gemm_wgmma
runs the product, the norm writes its output as bf16 straight into that GEMM's x workspace, and
SwiGLU runs in the gate/up product's epilogue (``gemm_wgmma_silu_mul``: no f32 product, no launch
of its own) and leaves only the bf16 x of the down product after it, or, where the f32 output is
read too (a traced step), adds a bf16 copy to it: those products skip the conversion pass of x
(see ``linear``: 49 of the 65 conversions of a Llama 3.2 1B step).
"""

from dataclasses import dataclass

from numba_vllm.kernels._launch import KernelError
from numba_vllm.kernels._launch import hopper as _hopper  # (a module name: tests replace it)
from numba_vllm.kernels.activation import silu_and_mul
from numba_vllm.kernels.gemm import gemm
from numba_vllm.kernels.gemm_tc import gemm_tc
from numba_vllm.kernels.gemm_wgmma import (
    bf16_x_destination,
    gemm_wgmma,
    gemm_wgmma_silu_mul,
    silu_mul_destination,
    x_copy_buffer,
)
from numba_vllm.kernels.gemv import MAX_TOKENS, gemv, gemv_fuses
from numba_vllm.kernels.rmsnorm import rms_norm

GEMV_MAX_TOKENS = 8  # largest token count sent to gemv (<= gemv.MAX_TOKENS). H200, N=8192 K=2048 (us, gemv / gemm_tc):
# M=8 21.6 / 26.6, M=16 36.2 / 27.3, M=64 126 / 34.8: past a few tokens gemv's FMAs, not its loads, bound it.
# gemv / gemm_wgmma: N=8192 M=4 16.9 / 19.1, M=8 21.9 / 19.7, M=16 36.7 / 21.1; N=2048 M=8 9.2 / 11.4, M=16 12.2 / 11.7
assert GEMV_MAX_TOKENS <= MAX_TOKENS


@dataclass
class GemmWorkspace:
    """The device scratch of the tensor-core GEMMs, allocated by the model (`model.llama.buffer_specs`)."""

    partials: object  # (gemm_tc.split_workspace_floats(SMs),) f32: the parts of a split K (gemm_tc, gemm_wgmma)
    x_bf16: object  # (>= tokens x K,) uint16: x rounded to bf16 for the TMA copies (gemm_wgmma)
    # (>= tokens x F,) uint16: SwiGLU's output in bf16 when the gate/up product computes it in its
    # epilogue (gemm_wgmma_silu_mul), the down product's x; None: SwiGLU always runs on its own
    act_bf16: object = None
    # (array, buffer): the (M, F) f32 array SwiGLU's output went to, and the buffer (x_bf16 or
    # act_bf16) from whose start its bf16 copy waits for the next product alone: `linear` clears it
    # at every call, after taking it when that product's x is the array
    handed: tuple | None = None
    # (gemm_wgmma.TILE_COUNTERS,) int32, zeros: the count of each output tile's parts written in a
    # K-split product, left at zero by each; None: each product allocates its own (and its parts)
    tile_counters: object = None


def gemm_auto(x, w, out, accumulate: bool = False, workspace: GemmWorkspace | None = None) -> None:
    """The default prefill GEMM: gemm_wgmma on Hopper, gemm_tc elsewhere (same contract)."""
    if _hopper():
        gemm_wgmma(x, w, out, accumulate, workspace=workspace)
    else:
        gemm_tc(x, w, out, accumulate, workspace=workspace and workspace.partials)


# What runs products of more than GEMV_MAX_TOKENS tokens: (x, w, out, accumulate, GemmWorkspace | None) -> None
PREFILL_GEMMS = {
    "auto": gemm_auto,
    "tensor_cores": lambda x, w, out, accumulate, ws: gemm_tc(x, w, out, accumulate, workspace=ws and ws.partials),
    "fp32": lambda x, w, out, accumulate, ws: gemm(x, w, out, accumulate),  # never splits K: no scratch
    "wgmma": lambda x, w, out, accumulate, ws: gemm_wgmma(x, w, out, accumulate, workspace=ws),
}


def _runs_wgmma(gemm: str) -> bool:
    """Whether ``PREFILL_GEMMS[gemm]`` is gemm_wgmma (which reads x as bf16 from the workspace)."""
    return gemm == "wgmma" or (gemm == "auto" and _hopper())


def linear(
    x, w, out, accumulate: bool = False, norm=None, silu_mul: bool = False, normed=None, gate_up=None,
    gemm: str = "auto", workspace: GemmWorkspace | None = None, next_product_only: bool = False,
) -> None:
    """out = x @ w.T, or out += x @ w.T with ``accumulate`` (a residual add fused into the product).

    x (M, K) f32 device array, w (N, K) bf16 device array (PyTorch layout: out_features x
    in_features), out (M, N) f32 device array.
    ``norm=(weight (K,) bf16, eps)``: the product takes rms_norm(x) * weight in place of x.
    ``silu_mul``: w is [gate; up] (2F, K) and out (M, F) = silu(x @ gate.T) * (x @ up.T).
    Unfused, they need ``normed`` (>= M, K) and ``gate_up`` (>= M, 2F) f32 scratch buffers.
    ``gemm``: which of ``PREFILL_GEMMS`` runs a product of more than ``GEMV_MAX_TOKENS`` tokens, with
    ``workspace`` its split-K scratch (`gemm_tc.split_workspace_floats`; None: allocated per call).

    ``next_product_only`` (with ``silu_mul``): out is read by the next product alone, as its x (the
    MLP's down product), so when gemm_wgmma runs and the workspace has ``act_bf16``
    (``silu_mul_destination``), SwiGLU runs in the gate/up product's epilogue
    (``gemm_wgmma_silu_mul``): neither the (M, 2F) f32 product nor out's f32 values are written,
    only out's bf16 copy, which the next call takes. ``gate_up`` is not written then.

    Who writes the bf16 x that gemm_wgmma copies by the TMA, when gemm_wgmma runs the product
    (``bf16_x_destination`` gives a view: every Llama shape):
    - after ``norm``: ``rms_norm`` stores its output as bf16 straight into the workspace (``normed``
      is not written) and the product skips its conversion pass;
    - after ``silu_mul``: the gate/up product's epilogue (above), or else ``silu_and_mul`` writes out
      (f32) and its bf16 copy into the x workspace; either way ``workspace.handed`` records where
      out's copy is. The next call, if its x is that array and gemm_wgmma runs it, takes the copy as
      it is; any other call forgets it. The copy's bits are the conversion's (both round the same
      f32 values to nearest even): the results do not change.
    - otherwise (the attention output before the o product): gemm_wgmma converts x itself.
    """
    num_tokens = x.shape[0]
    handed = workspace.handed if workspace is not None else None
    if workspace is not None:
        workspace.handed = None  # it lives until the next product only
    copy = handed[1] if handed is not None and handed[0] is x else None  # the buffer holding x's bf16 copy
    if num_tokens <= GEMV_MAX_TOKENS and gemv_fuses(x, w):
        gemv(x, w, out, accumulate, norm, silu_mul)
        return
    if silu_mul and accumulate:
        raise KernelError("linear: silu_mul does not accumulate")
    wgmma = num_tokens > GEMV_MAX_TOKENS and _runs_wgmma(gemm)
    if copy is not None and not (wgmma and bf16_x_destination(workspace, num_tokens, x.shape[1], w, copy) is not None):
        if copy is workspace.act_bf16:  # SwiGLU ran in the epilogue: x's f32 values were never written
            raise KernelError(f"linear: x ({num_tokens} x {x.shape[1]}) exists only as a bf16 copy this product cannot read")
        copy = None  # the f32 x is there: convert it
    if norm is not None:
        weight, eps = norm
        x_bits = bf16_x_destination(workspace, num_tokens, x.shape[1], w) if wgmma else None  # (M, K) uint16
        if x_bits is not None:
            rms_norm(x, weight, x_bits, eps)
            copy = x_copy_buffer(workspace)
        else:
            rms_norm(x, weight, normed[:num_tokens], eps)
            x = normed[:num_tokens]
    act_bits = silu_mul_destination(workspace, num_tokens, w) if silu_mul and next_product_only and wgmma else None
    if act_bits is not None:  # (M, F) uint16: SwiGLU in the product's epilogue
        gemm_wgmma_silu_mul(x, w, act_bits, workspace=workspace, x_copy=copy)
        workspace.handed = (out, workspace.act_bf16)
        return
    product = gate_up[:num_tokens] if silu_mul else out
    if num_tokens <= GEMV_MAX_TOKENS:
        gemv(x, w, product, accumulate)
    elif copy is not None:
        gemm_wgmma(x, w, product, accumulate, workspace=workspace, x_copy=copy)  # x: its shape alone
    else:
        PREFILL_GEMMS[gemm](x, w, product, accumulate, workspace)
    if silu_mul:
        # out is the next product's x: its bf16 copy for gemm_wgmma, (M, F) uint16, when that may run it
        out_bits = bf16_x_destination(workspace, num_tokens, out.shape[1]) if wgmma and workspace is not None else None
        silu_and_mul(product, out, out_bits)
        if out_bits is not None:
            workspace.handed = (out, workspace.x_bf16)
