"""The matrix-product kernels compile for sm_90 without a GPU, with no FP64 and no local memory.

The hot kernels (gemm, the three gemv tiles) must also show the instructions they were written
for: 16-byte global loads (``ld.global.nc.v4``), and for gemm 16-byte shared loads
(``ld.shared.v4.f32``). Compiling also type-checks the GPU-only code paths (the ``@intrinsic``
loads), which the simulator never runs.
"""

import re

import ptx_check
import pytest

GEMV = "numba_vllm.kernels.gemv"
GEMM = "numba_vllm.kernels.gemm"
LINEAR_SIG = "(f32(2), u16(2), f32(2), int64, int64)"
SPECS = [  # (module, kernel, signature, hot)
    (GEMV, "gemv_t1_kernel", LINEAR_SIG, True),
    (GEMV, "gemv_t2_kernel", LINEAR_SIG, True),
    (GEMV, "gemv_t4_kernel", LINEAR_SIG, True),
    (GEMV, "gemv_unaligned_kernel", "(f32(2), u16(2), f32(2), int64)", False),
    (GEMM, "gemm_kernel", LINEAR_SIG, True),
]

@pytest.fixture(scope="module")
def ptx():
    return ptx_check.compile_ptx([(module, name, sig) for module, name, sig, _ in SPECS])


@pytest.mark.parametrize("module,name,sig,hot", SPECS, ids=[s[1] for s in SPECS])
def test_kernel_compiles_clean(ptx, module, name, sig, hot):
    result = ptx[f"{module}.{name}"]
    assert "error" not in result, result.get("error")
    assert ptx_check.ptx_problems(result["ptx"], hot) == []


@pytest.mark.parametrize("name", ["gemv_t1_kernel", "gemv_t2_kernel", "gemv_t4_kernel", "gemm_kernel"])
def test_hot_kernels_use_16_byte_loads(ptx, name):
    module = GEMM if name.startswith("gemm") else GEMV
    text = ptx[f"{module}.{name}"]["ptx"]
    assert "ld.global.nc.v4.u32" in text  # weights: 8 bf16 per load
    assert "ld.global.nc.v4.f32" in text  # activations: 4 f32 per load
    assert not re.search(r"ld\.global(\.nc)?\.u16", text) or name == "gemm_kernel"  # gemm: only its K tail
    if name == "gemm_kernel":
        assert "ld.shared.v4.f32" in text
