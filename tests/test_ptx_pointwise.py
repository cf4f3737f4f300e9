"""The pointwise and row kernels compile to PTX for sm_90 with no FP64 and no local memory.

Compiled without a GPU (tests/helpers/ptx.py, in a child process with the simulator off), with the
argument types the launchers pass (tests/helpers/ptx_kernels.py): bf16 weights arrive as their uint16
view, eps as float32.
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

from tests.helpers.ptx import check_compiled_clean
from tests.helpers.ptx_kernels import POINTWISE

pytestmark = pytest.mark.slow  # compiles 8 kernels through NVVM: about 10 s
PTX_SPECS = POINTWISE  # compiled by conftest.py's ptx fixture


@pytest.mark.parametrize("module,name,sig,hot", PTX_SPECS, ids=[s[1] for s in PTX_SPECS])
def test_kernel_compiles_without_fp64_or_local_memory(ptx, module, name, sig, hot):
    check_compiled_clean(ptx[f"{module}.{name}"], hot)


def test_no_kernel_makes_calls_or_uses_approximate_trigonometry(ptx):
    for name, result in ptx.items():
        text = result["ptx"]
        assert not re.search(r"^\s*call", text, re.MULTILINE), f"{name}: a call (an external function or a bf16 shim)"
        assert "sin.approx" not in text and "cos.approx" not in text, name


def test_row_reductions_use_warp_shuffles(ptx):
    for name in ("rmsnorm.rms_norm_kernel", "rmsnorm.add_rms_norm_kernel", "sample.argmax_kernel"):
        assert "shfl.sync.bfly" in ptx[f"numba_vllm.kernels.{name}"]["ptx"], name
