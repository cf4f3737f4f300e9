"""The pointwise and row kernels compile to PTX for sm_90 with no FP64 and no local memory.

Compiled without a GPU (the kernel registry's variants, ``numba_vllm/bench/kernel_report.py``: the
argument types the launchers pass, bf16 weights as their uint16 view, eps as float32).
What this guards against:
- a float literal or Python float argument that turns the arithmetic into FP64;
- ``math.cos``/``math.sin`` (libdevice's cosf/sinf use FP64 and a local array in their slow path
  for |x| > 105615), which rope replaces with its own float32 reduction;
- numba-cuda's bf16 <-> float32 conversions (calls through local memory), replaced by a bit-cast
  (loads) and ``cvt.rn.bf16x2.f32`` (rope's K/V cache stores);
- register arrays or spills in local memory.
Every kernel here is on the per-token path, so all count as hot.
"""

import re

import pytest

from numba_vllm.bench.kernel_report import select
from tests.helpers.ptx import compile_ptx, ptx_problems

pytestmark = pytest.mark.slow  # compiles every kernel (seconds each)

VARIANTS = select(("embedding", "rms_norm", "add_rms_norm", "silu_and_mul", "silu_and_mul_bf16", "gather_rows", "argmax",
                   "sample_gumbel", "reduce_parts", "rope", "logits_mask"))  # fmt: skip


@pytest.fixture(scope="module")
def ptx():
    return compile_ptx(VARIANTS)


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.key for v in VARIANTS])
def test_kernel_compiles_without_fp64_or_local_memory(ptx, variant):
    result = ptx[variant.key]
    assert "error" not in result, result.get("error")
    assert variant.hot
    assert ptx_problems(result["ptx"], hot=True) == []


def test_no_kernel_makes_calls_or_uses_approximate_trigonometry(ptx):
    for key, result in ptx.items():
        text = result["ptx"]
        assert not re.search(r"^\s*call", text, re.MULTILINE), f"{key}: a call (an external function or a bf16 shim)"
        assert "sin.approx" not in text and "cos.approx" not in text, key


def test_row_reductions_use_warp_shuffles(ptx):
    for key in ("rms_norm", "add_rms_norm", "argmax"):
        assert "shfl.sync.bfly" in ptx[key]["ptx"], key
