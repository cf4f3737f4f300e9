"""The attention kernels compile for sm_90 without a GPU, with no FP64 and no local memory.

Decode and prefill kernels are built per (query heads per kv head, head dim) by factories; the
configurations checked are listed in tests/helpers/ptx_kernels.py. No local memory in the PTX means
the per-lane register arrays were fully unrolled. Compiling also type-checks the GPU-only paths (the
16-byte ``load_u32x4`` intrinsic), which the simulator never runs.
"""

import pytest

from tests.helpers.ptx import check_compiled_clean
from tests.helpers.ptx_kernels import ATTENTION, HERE

pytestmark = pytest.mark.slow  # compiles 17 kernels through NVVM: about 20 s
PTX_SPECS = ATTENTION  # compiled by conftest.py's ptx fixture


@pytest.mark.parametrize("module,name,sig,hot", PTX_SPECS, ids=[s[1] for s in PTX_SPECS])
def test_kernel_compiles_clean(ptx, module, name, sig, hot):
    check_compiled_clean(ptx[f"{module}.{name}"], hot)


@pytest.mark.parametrize(
    "name", ["decode_g4_hd64", "decode_g4_hd64_split", "decode_g8_hd128", "prefill_g4_hd64", "prefill_g2_hd8"]
)
def test_kv_reads_use_16_byte_loads(ptx, name):
    assert "ld.global.nc.v4.u32" in ptx[f"{HERE}.{name}"]["ptx"]  # 8 bf16 of K or V per load
