"""The pointwise and row kernels compile to PTX for sm_90 with no FP64 and no local memory.

Compiled without a GPU (tests/ptx_check.py, in a child process with the simulator off), with the
argument types the launchers pass: bf16 weights arrive as their uint16 view, eps as float32.
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
from ptx_check import compile_ptx, ptx_problems

KERNELS = [  # (module, kernel, signature)
    ("numba_vllm.kernels.embedding", "embedding_kernel", "(i32(1), u16(2), f32(2))"),
    ("numba_vllm.kernels.rmsnorm", "rms_norm_kernel", "(f32(2), u16(1), f32(2), float32)"),
    ("numba_vllm.kernels.rmsnorm", "add_rms_norm_kernel", "(f32(2), f32(2), u16(1), f32(2), float32)"),
    ("numba_vllm.kernels.activation", "silu_and_mul_kernel", "(f32(2), f32(2))"),
    ("numba_vllm.kernels.sample", "argmax_kernel", "(f32(2), int64, i32(1), f32(1), i32(1))"),
    ("numba_vllm.kernels.sample", "sample_gumbel_kernel", "(f32(2), f32(1), u32(1), i32(1), int64, i32(1), f32(1), i32(1))"),
    ("numba_vllm.kernels.sample", "reduce_parts_kernel", "(f32(1), i32(1), int64, i32(1))"),
    ("numba_vllm.kernels.rope", "rope_kernel", "(f32(3), i32(1), f32(1), i32(1), f32(3), u16(4), u16(4))"),
]


@pytest.fixture(scope="module")
def ptx():
    return compile_ptx(KERNELS)


@pytest.mark.parametrize("module, name, signature", KERNELS, ids=[k[1] for k in KERNELS])
def test_kernel_compiles_without_fp64_or_local_memory(ptx, module, name, signature):
    result = ptx[f"{module}.{name}"]
    assert "error" not in result, result.get("error")
    assert ptx_problems(result["ptx"], hot=True) == []


def test_no_kernel_makes_calls_or_uses_approximate_trigonometry(ptx):
    for name, result in ptx.items():
        text = result["ptx"]
        assert not re.search(r"^\s*call", text, re.MULTILINE), f"{name}: a call (an external function or a bf16 shim)"
        assert "sin.approx" not in text and "cos.approx" not in text, name


def test_row_reductions_use_warp_shuffles(ptx):
    for name in ("rmsnorm.rms_norm_kernel", "rmsnorm.add_rms_norm_kernel", "sample.argmax_kernel"):
        assert "shfl.sync.bfly" in ptx[f"numba_vllm.kernels.{name}"]["ptx"], name
