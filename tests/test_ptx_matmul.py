"""The matrix-product kernels compile for sm_90 without a GPU, with no FP64 and no local memory.

The hot kernels (gemm, gemm_tc, the three gemv tiles) must also show the instructions they were
written for: 16-byte global loads (``ld.global.nc.v4``), for gemm 16-byte shared loads
(``ld.shared.v4.f32``), for gemm_tc the tensor-core instruction (``mma.sync``) fed by ``ldmatrix``,
bf16 conversion (``cvt.rn.bf16x2.f32``), 16-byte shared stores and ``cp.async`` copies. Compiling
also type-checks the GPU-only code paths (the ``@intrinsic`` loads and the inline PTX of
``mma.py``), which the simulator never runs.

Where a ``ptxas`` is on the PATH, gemm_tc's PTX is also assembled for sm_90 to check what the PTX
cannot show: no register spills (its 128 accumulators per lane leave little room under 255).
"""

import re
import shutil
import subprocess

import pytest

from tests.helpers.ptx import check_compiled_clean
from tests.helpers.ptx_kernels import GEMM, HERE, MATMUL

pytestmark = pytest.mark.slow  # compiles 9 kernels through NVVM: about 30 s
PTX_SPECS = MATMUL  # compiled by conftest.py's ptx fixture
MMA_PER_STAGE = {"gemm_tc_large": 64, "gemm_tc_small": 16}  # warp's mma tiles (4 x 8, 2 x 4) x 2 k-steps, unrolled


@pytest.mark.parametrize("module,name,sig,hot", PTX_SPECS, ids=[s[1] for s in PTX_SPECS])
def test_kernel_compiles_clean(ptx, module, name, sig, hot):
    check_compiled_clean(ptx[f"{module}.{name}"], hot)


GEMV_NAMES = ["gemv_t1_kernel", "gemv_t2_kernel", "gemv_t4_kernel", "gemv_t1_norm_kernel", "gemv_t4_norm_silu_kernel"]


@pytest.mark.parametrize("name", [*GEMV_NAMES, "gemm_kernel"])
def test_hot_kernels_use_16_byte_loads(ptx, name):
    module = GEMM if name.startswith("gemm") else HERE
    text = ptx[f"{module}.{name}"]["ptx"]
    assert "ld.global.nc.v4.u32" in text  # weights: 8 bf16 per load
    assert "ld.global.nc.v4.f32" in text  # activations: 4 f32 per load
    assert not re.search(r"ld\.global(\.nc)?\.u16", text) or name == "gemm_kernel"  # gemm: only its K tail
    if name == "gemm_kernel":
        assert "ld.shared.v4.f32" in text


@pytest.mark.parametrize("name", sorted(MMA_PER_STAGE))
def test_gemm_tc_runs_on_tensor_cores(ptx, name):
    text = ptx[f"{HERE}.{name}"]["ptx"]
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in text
    assert text.count("mma.sync") == MMA_PER_STAGE[name]
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in text
    assert "cvt.rn.bf16x2.f32" in text  # x rounded to bf16 on its way to shared memory
    assert "st.shared.v4.u32" in text
    assert "ld.global.nc.v4.f32" in text  # x, 4 floats per load
    assert "cp.async.cg.shared.global" in text  # w, 16 bytes global -> shared without registers


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="no ptxas on the PATH")
@pytest.mark.parametrize("name", sorted(MMA_PER_STAGE))
def test_gemm_tc_assembles_without_spills(ptx, tmp_path, name):
    text = ptx[f"{HERE}.{name}"]["ptx"]
    version = re.search(r"release (\d+)\.(\d+)", subprocess.run(["ptxas", "--version"], capture_output=True, text=True).stdout)
    if version and (int(version[1]), int(version[2])) < (13, 0):
        pytest.skip("ptxas older than CUDA 13")
    # NVVM may stamp a newer PTX ISA version than this ptxas knows; the kernel uses nothing newer than 9.0
    path = tmp_path / "gemm_tc.ptx"
    path.write_text(re.sub(r"^\.version \d+\.\d+", ".version 9.0", text, count=1, flags=re.M))
    proc = subprocess.run(["ptxas", "-arch=sm_90", "-v", str(path), "-o", str(tmp_path / "gemm_tc.cubin")],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "0 bytes spill stores" in proc.stderr, proc.stderr
    registers = int(re.search(r"Used (\d+) registers", proc.stderr)[1])
    assert registers <= 255
