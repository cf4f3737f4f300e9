"""The matrix-product kernels compile for sm_90 without a GPU, with no FP64 and no local memory.

The hot kernels (gemm, gemm_tc, every gemv variant) must also show the instructions they were
written for: 16-byte global loads (``ld.global.nc.v4``), for gemm 16-byte shared loads
(``ld.shared.v4.f32``), for gemm_tc the tensor-core instruction (``mma.sync``) fed by ``ldmatrix``,
bf16 conversion (``cvt.rn.bf16x2.f32``), 16-byte shared stores and ``cp.async`` copies. Compiling
also type-checks the GPU-only code paths (the ``@intrinsic`` loads and the inline PTX of
``mma.py``), which the simulator never runs. The variants are the kernel registry's
(``numba_vllm/bench/kernel_report.py``); what the PTX cannot show (register spills, e.g. under
gemm_tc's 128 accumulators per lane) is checked by ``test_kernel_report.py`` after ptxas.
"""

import re

import pytest

from numba_vllm.bench.kernel_report import select
from tests.helpers import ptx as ptx_check

pytestmark = pytest.mark.slow  # compiles every variant (seconds each)

VARIANTS = select(("gemv", "gemv_unaligned", "gemm", "gemm_two_blocks", "gemm_tc", "sum_splits"))
GEMV_KEYS = [v.key for v in VARIANTS if v.name == "gemv"]
MMA_PER_STAGE = {"gemm_tc LARGE 128x256": 64, "gemm_tc SMALL 64x64": 16}  # warp's mma tiles (4 x 8, 2 x 4) x 2 k-steps


@pytest.fixture(scope="module")
def ptx():
    return ptx_check.compile_ptx(VARIANTS)


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.key for v in VARIANTS])
def test_kernel_compiles_clean(ptx, variant):
    result = ptx[variant.key]
    assert "error" not in result, result.get("error")
    assert ptx_check.ptx_problems(result["ptx"], variant.hot) == []


@pytest.mark.parametrize("key", [*GEMV_KEYS, "gemm"])
def test_hot_kernels_use_16_byte_loads(ptx, key):
    text = ptx[key]["ptx"]
    assert "ld.global.nc.v4.u32" in text  # weights: 8 bf16 per load
    assert "ld.global.nc.v4.f32" in text  # activations: 4 f32 per load
    assert not re.search(r"ld\.global(\.nc)?\.u16", text) or key == "gemm"  # gemm: only its K tail
    if key == "gemm":
        assert "ld.shared.v4.f32" in text


@pytest.mark.parametrize("key", sorted(MMA_PER_STAGE))
def test_gemm_tc_runs_on_tensor_cores(ptx, key):
    text = ptx[key]["ptx"]
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in text
    assert text.count("mma.sync") == MMA_PER_STAGE[key]
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in text
    assert "cvt.rn.bf16x2.f32" in text  # x rounded to bf16 on its way to shared memory
    assert "st.shared.v4.u32" in text
    assert "ld.global.nc.v4.f32" in text  # x, 4 floats per load
    assert "cp.async.cg.shared.global" in text  # w, 16 bytes global -> shared without registers
