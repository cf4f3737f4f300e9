"""The attention kernels compile for sm_90 without a GPU, with no FP64 and no local memory.

Decode and prefill kernels are built per (query heads per kv head, head dim) by factories, so the
configurations checked here are bound to names in this module, which ptx_check's compiler child
imports (this directory is put on its PYTHONPATH). No local memory in the PTX means the per-lane
register arrays were fully unrolled. Compiling also type-checks the GPU-only paths (the 16-byte
``load_u32x4`` intrinsic), which the simulator never runs.
"""

from __future__ import annotations

import ptx_check
import pytest

from numba_vllm.kernels.decode_attention import decode_attention_kernel_for, decode_attention_merge_kernel
from numba_vllm.kernels.prefill_attention import prefill_attention_kernel_for

DECODE_SIG = "(f32(3), u16(4), u16(4), i32(2), i32(1), float32, f32(3))"
PREFILL_SIG = "(f32(3), u16(4), u16(4), i32(2), i32(1), i32(1), float32, f32(3))"

# (group, head_dim): Llama 3.2 1B / 3B / 8B / 70B-style groups at HD 64 and 128, tiny test models.
DECODE_CONFIGS = [(1, 64), (3, 64), (4, 64), (8, 64), (4, 128), (8, 128), (2, 16), (2, 8)]
PREFILL_CONFIGS = [(1, 64), (4, 64), (8, 64), (4, 128), (2, 16), (2, 8)]

# Module-level names for the compiler child: decode_g4_hd64, decode_g4_hd64_w8, prefill_g4_hd64, ...
for _group, _head_dim in DECODE_CONFIGS:
    globals()[f"decode_g{_group}_hd{_head_dim}"] = decode_attention_kernel_for(_group, _head_dim)
decode_g4_hd64_w8 = decode_attention_kernel_for(4, 64, 8)  # the small-batch build (8 warps a block)
decode_g4_hd64_split = decode_attention_kernel_for(4, 64, 8, True)  # split context: partials to a workspace
decode_merge = decode_attention_merge_kernel
for _group, _head_dim in PREFILL_CONFIGS:
    globals()[f"prefill_g{_group}_hd{_head_dim}"] = prefill_attention_kernel_for(_group, _head_dim)

HERE = __name__
SPECS = (  # (module, kernel name, signature, hot)
    [(HERE, f"decode_g{g}_hd{hd}", DECODE_SIG, True) for g, hd in DECODE_CONFIGS]
    + [(HERE, "decode_g4_hd64_w8", DECODE_SIG, True), (HERE, "decode_g4_hd64_split", DECODE_SIG, True)]
    + [(HERE, "decode_merge", "(f32(3), f32(3))", True)]
    + [(HERE, f"prefill_g{g}_hd{hd}", PREFILL_SIG, True) for g, hd in PREFILL_CONFIGS]
)


@pytest.fixture(scope="module")
def ptx():
    return ptx_check.compile_ptx([(module, name, sig) for module, name, sig, _ in SPECS])


@pytest.mark.parametrize("module,name,sig,hot", SPECS, ids=[s[1] for s in SPECS])
def test_kernel_compiles_clean(ptx, module, name, sig, hot):
    result = ptx[f"{module}.{name}"]
    assert "error" not in result, result.get("error")
    assert ptx_check.ptx_problems(result["ptx"], hot) == []


@pytest.mark.parametrize(
    "name", ["decode_g4_hd64", "decode_g4_hd64_split", "decode_g8_hd128", "prefill_g4_hd64", "prefill_g2_hd8"]
)
def test_kv_reads_use_16_byte_loads(ptx, name):
    assert "ld.global.nc.v4.u32" in ptx[f"{HERE}.{name}"]["ptx"]  # 8 bf16 of K or V per load
